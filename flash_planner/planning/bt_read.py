"""BT XML trees given by a caller read back as plans (`from_bt_xml`), with lxml, imported
when a tree is read (the `bt` extra): the document is checked against bt_write.py's
`catalog_xsd` first, each refusal one line naming the node; the limits of plan_tree (depth,
attempts, alternatives) come after, from `tree_of`. Argument values come back typed by the
catalog.
"""

from __future__ import annotations

import re
from typing import Any

from .bt_write import (
    BUILTIN,
    DECORATORS,
    FORMAT,
    RESERVED,
    BtError,
    catalog_xsd,
    is_blackboard,
    port_text,
)
from .parse import closest
from .plan_tree import MAX_ATTEMPTS, TreeError, label, tree_of
from .skills import Argument, SkillCatalog


def from_bt_xml(text: str | bytes, catalog: SkillCatalog) -> list[Any]:
    """The plan (plan_tree's JSON forms) of a BT XML document's main tree
    (main_tree_to_execute, or its only BehaviorTree), or BtError naming the first node we do
    not run."""
    etree = _lxml()
    parser = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False,
                             remove_comments=True, remove_pis=True,
                             encoding="utf-8" if isinstance(text, str) else None)
    try:
        doc = etree.fromstring(text.encode() if isinstance(text, str) else text, parser)
    except etree.XMLSyntaxError as exc:
        raise BtError(f"malformed XML: {exc.msg}") from None
    if doc.getroottree().docinfo.doctype:
        raise BtError("a BT XML tree may not declare a DOCTYPE")
    for tree in doc.iter("BehaviorTree"):     # <Action ID="pick"> is BT.CPP's <pick>
        for element in tree.iter("Action"):
            if catalog.get(str(element.get("ID"))) is not None:
                element.tag = element.attrib.pop("ID")
    main = _main_tree(doc, catalog)
    schema = etree.XMLSchema(etree.fromstring(catalog_xsd(catalog).encode()))
    if not schema.validate(doc):
        raise BtError(_describe(schema.error_log[0], doc, main, catalog))
    plan = _plan(list(main), (), catalog)
    try:
        tree_of(plan)
    except TreeError as exc:
        raise BtError(str(exc)) from None
    return plan


def _lxml():
    try:
        from lxml import etree
    except ImportError:
        raise ImportError("reading BT XML trees needs lxml, which is not installed "
                          "(pip install lxml)") from None
    return etree


def _main_tree(doc, catalog: SkillCatalog):
    if doc.tag != "root":
        raise BtError(f"line {doc.sourceline} <{doc.tag}>: a BT.CPP document's root is "
                      f'<root BTCPP_format="{FORMAT}">')
    trees = doc.findall("BehaviorTree")
    for tree in trees:
        if tree.get("ID") in RESERVED or catalog.get(str(tree.get("ID"))):
            raise BtError(f"line {tree.sourceline} <BehaviorTree>: ID {tree.get('ID')!r} names "
                          "a node, which BT.CPP refuses")
    main = doc.get("main_tree_to_execute")
    if main is not None:
        found = [t for t in trees if t.get("ID") == main]
        if not found:
            raise BtError(f"main_tree_to_execute is {main!r}, and no BehaviorTree has that "
                          f"ID (IDs: {', '.join(str(t.get('ID')) for t in trees) or 'none'})")
        return found[0]
    if len(trees) != 1:
        raise BtError(f"the document has {len(trees)} BehaviorTrees and no "
                      "main_tree_to_execute: name the one to run")
    return trees[0]


def _flatten(elements) -> list:
    """The nodes of one sequence level: a nested Sequence's children in its place."""
    out = []
    for element in elements:
        out += _flatten(element) if element.tag == "Sequence" else [element]
    return out


def _plan(elements, path: tuple[int, ...], catalog: SkillCatalog) -> list[Any]:
    return [_node(e, (*path, i), catalog) for i, e in enumerate(_flatten(elements))]


def _node(element, path: tuple[int, ...], catalog: SkillCatalog) -> Any:
    tag, children = element.tag, list(element)
    if tag == "Fallback":
        return {"fallback": [_plan([c], (*path, j), catalog) for j, c in enumerate(children)]}
    if tag == "RetryUntilSuccessful":
        return {"retry": int(element.get("num_attempts")), "plan": _plan(children, path,
                                                                         catalog)}
    if tag in DECORATORS:
        return {DECORATORS[tag]: _plan(children, path, catalog)}
    skill = catalog.get(tag)
    args = {}
    for arg in skill.args:
        if arg.name in element.attrib:
            value = element.get(arg.name)
            if is_blackboard(value):
                raise BtError(f"node {label(path)} <{tag}>: argument '{arg.name}' is "
                              f"{value!r}, a blackboard entry, which our executor does not "
                              "read: give the value itself")
            args[arg.name] = _typed(value, arg.type)
    return {"skill": tag, "args": args}


def _typed(text: str, kind: str) -> Any:
    """A port's text (valid for its XSD type) as the catalog's type; a number written as an
    integer stays one, as in JSON."""
    if kind == "string":
        return text
    text = text.strip()
    if kind == "boolean":
        return text in ("true", "1")
    if kind == "integer" or re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    return float(text)


# -- XSD errors as one line naming the node ----------------------------------------------

def _labels(main) -> dict[Any, str]:
    """Each node element of the main tree -> its plan path, as _plan numbers them; nodes we
    do not run number their children as a sequence would."""
    labels = {}

    def level(elements, path):
        for i, element in enumerate(_flatten(elements)):
            at = (*path, i)
            labels[element] = label(at)
            if element.tag == "Fallback":
                for j, option in enumerate(element):
                    labels.setdefault(option, label((*at, j)))
                    level([option], (*at, j))
            else:
                level(list(element), at)

    level(list(main), ())
    return labels


_UNEXPECTED = "This element is not expected"


def _describe(entry, doc, main, catalog: SkillCatalog) -> str:
    """One lxml XSD error as `node P <tag>: what` (`line N <tag>` outside the main tree)."""
    tree = doc.getroottree()
    element = {tree.getpath(e): e for e in doc.iter()}.get(entry.path, doc)
    tag, message = element.tag, entry.message
    where = _labels(main).get(element)
    at = f"node {where} <{tag}>" if where else f"line {element.sourceline} <{tag}>"
    attr = re.search(r"attribute '([^']+)'", message)
    port = attr.group(1) if attr else None
    skill = catalog.get(tag)
    if _UNEXPECTED in message:
        return f"{at}: {_unexpected(element, catalog)}"
    if "Missing child element" in message:
        return f"{at}: has no child node"
    if "Character content is not allowed" in message:
        return f"{at}: holds text (a node's ports are its attributes)"
    if "Element content is not allowed" in message:
        return f"{at}: an action node has no children"
    if tag == "root" and port == "BTCPP_format":
        return f'{at}: BTCPP_format must be "{FORMAT}" (a BehaviorTree.CPP v4 tree)'
    if tag == "RetryUntilSuccessful" and port == "num_attempts":
        got = element.get("num_attempts")
        return (f"{at}: num_attempts must be an integer from 2 to {MAX_ATTEMPTS} (the "
                "attempts in all), " + ("and is missing" if got is None else f"got {got!r}"))
    if port and "is not allowed" in message:
        if port.startswith("_"):
            return f"{at}: BT.CPP's {port} (a script on the node) is not supported"
        if skill is None:
            return f"{at}: '{port}' is not a port of <{tag}>"
        allowed = ", ".join(a.name for a in skill.args)
        return (f"{at}: '{port}' is not an argument of {tag} "
                + (f"(its arguments: {allowed})" if allowed else "(it takes none)"))
    if port and "is required but missing" in message:
        return f"{at}: missing argument '{port}'"
    arg = next((a for a in skill.args if a.name == port), None) if skill else None
    if arg is not None:
        return _bad_value(at, arg, element.get(arg.name), message)
    return f"{at}: {re.sub(r'^Element [^:]*: | Expected is .*$', '', message)}"


def _unexpected(element, catalog: SkillCatalog) -> str:
    tag, parent = element.tag, element.getparent()
    if tag in ("SubTree", "include"):
        return f"{tag} is not supported: put the tree's nodes in the main tree"
    if tag in BUILTIN:
        return (f"BT.CPP's {tag} is not supported (we run Sequence, Fallback, "
                "RetryUntilSuccessful, Inverter, ForceSuccess and the catalog's skills)")
    if tag == "Action" and element.get("ID"):
        skill = element.get("ID")
        return f"{skill!r} is not a skill of the catalog (known: {closest(skill, catalog.names)})"
    if tag in ("Action", "Condition", "Control", "Decorator"):
        return 'write a skill as <SKILL .../> (or <Action ID="SKILL">)'
    if tag not in RESERVED and catalog.get(tag) is None:
        return f"not a skill of the catalog (known: {closest(tag, catalog.names)})"
    inside = "" if parent is None else f" inside <{parent.tag}>"
    one = parent is not None and parent.tag in (*DECORATORS, "BehaviorTree")
    return f"not expected here{inside}" + (" (it takes one child)" if one else "")


def _bad_value(at: str, arg: Argument, value: str, message: str) -> str:
    limits = dict(arg.constraints)
    if "[facet 'enumeration']" in message or ("pattern" in message and "enum" in limits):
        return (f"{at}: argument '{arg.name}' is {value!r}, not one of its values "
                f"({closest(value, [port_text(v, arg, at) for v in limits['enum']])})")
    if "Inclusive']" in message:
        return (f"{at}: argument '{arg.name}' is {value}, outside "
                f"[{limits.get('minimum', '-inf')}, {limits.get('maximum', 'inf')}]")
    kind = {"number": "a number", "integer": "an integer",
            "boolean": "a boolean (true or false)"}.get(arg.type, arg.type)
    return f"{at}: argument '{arg.name}' must be {kind}, got {value!r}"
