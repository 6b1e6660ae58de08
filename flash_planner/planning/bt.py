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
"""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from typing import Any

from . import plan_tree
from .parse import closest
from .plan_tree import MAX_ATTEMPTS, Leaf, TreeError, label, tree_of
from .skills import Argument, Skill, SkillCatalog

FORMAT = "4"
DECORATORS = {"RetryUntilSuccessful": "retry", "Inverter": "invert",
              "ForceSuccess": "force_success"}
CONTROLS = ("Sequence", "Fallback")
PORT_TYPES = {"string": "std::string", "number": "double", "integer": "int", "boolean": "bool"}
_XSD_TYPES = {"string": "xs:string", "number": "xs:double", "integer": "xs:integer",
              "boolean": "xs:boolean"}
# BT.CPP v4's own nodes (bt_factory.cpp) and the document's elements: no skill may take
# these names, and those that are nodes we do not run are refused by name.
BUILTIN = ("SequenceWithMemory", "SequenceStar", "AsyncSequence", "AsyncFallback",
           "ReactiveSequence", "ReactiveFallback", "Parallel", "ParallelAll", "IfThenElse",
           "WhileDoElse", "TryCatch", "KeepRunningUntilFailure", "Repeat", "Timeout",
           "Delay", "RunOnce", "ForceFailure", "AlwaysSuccess", "AlwaysFailure", "Script",
           "ScriptCondition", "SetBlackboard", "UnsetBlackboard", "Sleep", "SubTree",
           "Precondition", "Switch2", "Switch3", "Switch4", "Switch5", "Switch6", "LoopInt",
           "LoopBool", "LoopDouble", "LoopString", "WasEntryUpdated", "SkipUnlessUpdated",
           "WaitValueUpdate")
RESERVED = {*BUILTIN, *CONTROLS, *DECORATORS, "root", "Root", "BehaviorTree",
            "TreeNodesModel", "include", "Action", "Condition", "Control", "Decorator"}
_PORT_NAME = re.compile(r"[A-Za-z][\w-]*")   # BT.CPP's IsAllowedPortName, and an XML name
# BT.CPP 4.10's model names (validateModelName)
_TREE_ID = re.compile(r"[^\s<>&\"'/\\:*?|.]+")
# Characters XML 1.0 cannot carry, even escaped.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


class BtError(ValueError):
    """A plan that cannot be written as a BT.CPP tree, or a BT XML tree we do not run; one
    line naming the node (`node 2.1 <fly>: ...`)."""


# -- writing -----------------------------------------------------------------------------

def to_bt_xml(plan: Any, catalog: SkillCatalog, tree_id: str = "MainTree") -> str:
    """A plan (plan_tree's JSON forms) as a BT.CPP v4 document: its tree, then the
    TreeNodesModel of the skills it uses. TreeError for a malformed plan, BtError for a
    step the catalog's ports cannot say."""
    tree = tree_of(plan)
    if not _TREE_ID.fullmatch(tree_id) or tree_id in RESERVED or catalog.get(tree_id):
        raise BtError(f"tree ID {tree_id!r}: BT.CPP refuses an ID that names a node or holds "
                      "a space or any of <>&\"'/\\:*?|.")
    root = ET.Element("root", BTCPP_format=FORMAT, main_tree_to_execute=tree_id)
    _write(tree, ET.SubElement(ET.SubElement(root, "BehaviorTree", ID=tree_id), "Sequence"),
           catalog)
    used = {leaf.step.get("skill") for leaf in plan_tree.leaves(tree)}
    root.append(_model([s for s in catalog.skills if s.name in used]))
    return _text_of(root)


def tree_nodes_model(catalog: SkillCatalog) -> str:
    """The catalog as a BT.CPP `<TreeNodesModel>` document, for Groot2's palette."""
    root = ET.Element("root", BTCPP_format=FORMAT)
    root.append(_model(catalog.skills))
    return _text_of(root)


def _text_of(root: ET.Element) -> str:
    ET.indent(root, "  ")
    text = ET.tostring(root, "unicode")
    # ElementTree writes any character; a port's value is checked where it is written, this
    # catches the catalog's own texts (descriptions)
    bad = _NOT_XML.search(text)
    if bad:
        raise BtError(f"the catalog's text holds {bad.group()!r}, a character XML cannot carry")
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + text + "\n"


def _write(node, parent: ET.Element, catalog: SkillCatalog, path: tuple[int, ...] = ()
           ) -> None:
    """`node`'s elements under `parent`; a Sequence's children go in `parent` itself."""
    if isinstance(node, plan_tree.Sequence):
        for i, child in enumerate(node.children):
            _write(child, parent, catalog, (*path, i))
    elif isinstance(node, Leaf):
        parent.append(_action(node, catalog))
    elif isinstance(node, plan_tree.Fallback):
        fallback = ET.SubElement(parent, "Fallback", name=label(path))
        for j, option in enumerate(node.children):
            _write(option, ET.SubElement(fallback, "Sequence", name=label((*path, j))),
                   catalog, (*path, j))
    else:
        tag = {plan_tree.Retry: "RetryUntilSuccessful", plan_tree.Invert: "Inverter",
               plan_tree.ForceSuccess: "ForceSuccess"}[type(node)]
        element = ET.SubElement(parent, tag)
        if isinstance(node, plan_tree.Retry):
            element.set("num_attempts", str(node.attempts))
        element.set("name", label(path))
        _write(node.child, ET.SubElement(element, "Sequence"), catalog, path)


def _action(leaf: Leaf, catalog: SkillCatalog) -> ET.Element:
    at = f"node {label(leaf.path)}"
    name, args = leaf.step.get("skill"), leaf.step.get("args", {})
    skill = catalog.get(name) if isinstance(name, str) else None
    if skill is None or not isinstance(args, dict):
        raise BtError(f"{at}: {name!r} is not a skill of the catalog with its arguments "
                      "(validate the plan before exporting it)")
    _check_skill(skill)
    by_name = {a.name: a for a in skill.args}
    unknown = sorted(set(args) - set(by_name))
    if unknown:
        raise BtError(f"{at} <{name}>: {unknown[0]!r} is not an argument of {name}")
    element = ET.Element(name)
    for arg in skill.args:               # the catalog's order, whatever the plan's
        if arg.name in args:
            element.set(arg.name, _port_text(args[arg.name], arg, f"{at} <{name}>"))
    element.set("name", label(leaf.path))
    return element


def _port_text(value: Any, arg: Argument, at: str) -> str:
    """A value as BT.CPP reads a port: strings as they are, numbers as Python writes them,
    booleans true/false, lists and objects as JSON."""
    where = f"{at}: argument '{arg.name}'"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise BtError(f"{where} is {value!r}, not a finite number")
        # JSON-Schema counts 3.0 as an integer; a BT.CPP int port does not read "3.0"
        if arg.type == "integer" and float(value).is_integer():
            return str(int(value))
        return repr(value)
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, dict)):
        text = json.dumps(value, ensure_ascii=False)
    else:
        raise BtError(f"{where} is {value!r}, which a BT.CPP port cannot carry")
    bad = _NOT_XML.search(text)
    if bad:
        raise BtError(f"{where} holds {bad.group()!r}, a character XML cannot carry")
    if _blackboard(text):
        raise BtError(f"{where} is {text!r}, which BT.CPP would read as a blackboard entry")
    return text


def _blackboard(text: str) -> bool:
    """Whether BT.CPP reads a port's text as a blackboard entry (TreeNode's
    isBlackboardPointer, and `=`: the entry of the port's own name)."""
    core = text.strip(" ")
    return text == "=" or (len(core) >= 3 and core[0] == "{" and core[-1] == "}")


def _check_skill(skill: Skill) -> None:
    if skill.name in RESERVED:
        raise BtError(f"skill {skill.name}: BT.CPP has a node of that name; rename the skill")
    for arg in skill.args:
        if not _PORT_NAME.fullmatch(arg.name) or arg.name in ("name", "ID"):
            raise BtError(f"skill {skill.name}: argument {arg.name!r} cannot be a BT.CPP "
                          "port (a letter, then letters, digits, _ or -; not name or ID)")


def _model(skills) -> ET.Element:
    model = ET.Element("TreeNodesModel")
    for skill in skills:
        _check_skill(skill)
        action = ET.SubElement(model, "Action", ID=skill.name)
        for arg in skill.args:
            port = ET.SubElement(action, "input_port", name=arg.name, type=PORT_TYPES[arg.type])
            if arg.default is not None:
                port.set("default", _port_text(arg.default, arg, f"skill {skill.name}"))
            port.text = arg.description or None
        if skill.description:
            # what BT.CPP's writeTreeNodesModelXML writes for a node's metadata
            fields = ET.SubElement(action, "MetadataFields")
            ET.SubElement(fields, "Metadata", description=skill.description)
    return model


# -- the schema --------------------------------------------------------------------------

def catalog_xsd(catalog: SkillCatalog) -> str:
    """An XML Schema of the BT.CPP v4 documents we write and read, over the catalog's skills:
    root, BehaviorTree, Sequence, Fallback, RetryUntilSuccessful (num_attempts 2 to
    MAX_ATTEMPTS), Inverter, ForceSuccess, an optional TreeNodesModel (not checked), and per
    skill an element whose attributes are its arguments (typed, enums, ranges) and `name`."""
    # prefixed names written as they are: no namespace registered in ElementTree's globals
    schema = ET.Element("xs:schema", {"xmlns:xs": "http://www.w3.org/2001/XMLSchema"})

    def sub(parent, tag, **attrs):
        return ET.SubElement(parent, f"xs:{tag}", attrs)

    root_type = sub(sub(schema, "element", name="root"), "complexType")
    # one TreeNodesModel at most, before, between or after the trees (BT.CPP's rule),
    # written so that each element has one place it can match (XSD's unique attribution)
    choice = sub(root_type, "choice")
    first = sub(choice, "sequence")
    sub(first, "element", ref="TreeNodesModel")
    sub(first, "element", ref="BehaviorTree", minOccurs="0", maxOccurs="unbounded")
    trees = sub(choice, "sequence")
    sub(trees, "element", ref="BehaviorTree", maxOccurs="unbounded")
    after = sub(trees, "sequence", minOccurs="0")
    sub(after, "element", ref="TreeNodesModel")
    sub(after, "element", ref="BehaviorTree", minOccurs="0", maxOccurs="unbounded")
    sub(root_type, "attribute", name="BTCPP_format", type="xs:string", fixed=FORMAT,
        use="required")
    sub(root_type, "attribute", name="main_tree_to_execute", type="xs:string")

    tree = sub(sub(schema, "element", name="BehaviorTree"), "complexType")
    sub(tree, "group", ref="node")
    sub(tree, "attribute", name="ID", type="xs:string")
    model = sub(sub(schema, "element", name="TreeNodesModel"), "complexType")
    sub(sub(model, "sequence"), "any", processContents="skip", minOccurs="0",
        maxOccurs="unbounded")
    sub(model, "anyAttribute", processContents="skip")

    nodes = sub(sub(schema, "group", name="node"), "choice")
    for tag in (*CONTROLS, *DECORATORS, *(s.name for s in catalog.skills)):
        sub(nodes, "element", ref=tag)
    for tag in CONTROLS:
        kind = sub(sub(schema, "element", name=tag), "complexType")
        sub(kind, "group", ref="node", maxOccurs="unbounded")
        sub(kind, "attribute", name="name", type="xs:string")
    for tag in DECORATORS:
        kind = sub(sub(schema, "element", name=tag), "complexType")
        sub(kind, "group", ref="node")
        if tag == "RetryUntilSuccessful":
            # strings, not xs:integer: BT.CPP refuses " 2 ", which an integer would collapse
            attempts = sub(sub(kind, "attribute", name="num_attempts", use="required"),
                           "simpleType")
            enum = sub(attempts, "restriction", base="xs:string")
            for n in range(2, MAX_ATTEMPTS + 1):
                sub(enum, "enumeration", value=str(n))
        sub(kind, "attribute", name="name", type="xs:string")
    for skill in catalog.skills:
        _check_skill(skill)
        kind = sub(sub(schema, "element", name=skill.name), "complexType")
        for arg in skill.args:
            port = sub(kind, "attribute", name=arg.name,
                       use="required" if arg.required else "optional")
            _facets(sub(sub(port, "simpleType"), "restriction", base=_XSD_TYPES[arg.type]),
                    arg, sub)
        sub(kind, "attribute", name="name", type="xs:string")
    return _text_of(schema)


def _facets(restriction: ET.Element, arg: Argument, sub) -> None:
    limits = dict(arg.constraints)
    if arg.type == "boolean":        # xs:boolean takes no enumeration facet, a pattern does
        if "enum" in limits:
            sub(restriction, "pattern", value="|".join(
                "true|1" if v else "false|0" for v in limits["enum"]))
        return
    for value in limits.get("enum", ()):
        sub(restriction, "enumeration", value=_port_text(value, arg, "enum"))
    for bound, facet, to_int in (("minimum", "minInclusive", math.ceil),
                                 ("maximum", "maxInclusive", math.floor)):
        if bound in limits:
            value = limits[bound]
            if arg.type == "integer":    # an integer's bound must be an integer
                value = to_int(value)
            sub(restriction, facet, value=repr(value))


# -- reading -----------------------------------------------------------------------------

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
            if _blackboard(value):
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
                f"({closest(value, [_port_text(v, arg, at) for v in limits['enum']])})")
    if "Inclusive']" in message:
        return (f"{at}: argument '{arg.name}' is {value}, outside "
                f"[{limits.get('minimum', '-inf')}, {limits.get('maximum', 'inf')}]")
    kind = {"number": "a number", "integer": "an integer",
            "boolean": "a boolean (true or false)"}.get(arg.type, arg.type)
    return f"{at}: argument '{arg.name}' must be {kind}, got {value!r}"
