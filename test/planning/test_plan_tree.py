"""Plans with recovery (planning/plan_tree.py): retry and fallback nodes, checked leaf by
leaf by validation and the gate, held by the plan grammar when a planner has `recovery` on,
and run on the robot's side by the same Execution (a failed step inside a retry or a
fallback is no failed run; an end nobody confirmed still ends everything)."""

from __future__ import annotations

import json

import pytest
from test_execution import CATALOG, MOVE, Recorder, _run

from flash_planner.planning import plan_tree
from flash_planner.planning.gate import GateError, check_plan
from flash_planner.planning.parse import PlanError, validate_plan
from flash_planner.planning.prompt import RECOVERY_HINT, system_prompt

SLOW = {"skill": "move", "args": {"speed": 0.25}}
FAST = {"skill": "move", "args": {"speed": 3.0}}       # above the binding's limit (v max 1)


def _retry(n, *steps):
    return {"retry": n, "plan": list(steps)}


def _fallback(*alternatives):
    return {"fallback": [list(a) for a in alternatives]}


def test_leaves_are_numbered_in_written_order_with_their_paths():
    tree = plan_tree.tree_of([MOVE, _retry(2, SLOW, MOVE), _fallback([SLOW], [MOVE, SLOW])])
    got = [(leaf.index, plan_tree.label(leaf.path)) for leaf in plan_tree.leaves(tree)]
    assert got == [(0, "0"), (1, "1.0"), (2, "1.1"), (3, "2.0.0"), (4, "2.1.0"), (5, "2.1.1")]
    assert plan_tree.plan_of(tree) == [MOVE, _retry(2, SLOW, MOVE),
                                       _fallback([SLOW], [MOVE, SLOW])]


@pytest.mark.parametrize("plan,why", [
    ([_retry(1, MOVE)], "retry must be an integer from 2 to 5"),
    ([_retry(9, MOVE)], "retry must be an integer from 2 to 5"),
    ([_retry(True, MOVE)], "retry must be an integer"),
    ([_retry(2)], "retry's plan must be a non-empty list"),
    ([_fallback([MOVE])], "a fallback has 2 to 3 alternatives, got 1"),
    ([_fallback([MOVE], [])], "node 0: alternative 1 must be a non-empty list"),
    ([_retry(2, _retry(2, _retry(2, MOVE)))], "node 0.0.0: structures nest at most 2 deep"),
    ([{"retry": 2, "plan": [MOVE], "why": "x"}], r"unknown field\(s\) \['why'\]"),
    ([MOVE, "move"], r"plan\[1\]: 'move' is not of type 'object'"),
])
def test_a_malformed_tree_is_refused_naming_the_node(plan, why):
    with pytest.raises(PlanError, match=why):
        validate_plan({"plan": plan}, CATALOG)


def test_validation_checks_every_leaf_and_names_a_nested_one_by_its_path():
    plan = [MOVE, _fallback([SLOW], [{"skill": "move", "args": {"speed": "fast"}}])]
    with pytest.raises(PlanError, match=r"step 3 \(node 1\.1\.0\) \(move\): argument "
                                        "'speed' must be number"):
        validate_plan({"plan": plan}, CATALOG)
    assert validate_plan({"plan": [MOVE, _retry(3, SLOW)]}, CATALOG) == [MOVE, _retry(3, SLOW)]


def test_the_gate_checks_every_leaf_even_one_that_may_never_run():
    """A fallback's second alternative runs only if the first fails; it is checked anyway."""
    with pytest.raises(GateError, match=r"step 2 at node 1\.1\.0 \(move\): v = 3.0 is above "
                                        "its limit 1.0"):
        check_plan([MOVE, _fallback([SLOW], [FAST])], CATALOG.bindings, None,
                   CATALOG.workspace, lambda b: True)
    goals, away = check_plan([_retry(2, MOVE), SLOW], CATALOG.bindings, None,
                             CATALOG.workspace, lambda b: True)
    assert goals == [{"v": 0.5}, {"v": 0.25}] and away == {}


def test_a_retry_runs_its_steps_again_until_they_succeed():
    runner = Recorder(ends=["aborted", "succeeded", "succeeded"])
    result, _, events = _run([_retry(3, MOVE), SLOW], runner)
    assert result.success and result.steps_done == 2
    assert runner.sent == [("move", {"v": 0.5}), ("move", {"v": 0.5}), ("move", {"v": 0.25})]
    failed = [e for e in events if e.state == "failed"]
    assert [(e.step_index, e.path) for e in failed] == [(0, "0.0")]


def test_a_retry_whose_attempts_are_spent_fails_the_plan_with_its_last_failure():
    runner = Recorder(ends=["aborted", "timed_out"])
    result, _, _ = _run([_retry(2, MOVE), SLOW], runner)
    assert not result.success and result.failed_state == "timed_out"
    assert result.failed_step == 0 and "at node 0.0" in result.error
    assert len(runner.sent) == 2                      # the step after the retry never ran


def test_a_fallback_tries_the_next_alternative_and_its_failure_is_no_failed_run():
    runner = Recorder(ends=["rejected", "succeeded"])
    result, _, events = _run([_fallback([MOVE], [SLOW])], runner)
    assert result.success and result.steps_done == 1 and result.failed_state == ""
    assert runner.sent == [("move", {"v": 0.5}), ("move", {"v": 0.25})]
    assert [e.path for e in events if e.state == "sent"] == ["0.0.0", "0.1.0"]


def test_an_end_nobody_confirmed_stops_the_run_whatever_structure_it_is_in():
    """The server left while its goal ran: its work may go on, so no alternative is sent."""
    runner = Recorder(ends=["gone"])
    result, _, _ = _run([_fallback([MOVE], [SLOW])], runner)
    assert not result.success and result.failed_state == "unavailable"
    assert runner.sent == [("move", {"v": 0.5})]


def test_a_replan_starts_from_the_tree_state():
    runner = Recorder(ends=["succeeded", "aborted", "aborted"])
    result, asked, _ = _run([MOVE, _fallback([SLOW], [SLOW])], runner,
                            plans=[[SLOW]], task="drive")
    assert result.success and result.replans == 1
    assert asked[0].startswith('Done: move {"speed": 0.5}\nFailed: move {"speed": 0.25}')


def test_an_inverted_step_swaps_its_outcome():
    runner = Recorder(ends=["aborted"])
    result, _, _ = _run([{"invert": [MOVE]}, SLOW], runner)
    assert result.success and len(runner.sent) == 2
    result, _, _ = _run([{"invert": [MOVE]}], Recorder())
    assert not result.success and "under an invert succeeded" in result.error


def test_the_grammar_holds_the_forms_only_with_recovery_on():
    from qwen3_tokenizer import DEMO

    from flash_planner.engine.inputs.grammar import JsonGrammarCompiler
    from flash_planner.planning.plan_grammar import PlanGrammar
    from flash_planner.planning.presets import default_skills_path
    from flash_planner.planning.skills import SkillCatalog
    from flash_planner.train.tokenizer import load_tokenizer

    tok = load_tokenizer(DEMO)
    compiler = JsonGrammarCompiler(tok, len(tok), [tok.convert_tokens_to_ids("<|im_end|>")])
    catalog = SkillCatalog.from_yaml(default_skills_path())
    go = {"skill": "navigate_to", "args": {"target": "kitchen"}}
    nested = {"plan": [_retry(2, go), _fallback([go], [_retry(3, go)])]}
    deeper = {"plan": [_retry(2, _fallback([go], [_retry(2, go)]))]}

    def accepts(grammar, obj) -> bool:
        matcher = grammar.base.matcher()
        return all(matcher.accept(t) for t in tok.encode(json.dumps(obj),
                                                         add_special_tokens=False))

    on, off = PlanGrammar(catalog, compiler, recovery=True), PlanGrammar(catalog, compiler)
    assert accepts(on, nested) and accepts(on, {"plan": [go]}) and not accepts(on, deeper)
    assert accepts(off, {"plan": [go]}) and not accepts(off, nested)
    assert RECOVERY_HINT in system_prompt(catalog, recovery=True)
    assert RECOVERY_HINT not in system_prompt(catalog)


def test_a_bt_xml_tree_given_as_the_plan_runs_like_its_json():
    from flash_planner.planning.bt import to_bt_xml
    from flash_planner.planning.execution import steps_of

    plan = [_retry(2, MOVE), _fallback([SLOW], [MOVE])]
    xml = to_bt_xml(plan, CATALOG)
    assert steps_of(xml, CATALOG) == plan
    runner = Recorder(ends=["aborted", "succeeded", "rejected", "succeeded"])
    result, _, _ = _run(steps_of(xml, CATALOG), runner)
    assert result.success and len(runner.sent) == 4
    with pytest.raises(PlanError, match=r"not a tree we run: .*<fly>"):
        steps_of(xml.replace("<move", "<fly", 1), CATALOG)
    with pytest.raises(GateError, match=r"step 0 \(move\): v = 3.0 is above its limit"):
        _gate_of(steps_of(to_bt_xml([MOVE], CATALOG).replace('"0.5"', '"3.0"'), CATALOG))


def _gate_of(plan):
    goals, _ = check_plan(plan, CATALOG.bindings, None, CATALOG.workspace, lambda b: True)
    return goals
