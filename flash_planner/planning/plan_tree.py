"""Plans with recovery, as trees.

A plan is a list of nodes run in order. A node is a step, `{"skill": NAME, "args": {...}}`,
or one of the two structures robots use most:
- `{"retry": N, "plan": [nodes]}`: the nodes run in order, and run again from the first
  while they fail, N attempts in all (BehaviorTree.CPP's RetryUntilSuccessful);
- `{"fallback": [[nodes], [nodes], ...]}`: the alternatives run in order until one succeeds
  (a Fallback of Sequences).
A plan given by a caller (or as a BehaviorTree.CPP tree, bt.py) may also hold
`{"invert": [nodes]}` (success is failure and failure success: Inverter) and
`{"force_success": [nodes]}` (ForceSuccess); the model's grammar offers only the two
above. Every list of plain steps is a plan. Structures nest at most MAX_DEPTH deep, a retry
has 2 to MAX_ATTEMPTS attempts and a fallback 2 to MAX_ALTERNATIVES alternatives.

A leaf's path names it in the tree: the index of each node on the way, a fallback's
alternative counted as a level (`1.0.2`: node 1, its first alternative, that one's node 2).
A flat plan's paths are its step indices. Leaves are numbered in the order they are
written (`leaves`), which is the order the gate checks them in and approvals name them by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 2
MAX_ATTEMPTS = 5
MAX_ALTERNATIVES = 3
STRUCTURES = ("retry", "fallback", "invert", "force_success")


class TreeError(ValueError):
    """A plan tree that is not well formed; names the node by its path."""


@dataclass(frozen=True)
class Leaf:
    index: int                 # its number among the tree's leaves, in written order
    path: tuple[int, ...]
    step: dict[str, Any]


@dataclass(frozen=True)
class Sequence:
    children: tuple[Node, ...]


@dataclass(frozen=True)
class Fallback:
    children: tuple[Node, ...]      # each alternative a Sequence


@dataclass(frozen=True)
class Retry:
    attempts: int
    child: Sequence


@dataclass(frozen=True)
class Invert:
    child: Sequence


@dataclass(frozen=True)
class ForceSuccess:
    child: Sequence


Node = Leaf | Sequence | Fallback | Retry | Invert | ForceSuccess


def label(path: tuple[int, ...]) -> str:
    return ".".join(str(i) for i in path)


def at_node(path: tuple[int, ...]) -> str:
    """" at node 1.0.2" for a nested step, "" for a step of the plan's own list (its index
    says where it is): how errors name a step beside its index."""
    return f" at node {label(path)}" if len(path) > 1 else ""


def is_flat(plan: list[Any]) -> bool:
    return all(isinstance(n, dict) and not set(n) & set(STRUCTURES) for n in plan)


def tree_of(plan: Any) -> Sequence:
    """The tree of a plan's nodes (JSON values), or TreeError naming the first node that is
    not one; leaves are the step objects as given (validation checks them)."""
    if not isinstance(plan, list) or not plan:
        raise TreeError("the plan must be a non-empty list of steps")
    counter = [0]
    return _sequence(plan, (), 0, counter)


def _sequence(nodes: list[Any], path: tuple[int, ...], depth: int, counter: list[int]
              ) -> Sequence:
    return Sequence(tuple(_node(n, (*path, i), depth, counter) for i, n in enumerate(nodes)))


def _node(node: Any, path: tuple[int, ...], depth: int, counter: list[int]) -> Node:
    at = f"node {label(path)}"
    if not isinstance(node, dict):
        raise TreeError(f"{at}: expected a step or a structure object, got "
                        f"{type(node).__name__}")
    kinds = [k for k in STRUCTURES if k in node]
    if not kinds:
        counter[0] += 1
        return Leaf(counter[0] - 1, path, node)
    kind = kinds[0]
    if depth >= MAX_DEPTH:
        raise TreeError(f"{at}: structures nest at most {MAX_DEPTH} deep")
    if kind == "retry":
        _keys(node, {"retry", "plan"}, at)
        n = node["retry"]
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_ATTEMPTS:
            raise TreeError(f"{at}: retry must be an integer from 2 to {MAX_ATTEMPTS} "
                            f"(the attempts in all), got {n!r}")
        return Retry(n, _sequence(_list(node.get("plan"), f"{at}: retry's plan"), path,
                                  depth + 1, counter))
    if kind == "fallback":
        _keys(node, {"fallback"}, at)
        options = _list(node["fallback"], f"{at}: fallback")
        if not 2 <= len(options) <= MAX_ALTERNATIVES:
            raise TreeError(f"{at}: a fallback has 2 to {MAX_ALTERNATIVES} alternatives, "
                            f"got {len(options)}")
        return Fallback(tuple(
            _sequence(_list(option, f"{at}: alternative {j}"), (*path, j), depth + 1, counter)
            for j, option in enumerate(options)))
    _keys(node, {kind}, at)
    child = _sequence(_list(node[kind], f"{at}: {kind}"), path, depth + 1, counter)
    return Invert(child) if kind == "invert" else ForceSuccess(child)


def _keys(node: dict, allowed: set[str], at: str) -> None:
    extra = sorted(set(node) - allowed)
    if extra:
        raise TreeError(f"{at}: unknown field(s) {extra} beside {sorted(allowed)}")


def _list(value: Any, at: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise TreeError(f"{at} must be a non-empty list")
    return value


def leaves(node: Node) -> list[Leaf]:
    """Every step of the tree, in written order."""
    if isinstance(node, Leaf):
        return [node]
    if isinstance(node, (Sequence, Fallback)):
        return [leaf for child in node.children for leaf in leaves(child)]
    return leaves(node.child)


def with_steps(node: Node, steps: list[dict[str, Any]]) -> Node:
    """The tree with each leaf's step replaced by `steps[leaf.index]` (validated steps)."""
    if isinstance(node, Leaf):
        return Leaf(node.index, node.path, steps[node.index])
    if isinstance(node, Sequence):
        return Sequence(tuple(with_steps(c, steps) for c in node.children))
    if isinstance(node, Fallback):
        return Fallback(tuple(with_steps(c, steps) for c in node.children))
    child = with_steps(node.child, steps)
    if isinstance(node, Retry):
        return Retry(node.attempts, child)
    return Invert(child) if isinstance(node, Invert) else ForceSuccess(child)


def plan_of(node: Node) -> list[dict[str, Any]] | dict[str, Any]:
    """The JSON plan of a tree (a Sequence gives its list of nodes)."""
    if isinstance(node, Leaf):
        return node.step
    if isinstance(node, Sequence):
        return [plan_of(c) for c in node.children]
    if isinstance(node, Fallback):
        return {"fallback": [plan_of(c) for c in node.children]}
    if isinstance(node, Retry):
        return {"retry": node.attempts, "plan": plan_of(node.child)}
    return {"invert" if isinstance(node, Invert) else "force_success": plan_of(node.child)}


def run(node: Node, run_leaf) -> bool:
    """Run a tree as BehaviorTree.CPP ticks it to the end: `run_leaf(leaf) -> bool` runs one
    step (True: it succeeded); a Sequence stops at its first failure, a Fallback at its
    first success, a Retry runs its Sequence again after a failure until it succeeds or
    its attempts are spent, Invert swaps the outcome, ForceSuccess succeeds whatever its
    child did. What stops the whole run (a cancel, a step whose end is unknown) is the
    caller's to raise from `run_leaf`. True: the tree succeeded."""
    if isinstance(node, Leaf):
        return bool(run_leaf(node))
    if isinstance(node, Sequence):
        return all(run(child, run_leaf) for child in node.children)
    if isinstance(node, Fallback):
        return any(run(child, run_leaf) for child in node.children)
    if isinstance(node, Retry):
        return any(run(node.child, run_leaf) for _ in range(node.attempts))
    if isinstance(node, Invert):
        return not run(node.child, run_leaf)
    run(node.child, run_leaf)
    return True


def tree_schema(plan_schema: dict[str, Any]) -> dict[str, Any]:
    """A plan's JSON-Schema (skills.plan_schema: its items the steps) with retry and
    fallback nodes beside the steps, to MAX_DEPTH, the step schema written once ($defs)."""
    items = plan_schema["properties"]["plan"]["items"]

    def nodes(depth: int) -> dict[str, Any]:
        step = {"$ref": "#/$defs/step"}
        if depth >= MAX_DEPTH:
            return step
        inner = {"type": "array", "minItems": 1, "items": nodes(depth + 1)}
        retry = {"type": "object", "required": ["retry", "plan"], "additionalProperties": False,
                 "properties": {"retry": {"type": "integer", "minimum": 2,
                                          "maximum": MAX_ATTEMPTS}, "plan": inner}}
        fallback = {"type": "object", "required": ["fallback"], "additionalProperties": False,
                    "properties": {"fallback": {"type": "array", "minItems": 2,
                                                "maxItems": MAX_ALTERNATIVES, "items": inner}}}
        return {"anyOf": [step, retry, fallback]}

    plan = dict(plan_schema["properties"]["plan"], items=nodes(0))
    return {**plan_schema, "$defs": {"step": items}, "properties": {"plan": plan}}
