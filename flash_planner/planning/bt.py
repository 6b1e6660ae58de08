"""Plans as BehaviorTree.CPP v4 trees (what Nav2's bt_navigator runs and Groot2 edits), and
BT XML trees given by a caller as plans.

The vocabulary is BT.CPP's own: a plan is the `<Sequence>` of a `<BehaviorTree>`, a step an
action node in the compact form (`<pick object="cup" name="1.0"/>`: element name = skill,
arguments as input ports), `retry` a `<RetryUntilSuccessful num_attempts="N">`, `fallback`
a `<Fallback>` of `<Sequence>`s, `invert` an `<Inverter>`, `force_success` a
`<ForceSuccess>`; a structure's nodes always sit in a `<Sequence>`. Every node we write has
a `name`, the path of plan_tree (a leaf's `1.0.2`), so Groot2 and a tick's callback see the
names feedback and approvals use. A `<TreeNodesModel>` from the catalog (each skill an
Action with typed, described ports) goes in the same document.

Reading (`from_bt_xml`) accepts more of what people write than we emit: a nested
`<Sequence>` is spliced into its parent (the same run), a decorator's or an alternative's
single node needs no `<Sequence>`, `<Action ID="pick">` is read as `<pick>`. It refuses what
our executor does not run (Parallel, ReactiveSequence, SubTree, pre/post-condition scripts,
blackboard entries as values). The document is checked against `catalog_xsd` first, the
BT.CPP structure and each skill's ports and their types, enums and ranges; the limits of
plan_tree (depth, attempts, alternatives) come after, from `tree_of`. Argument values come
back typed by the catalog; the gate checks the rest, as for any plan.

Writing is bt_write.py (ElementTree only: `to_bt_xml`, `tree_nodes_model`, `catalog_xsd`,
the shared vocabulary and BtError), reading bt_read.py (`from_bt_xml`, with lxml, imported
when a tree is read); this module names both, so callers import from here.
"""

from __future__ import annotations

from .bt_read import from_bt_xml
from .bt_write import (
    BUILTIN,
    CONTROLS,
    DECORATORS,
    FORMAT,
    PORT_TYPES,
    RESERVED,
    BtError,
    catalog_xsd,
    to_bt_xml,
    tree_nodes_model,
)

__all__ = ["BUILTIN", "CONTROLS", "DECORATORS", "FORMAT", "PORT_TYPES", "RESERVED", "BtError",
           "catalog_xsd", "from_bt_xml", "to_bt_xml", "tree_nodes_model", "xml_or_why"]


def xml_or_why(plan, catalog) -> tuple[str, str]:
    """(the plan as BT.CPP XML, "") or ("", why BT.CPP cannot hold it: a value it would
    read as a blackboard entry): every door that answers a plan with its tree says so the
    same way, and keeps the plan's JSON."""
    try:
        return to_bt_xml(plan, catalog), ""
    except BtError as exc:
        return "", str(exc)
