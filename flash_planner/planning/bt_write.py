"""Plans and the catalog written as BehaviorTree.CPP v4 XML (ElementTree only): a plan as a
tree (`to_bt_xml`), the catalog's `<TreeNodesModel>` (`tree_nodes_model`, Groot2's palette)
and the XML Schema that bt_read.py checks a caller's tree against (`catalog_xsd`). The
vocabulary both sides share (BT.CPP's node names, the names no skill may take) and BtError
are here; bt.py says how plans and trees map onto each other.
"""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from typing import Any

from . import plan_tree
from .plan_tree import MAX_ATTEMPTS, Leaf, label, tree_of
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
            element.set(arg.name, port_text(args[arg.name], arg, f"{at} <{name}>"))
    element.set("name", label(leaf.path))
    return element


def port_text(value: Any, arg: Argument, at: str) -> str:
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
    if is_blackboard(text):
        raise BtError(f"{where} is {text!r}, which BT.CPP would read as a blackboard entry")
    return text


def is_blackboard(text: str) -> bool:
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
                port.set("default", port_text(arg.default, arg, f"skill {skill.name}"))
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
        sub(restriction, "enumeration", value=port_text(value, arg, "enum"))
    for bound, facet, to_int in (("minimum", "minInclusive", math.ceil),
                                 ("maximum", "maxInclusive", math.floor)):
        if bound in limits:
            value = limits[bound]
            if arg.type == "integer":    # an integer's bound must be an integer
                value = to_int(value)
            sub(restriction, facet, value=repr(value))
