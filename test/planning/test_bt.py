"""Plans as BehaviorTree.CPP v4 trees (planning/bt.py), checked by BT.CPP itself
(behaviortreepy) and by the catalog's XSD (lxml).

The properties run a few hundred generated trees over the demo catalog and a catalog of
every argument type, the same ones every run (derandomized); `FLASH_PLANNER_BT_EXAMPLES=N`
runs N times as many, freshly drawn.
"""

from __future__ import annotations

import json
import math
import os
import xml.etree.ElementTree as ET

import behaviortreepy as btpy
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from flash_planner.planning import plan_tree
from flash_planner.planning.bt import (
    BtError,
    catalog_xsd,
    from_bt_xml,
    to_bt_xml,
    tree_nodes_model,
)
from flash_planner.planning.plan_tree import MAX_ALTERNATIVES, MAX_ATTEMPTS, MAX_DEPTH
from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.skills import SkillCatalog

DEMO = SkillCatalog.from_yaml(default_skills_path())
# every argument type, enums, ranges, optional arguments with and without a default, and a
# skill without arguments
TYPED = SkillCatalog.from_dict({"skills": [
    {"name": "grasp", "description": "close the gripper", "args": {
        "object": {"type": "string", "description": "what to grasp"},
        "grip": {"type": "string", "enum": ["top", "side"], "required": False},
        "force": {"type": "number", "minimum": 0.5, "maximum": 40, "default": 10,
                  "description": "newtons"},
        "tries": {"type": "integer", "minimum": 1, "maximum": 9},
        "gentle": {"type": "boolean", "required": False}}},
    {"name": "beep", "args": {}},
    {"name": "dial", "args": {"level": {"type": "integer", "enum": [1, 2, 5]},
                              "scale": {"type": "number", "enum": [0.5, 1, 2.5]}}}]})

SCALE = int(os.environ.get("FLASH_PLANNER_BT_EXAMPLES", "1"))


def profile(examples: int):
    return settings(max_examples=examples * SCALE, deadline=None, database=None,
                    derandomize="FLASH_PLANNER_BT_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow])


def step(skill: str, **args):
    return {"skill": skill, "args": args}


def tree_doc(body: str, extra: str = "") -> str:
    return (f'<root BTCPP_format="4"><BehaviorTree ID="MainTree">{body}</BehaviorTree>'
            f"{extra}</root>")


# -- generated plans ---------------------------------------------------------------------

# Any text XML carries (control characters but tab, newline and return cannot be written);
# no braces, which BT.CPP would read as a blackboard entry (refused: test_blackboard_*)
TEXT = st.text(st.one_of(st.characters(blacklist_categories=("Cs", "Cc", "Cn"),
                                       blacklist_characters="{}"),
                         st.sampled_from("\t\n\r ")), max_size=12).filter(lambda s: s != "=")


def values(arg):
    limits = dict(arg.constraints)
    low, high = limits.get("minimum"), limits.get("maximum")
    if "enum" in limits:
        return st.sampled_from(limits["enum"])
    if arg.type == "string":
        return TEXT
    if arg.type == "boolean":
        return st.booleans()
    ints = st.integers(None if low is None else math.ceil(low),
                       None if high is None else math.floor(high))
    if arg.type == "integer":
        return ints
    return st.one_of(ints, st.floats(low, high, allow_nan=False, allow_infinity=False))


@st.composite
def steps(draw, catalog: SkillCatalog):
    skill = draw(st.sampled_from(catalog.skills))
    args = {a.name: draw(values(a)) for a in skill.args
            if a.required or draw(st.booleans())}
    return step(skill.name, **args)


def nodes(catalog: SkillCatalog, depth: int = 0):
    leaf = steps(catalog)
    if depth == MAX_DEPTH:
        return leaf
    seq = st.lists(nodes(catalog, depth + 1), min_size=1, max_size=3)
    return st.one_of(
        leaf,
        st.builds(lambda n, p: {"retry": n, "plan": p}, st.integers(2, MAX_ATTEMPTS), seq),
        st.lists(seq, min_size=2, max_size=MAX_ALTERNATIVES).map(lambda a: {"fallback": a}),
        seq.map(lambda p: {"invert": p}), seq.map(lambda p: {"force_success": p}))


def plans(catalog: SkillCatalog):
    return st.lists(nodes(catalog), min_size=1, max_size=4)


# -- BT.CPP ------------------------------------------------------------------------------

def portless(xml: str, catalog: SkillCatalog) -> str:
    """The document with the skills' ports removed (BT.CPP's simple actions take none); the
    leaves keep their `name`, their path, which is how the tick's callback knows them."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError:
        return xml
    for tree in root.iter("BehaviorTree"):
        for element in tree.iter():
            if catalog.get(element.tag) is not None:
                for port in set(element.attrib) - {"name"}:
                    del element.attrib[port]
    return ET.tostring(root, "unicode")


def factory(catalog: SkillCatalog, tick=lambda node: btpy.NodeStatus.SUCCESS):
    bt_factory = btpy.BehaviorTreeFactory()
    for skill in catalog.skills:
        bt_factory.register_simple_action(skill.name, tick)
    return bt_factory


# -- examples ----------------------------------------------------------------------------

def test_flat_plan_is_a_sequence_of_actions_and_the_skills_model():
    plan = [step("navigate_to", target="kitchen"), step("wait", seconds=0.5)]
    assert to_bt_xml(plan, DEMO) == """\
<?xml version="1.0" encoding="UTF-8"?>
<root BTCPP_format="4" main_tree_to_execute="MainTree">
  <BehaviorTree ID="MainTree">
    <Sequence>
      <navigate_to target="kitchen" name="0" />
      <wait seconds="0.5" name="1" />
    </Sequence>
  </BehaviorTree>
  <TreeNodesModel>
    <Action ID="navigate_to">
      <input_port name="target" type="std::string">place or object to go to</input_port>
      <MetadataFields>
        <Metadata description="drive to a place or object" />
      </MetadataFields>
    </Action>
    <Action ID="wait">
      <input_port name="seconds" type="double">how long to wait</input_port>
      <MetadataFields>
        <Metadata description="stay still" />
      </MetadataFields>
    </Action>
  </TreeNodesModel>
</root>
"""
    assert from_bt_xml(to_bt_xml(plan, DEMO), DEMO) == plan


def test_retry_is_retry_until_successful_around_a_sequence():
    plan = [{"retry": 3, "plan": [step("pick", object="cup")]}]
    retry = ET.fromstring(to_bt_xml(plan, DEMO)).find("BehaviorTree/Sequence/*")
    assert (retry.tag, retry.attrib) == ("RetryUntilSuccessful",
                                         {"num_attempts": "3", "name": "0"})
    assert [(e.tag, e.attrib) for e in retry.iter()][1:] == [
        ("Sequence", {}), ("pick", {"object": "cup", "name": "0.0"})]


def test_fallback_is_a_fallback_of_sequences_named_by_alternative():
    plan = [step("open", object="door"),
            {"fallback": [[step("navigate_to", target="kitchen door")],
                          [step("navigate_to", target="hall"), step("say", text="by the hall")]]}]
    fallback = ET.fromstring(to_bt_xml(plan, DEMO)).find("BehaviorTree/Sequence/Fallback")
    assert fallback.get("name") == "1"
    assert [(s.tag, s.get("name"), [c.get("name") for c in s]) for s in fallback] == [
        ("Sequence", "1.0", ["1.0.0"]), ("Sequence", "1.1", ["1.1.0", "1.1.1"])]
    assert from_bt_xml(to_bt_xml(plan, DEMO), DEMO) == plan


def test_nested_to_max_depth_names_each_leaf_by_its_path():
    plan = [{"fallback": [[{"retry": 2, "plan": [step("pick", object="cup")]}],
                          [{"invert": [step("wait", seconds=1)]},
                           {"force_success": [step("say", text="no cup")]}]]}]
    tree = plan_tree.tree_of(plan)
    assert max(len(leaf.path) for leaf in plan_tree.leaves(tree)) == 2 * MAX_DEPTH
    root = ET.fromstring(to_bt_xml(plan, DEMO))
    names = [e.get("name") for e in root.find("BehaviorTree").iter() if DEMO.get(e.tag)]
    assert names == [plan_tree.label(leaf.path) for leaf in plan_tree.leaves(tree)]
    assert from_bt_xml(to_bt_xml(plan, DEMO), DEMO) == plan


def test_tree_nodes_model_has_each_skill_with_typed_described_ports():
    actions = ET.fromstring(tree_nodes_model(DEMO)).find("TreeNodesModel")
    assert [a.get("ID") for a in actions] == list(DEMO.names)
    for action, skill in zip(actions, DEMO.skills):
        assert [(p.tag, p.get("name"), p.get("type"), p.text) for p in action.iter("input_port")
                ] == [("input_port", a.name, "double" if a.type == "number" else "std::string",
                       a.description) for a in skill.args]
        assert action.find("MetadataFields/Metadata").get("description") == skill.description
    typed = ET.fromstring(tree_nodes_model(TYPED)).find("TreeNodesModel/Action")
    assert [(p.get("name"), p.get("type"), p.get("default"))
            for p in typed.iter("input_port")] == [
        ("object", "std::string", None), ("grip", "std::string", None),
        ("force", "double", "10"), ("tries", "int", None), ("gentle", "bool", None)]


def test_bt_cpp_and_the_xsd_take_the_model_alone():
    factory(DEMO).register_behavior_tree_from_text(tree_nodes_model(DEMO))
    schema = etree.XMLSchema(etree.fromstring(catalog_xsd(DEMO).encode()))
    assert schema.validate(etree.fromstring(tree_nodes_model(DEMO).encode()))


def test_ports_come_back_typed_by_the_catalog():
    doc = tree_doc('<grasp object="cup" force="0.5" tries="3" gentle="true" grip="top"/>')
    assert from_bt_xml(doc, TYPED) == [
        step("grasp", object="cup", force=0.5, tries=3, gentle=True, grip="top")]
    doc = tree_doc('<grasp object=" 3 " force="12" tries="+7" gentle="0"/>')
    assert from_bt_xml(doc, TYPED) == [
        step("grasp", object=" 3 ", force=12, tries=7, gentle=False)]
    assert isinstance(from_bt_xml(doc, TYPED)[0]["args"]["force"], int)


def test_reading_takes_what_bt_cpp_users_write():
    """Nested Sequences spliced, a decorator's or alternative's node without a Sequence,
    <Action ID=...>, the model before the tree, the main tree among several, comments."""
    doc = """<?xml version="1.0" encoding="UTF-8"?>
<root BTCPP_format="4" main_tree_to_execute="Fetch">
  <TreeNodesModel><Action ID="pick"/></TreeNodesModel>
  <BehaviorTree ID="Other"><beep/></BehaviorTree>
  <BehaviorTree ID="Fetch">
    <Sequence>
      <!-- fetch the cup -->
      <Sequence><Action ID="beep"/><beep name="first"/></Sequence>
      <RetryUntilSuccessful num_attempts="2"><grasp object="cup" tries="1"/></RetryUntilSuccessful>
      <Fallback><beep/><Sequence><beep/><beep/></Sequence></Fallback>
    </Sequence>
  </BehaviorTree>
</root>"""
    grasp = step("grasp", object="cup", tries=1)
    assert from_bt_xml(doc, TYPED) == [
        step("beep"), step("beep"), {"retry": 2, "plan": [grasp]},
        {"fallback": [[step("beep")], [step("beep"), step("beep")]]}]
    assert from_bt_xml(tree_doc('<beep name="x"/>'), TYPED) == [step("beep")]


def test_the_shipped_catalogs_and_their_worked_plans_export_and_read_back():
    config = default_skills_path().parent / "catalogs"
    catalog = SkillCatalog.from_yaml(config / "mobile_manipulator.yaml")
    examples = yaml.safe_load((config / "mobile_manipulator_examples.yaml").read_text())
    bt_factory = factory(catalog)
    bt_factory.register_behavior_tree_from_text(tree_nodes_model(catalog))
    etree.XMLSchema(etree.fromstring(catalog_xsd(catalog).encode()))
    for example in examples["examples"]:
        xml = to_bt_xml(example["plan"], catalog)
        assert from_bt_xml(xml, catalog) == example["plan"]
        bt_factory.create_tree_from_text(portless(xml, catalog))


# XSD refusals: one line naming the node by its path and element name
REFUSED = {
    "extra port": (tree_doc('<Sequence><navigate_to target="table"/><pick object="cup" '
                            'colour="red"/></Sequence>'),
                   DEMO, "node 1 <pick>: 'colour' is not an argument of pick (its arguments: "
                         "object)"),
    "port on a skill without arguments": (
        tree_doc('<beep volume="3"/>'), TYPED, "node 0 <beep>: 'volume' is not an argument "
                                               "of beep (it takes none)"),
    "unknown node": (
        tree_doc('<Sequence><pick object="a"/><Fallback><Sequence><fly/></Sequence>'
                 '<pick object="b"/></Fallback></Sequence>'),
        DEMO, "node 1.0.0 <fly>: not a skill of the catalog"),
    "missing required arg": (tree_doc('<Sequence><place object="cup"/></Sequence>'), DEMO,
                             "node 0 <place>: missing argument 'location'"),
    "bad enum value": (tree_doc('<grasp object="cup" tries="1" grip="under"/>'), TYPED,
                       "node 0 <grasp>: argument 'grip' is 'under', not one of its values "
                       "(top, side)"),
    "number enum": (tree_doc('<dial level="5" scale="0.7"/>'), TYPED,
                    "argument 'scale' is '0.7', not one of its values"),
    "above maximum": (tree_doc('<wait seconds="7200"/>'), DEMO,
                      "node 0 <wait>: argument 'seconds' is 7200, outside [0, 3600]"),
    "not a number": (tree_doc('<wait seconds="soon"/>'), DEMO,
                     "argument 'seconds' must be a number, got 'soon'"),
    "not an integer": (tree_doc('<grasp object="cup" tries="1.5"/>'), TYPED,
                       "argument 'tries' must be an integer, got '1.5'"),
    "not a boolean": (tree_doc('<grasp object="cup" tries="1" gentle="yes"/>'), TYPED,
                      "argument 'gentle' must be a boolean (true or false), got 'yes'"),
    "script on a node": (tree_doc('<pick object="cup" _skipIf="done"/>'), DEMO,
                         "node 0 <pick>: BT.CPP's _skipIf (a script on the node) is not "
                         "supported"),
    "Parallel": (tree_doc('<Sequence><pick object="a"/><Parallel><pick object="b"/></Parallel>'
                          '</Sequence>'), DEMO, "node 1 <Parallel>: BT.CPP's Parallel is not "
                                                "supported"),
    "ReactiveSequence": (tree_doc('<ReactiveSequence><pick object="a"/></ReactiveSequence>'),
                         DEMO, "node 0 <ReactiveSequence>: BT.CPP's ReactiveSequence is not "
                               "supported"),
    "SubTree": ('<root BTCPP_format="4" main_tree_to_execute="Main"><BehaviorTree ID="Main">'
                '<SubTree ID="Other"/></BehaviorTree><BehaviorTree ID="Other"><pick object="a"/>'
                '</BehaviorTree></root>', DEMO, "node 0 <SubTree>: SubTree is not supported"),
    "retry without attempts": (
        tree_doc('<RetryUntilSuccessful><pick object="a"/></RetryUntilSuccessful>'), DEMO,
        "node 0 <RetryUntilSuccessful>: num_attempts must be an integer from 2 to "
        f"{MAX_ATTEMPTS} (the attempts in all), and is missing"),
    "retry forever": (
        tree_doc('<RetryUntilSuccessful num_attempts="-1"><pick object="a"/>'
                 '</RetryUntilSuccessful>'), DEMO, "got '-1'"),
    "retry past the limit": (
        tree_doc(f'<RetryUntilSuccessful num_attempts="{MAX_ATTEMPTS + 1}"><pick object="a"/>'
                 '</RetryUntilSuccessful>'), DEMO, f"got '{MAX_ATTEMPTS + 1}'"),
    "decorator with two children": (
        tree_doc('<Inverter><pick object="a"/><pick object="b"/></Inverter>'), DEMO,
        "node 0.1 <pick>: not expected here inside <Inverter> (it takes one child)"),
    "blackboard entry": (tree_doc('<pick object="{cup}"/>'), DEMO,
                         "node 0 <pick>: argument 'object' is '{cup}', a blackboard entry"),
    "no format": ('<root><BehaviorTree ID="M"><pick object="a"/></BehaviorTree></root>', DEMO,
                  'line 1 <root>: BTCPP_format must be "4"'),
    "format 3": ('<root BTCPP_format="3"><BehaviorTree ID="M"><pick object="a"/></BehaviorTree>'
                 '</root>', DEMO, 'BTCPP_format must be "4"'),
    "too deep": (tree_doc('<RetryUntilSuccessful num_attempts="2"><Inverter><ForceSuccess>'
                          '<pick object="a"/></ForceSuccess></Inverter></RetryUntilSuccessful>'),
                 DEMO, f"node 0.0.0: structures nest at most {MAX_DEPTH} deep"),
    "one alternative": (tree_doc('<Fallback><pick object="a"/></Fallback>'), DEMO,
                        "node 0: a fallback has 2 to"),
    "text in a node": (tree_doc('<pick object="a">now</pick>'), DEMO,
                       "node 0 <pick>: holds text"),
    "DOCTYPE": ('<!DOCTYPE root [<!ENTITY e "x">]>' + tree_doc('<pick object="a"/>'), DEMO,
                "may not declare a DOCTYPE"),
    "not BT XML": ("<plan><pick/></plan>", DEMO, "line 1 <plan>: a BT.CPP document's root"),
    "two trees, no main": (
        '<root BTCPP_format="4"><BehaviorTree ID="A"><pick object="a"/></BehaviorTree>'
        '<BehaviorTree ID="B"><pick object="a"/></BehaviorTree></root>', DEMO,
        "2 BehaviorTrees and no main_tree_to_execute"),
}


@pytest.mark.parametrize("doc,catalog,message", REFUSED.values(), ids=REFUSED)
def test_refused_naming_the_node(doc, catalog, message):
    with pytest.raises(BtError) as refused:
        from_bt_xml(doc, catalog)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("name", ["extra port", "unknown node", "missing required arg",
                                  "bad enum value", "above maximum", "Parallel"])
def test_the_xsd_alone_refuses_what_from_bt_xml_refuses(name):
    doc, catalog, _ = REFUSED[name]
    schema = etree.XMLSchema(etree.fromstring(catalog_xsd(catalog).encode()))
    assert not schema.validate(etree.fromstring(doc.encode()))
    valid = [step("beep")] if catalog is TYPED else [step("wait", seconds=1)]
    assert schema.validate(etree.fromstring(to_bt_xml(valid, catalog).encode()))


# Documents BT.CPP itself refuses (a factory with the catalog's skills registered, loading
# the port-less copy and ticking it: a missing num_attempts shows only at the first tick):
# from_bt_xml refuses each too.
BT_CPP_REFUSES = {
    "unknown node": (tree_doc('<Sequence><pick object="a"/><fly/></Sequence>'),
                     "node 1 <fly>: not a skill"),
    "malformed XML": ('<root BTCPP_format="4"><BehaviorTree ID="M"><pick object="a">',
                      "malformed XML"),
    "mismatched tags": (tree_doc('<Sequence><pick object="a"></Sequence>'), "malformed XML"),
    "retry without attempts": (
        tree_doc('<RetryUntilSuccessful><pick object="a"/></RetryUntilSuccessful>'),
        "num_attempts"),
    "attempts not a number": (
        tree_doc('<RetryUntilSuccessful num_attempts="twice"><pick object="a"/>'
                 '</RetryUntilSuccessful>'), "got 'twice'"),
    "attempts with spaces": (
        tree_doc('<RetryUntilSuccessful num_attempts=" 2 "><pick object="a"/>'
                 '</RetryUntilSuccessful>'), "got ' 2 '"),
    "decorator with two children": (
        tree_doc('<ForceSuccess><pick object="a"/><pick object="b"/></ForceSuccess>'),
        "(it takes one child)"),
    "tree with two children": (tree_doc('<pick object="a"/><pick object="b"/>'),
                               "node 1 <pick>: not expected here inside <BehaviorTree>"),
    "empty Sequence": (tree_doc('<Sequence><Sequence/><pick object="a"/></Sequence>'),
                       "<Sequence>: has no child node"),
    "action with a child": (tree_doc('<pick object="a"><pick object="b"/></pick>'),
                            "node 0 <pick>: an action node has no children"),
    "two models": (tree_doc('<pick object="a"/>', "<TreeNodesModel/><TreeNodesModel/>"),
                   "<TreeNodesModel>: not expected here inside <root>"),
    "SubTree of no tree": (tree_doc('<SubTree ID="Nowhere"/>'), "SubTree is not supported"),
    "no such main tree": ('<root BTCPP_format="4" main_tree_to_execute="Go"><BehaviorTree '
                          'ID="Stay"><pick object="a"/></BehaviorTree></root>',
                          "main_tree_to_execute is 'Go'"),
    "tree named as a skill": ('<root BTCPP_format="4"><BehaviorTree ID="pick"><pick '
                              'object="a"/></BehaviorTree></root>', "ID 'pick' names a node"),
    "bad node in another tree": (
        '<root BTCPP_format="4" main_tree_to_execute="A"><BehaviorTree ID="A"><pick '
        'object="a"/></BehaviorTree><BehaviorTree ID="B"><fly/></BehaviorTree></root>',
        "<fly>: not a skill"),
    "namespaced node": (tree_doc('<x:pick xmlns:x="urn:x" object="a"/>'), "not a skill"),
    "Action without ID": (tree_doc('<Action object="a"/>'), "write a skill as <SKILL"),
    "Action of no skill": (tree_doc('<Action ID="fly"/>'), "'fly' is not a skill"),
}


@pytest.mark.parametrize("doc,message", BT_CPP_REFUSES.values(), ids=BT_CPP_REFUSES)
def test_what_bt_cpp_refuses_we_refuse(doc, message):
    bt_factory = factory(DEMO)       # held: a tree must not outlive its factory (a crash)
    with pytest.raises(RuntimeError):
        bt_factory.create_tree_from_text(portless(doc, DEMO)).tick_while_running(0)
    with pytest.raises(BtError) as refused:
        from_bt_xml(doc, DEMO)
    assert message in str(refused.value)


@pytest.mark.parametrize("name", ["Parallel", "ReactiveSequence", "retry forever",
                                  "script on a node", "blackboard entry", "too deep",
                                  "one alternative", "no format", "format 3"])
def test_stricter_than_bt_cpp_where_our_executor_runs_otherwise(name):
    """BT.CPP loads these; our executor does not run them (REFUSED says why)."""
    doc, catalog, _ = REFUSED[name]
    bt_factory = factory(catalog)
    bt_factory.create_tree_from_text(portless(doc, catalog))     # loads; not ticked
    with pytest.raises(BtError):
        from_bt_xml(doc, catalog)


@pytest.mark.parametrize("plan,message", [
    ([step("fly")], "node 0: 'fly' is not a skill of the catalog"),
    ([step("pick", object="cup", grip="top")], "node 0 <pick>: 'grip' is not an argument"),
    ([step("say", text="{greeting}")], "BT.CPP would read as a blackboard entry"),
    ([step("say", text="=")], "BT.CPP would read as a blackboard entry"),
    ([step("say", text="bell \x07")], "a character XML cannot carry"),
    ([step("wait", seconds=math.inf)], "not a finite number"),
    ([step("say", text=None)], "which a BT.CPP port cannot carry"),
], ids=["unknown skill", "unknown arg", "blackboard", "own-name entry", "control character",
        "infinity", "null"])
def test_export_refuses_what_a_port_cannot_say(plan, message):
    with pytest.raises(BtError) as refused:
        to_bt_xml(plan, DEMO)
    assert message in str(refused.value)


def test_export_refuses_names_bt_cpp_reserves():
    sleepy = SkillCatalog.from_dict({"skills": [{"name": "Sleep", "args": {}}]})
    with pytest.raises(BtError, match="BT.CPP has a node of that name"):
        tree_nodes_model(sleepy)
    named = SkillCatalog.from_dict({"skills": [{"name": "greet", "args": {"name": "string"}}]})
    with pytest.raises(BtError, match="argument 'name' cannot be a BT.CPP port"):
        catalog_xsd(named)
    with pytest.raises(BtError, match="tree ID 'pick'"):
        to_bt_xml([step("wait", seconds=1)], DEMO, tree_id="pick")
    with pytest.raises(plan_tree.TreeError):
        to_bt_xml([], DEMO)


def test_integral_floats_are_written_as_ints_for_integer_ports():
    xml = to_bt_xml([step("grasp", object="cup", tries=3.0)], TYPED)
    assert 'tries="3"' in xml and from_bt_xml(xml, TYPED) == [step("grasp", object="cup",
                                                                     tries=3)]


# -- properties --------------------------------------------------------------------------

@profile(200)
@given(st.one_of(plans(DEMO).map(lambda p: (p, DEMO)), plans(TYPED).map(lambda p: (p, TYPED))))
def test_round_trip(case):
    plan, catalog = case
    xml = to_bt_xml(plan, catalog)
    back = from_bt_xml(xml, catalog)
    # JSON text too: an int stays an int and a float a float (5 == 5.0 in Python)
    assert back == plan and json.dumps(back, sort_keys=True) == json.dumps(plan, sort_keys=True)
    assert to_bt_xml(plan, catalog) == xml          # deterministic


@profile(200)
@given(st.data())
def test_bt_cpp_runs_the_same_leaves_in_the_same_order(data):
    """Each exported tree loads in BT.CPP's factory and, ticked with a scripted outcome per
    leaf (one per call, cycling: a retried leaf may fail and then succeed), runs the leaves
    plan_tree.run runs, in its order, to the same outcome."""
    catalog = data.draw(st.sampled_from([DEMO, TYPED]))
    plan = data.draw(plans(catalog))
    tree = plan_tree.tree_of(plan)
    script = {plan_tree.label(leaf.path): data.draw(st.lists(st.booleans(), min_size=1,
                                                             max_size=3))
              for leaf in plan_tree.leaves(tree)}

    def scripted(name: str, calls: list[str]) -> bool:
        outcomes = script[name]
        ok = outcomes[calls.count(name) % len(outcomes)]
        calls.append(name)
        return ok

    ours: list[str] = []
    ours_ok = plan_tree.run(tree, lambda leaf: scripted(plan_tree.label(leaf.path), ours))
    theirs: list[str] = []
    bt_factory = factory(catalog, lambda node: btpy.NodeStatus.SUCCESS if scripted(
        node.name(), theirs) else btpy.NodeStatus.FAILURE)
    status = bt_factory.create_tree_from_text(portless(to_bt_xml(plan, catalog), catalog)
                                              ).tick_while_running(0)
    assert theirs == ours
    assert status == (btpy.NodeStatus.SUCCESS if ours_ok else btpy.NodeStatus.FAILURE)
