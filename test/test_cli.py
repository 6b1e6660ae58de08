"""`flash-planner generate`: its JSON contract and one-line errors with exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flash_planner.cli import main


def test_generate_json_contract(hybrid_dir, capsys):
    code = main(["generate", "--model", str(hybrid_dir), "--prompt", "pick up the cup",
                 "--max-new-tokens", "9", "--ignore-eos", "--json", "--device", "cpu"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 9
    assert out["finish_reason"] == "length"
    for key in ("prompt_tokens", "new_tokens", "ttft_ms", "decode_tokens_per_s", "total_ms"):
        assert key in out["stats"], key
    assert out["stats"]["new_tokens"] == 9
    assert out["memory_bytes"]["total"] > 0


def test_generate_prompt_ids_and_kv_fp8(hybrid_dir, capsys):
    code = main(["generate", "--model", str(hybrid_dir), "--prompt-ids", "5,6,7,8",
                 "--max-new-tokens", "4", "--ignore-eos", "--kv-dtype", "fp8", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["prompt_tokens"] == 4 and len(out["token_ids"]) == 4


def test_plain_output_streams_text_and_summary(hybrid_dir, capsys):
    assert main(["generate", "--model", str(hybrid_dir), "--prompt", "open the drawer",
                 "--max-new-tokens", "5", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert "5 new tokens" in out and "finish=length" in out and "tok/s" in out


@pytest.mark.parametrize("args,match", [
    (["generate", "--model", "/no/such/dir", "--prompt", "x"], "does not exist"),
    (["generate", "--model", "{model}", "--prompt-ids", "1,x"], "comma-separated integers"),
    (["generate", "--model", "{model}", "--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["generate", "--model", "{model}", "--prompt", "x", "--max-context", "4",
      "--max-new-tokens", "8"], "exceeds max_context"),
    (["generate", "--model", "{model}"], "one of the arguments --prompt --prompt-ids"),
    (["generate", "--model", "{model}", "--prompt", "x", "--dtype", "fp64"], "invalid choice"),
    (["generate", "--model", "{model}", "--prompt", "x", "--threads", "-1"],
     "--threads wants a whole number >= 0 (0 = auto), got '-1'"),
])
def test_errors_are_one_line_with_exit_2(hybrid_dir, capsys, args, match):
    args = [a.replace("{model}", str(hybrid_dir)) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert match in err
    assert "\n" not in err and "Traceback" not in err


def test_console_entry_point_reports_bad_model_without_traceback(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    proc = subprocess.run([sys.executable, "-m", "flash_planner.cli", "generate", "--model",
                           str(tmp_path), "--prompt", "hi"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "model_type 'gpt2' is not supported" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, hybrid_dir):
    from flash_planner.train.tiny import write_tiny_drafter

    return write_tiny_drafter(tmp_path_factory.mktemp("drafter"), hybrid_dir)


def _json_run(capsys, args):
    assert main(args + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_with_drafter_reports_speculative_stats(hybrid_dir, drafter_dir, capsys):
    base = ["generate", "--model", str(hybrid_dir), "--prompt", "pick up the cup",
            "--max-new-tokens", "20", "--ignore-eos"]
    plain = _json_run(capsys, base)
    spec = _json_run(capsys, base + ["--drafter", str(drafter_dir), "--block-size", "4",
                                     "--window", "32", "--no-window-seed", "--method",
                                     "dflash"])
    off = _json_run(capsys, base + ["--drafter", str(drafter_dir), "--no-spec"])
    relaxed = _json_run(capsys, base + ["--drafter", str(drafter_dir), "--relaxed-thinking",
                                        "--relaxed-topk", "2", "--relaxed-delta", "0.5"])
    assert spec["token_ids"] == plain["token_ids"] == off["token_ids"]
    stats = spec["stats"]
    assert stats["cycles"] == 19 and stats["drafted"] > 19
    for key in ("mean_accepted", "tokens_per_cycle", "accept_hist", "phase_ms_per_cycle"):
        assert key in stats
    assert set(stats["phase_ms_per_cycle"]) == {"draft", "grammar", "verify", "accept", "commit",
                                               "other"}
    assert off["stats"]["drafted"] == 0
    assert len(relaxed["token_ids"]) == 20


def test_generate_method_and_mtp_steps(checkpoints, drafter_dir, capsys):
    target = checkpoints("hybrid", mtp=True)
    base = ["generate", "--model", str(target), "--prompt", "pick up the cup",
            "--max-new-tokens", "20", "--ignore-eos"]
    plain = _json_run(capsys, base + ["--method", "none"])
    mtp = _json_run(capsys, base + ["--method", "mtp", "--mtp-steps", "2"])
    auto = _json_run(capsys, base + ["--drafter", str(drafter_dir)])   # auto: both loaded
    assert plain["token_ids"] == mtp["token_ids"] == auto["token_ids"]
    assert plain["stats"]["method_cycles"] == {"none": 19}
    assert set(mtp["stats"]["method_cycles"]) <= {"mtp", "none"}
    assert mtp["stats"]["drafted"] <= 2 * mtp["stats"]["cycles"]
    assert {"accept_hist", "tokens_per_cycle"} <= set(mtp["stats"])
    assert {"dflash", "mtp"} <= set(auto["stats"]["method_cycles"])


@pytest.mark.parametrize("extra,match", [
    (["--drafter", "/no/such/drafter"], "drafter directory /no/such/drafter does not exist"),
    (["--block-size", "1", "--drafter", "{drafter}"], "block_size must be within"),
    (["--relaxed-topk", "0", "--relaxed-thinking"], "relaxed_topk must be >= 1"),
    (["--method", "mtp"], "has no mtp.* tensors"),
    (["--method", "dflash"], "dflash needs a DFlash drafter directory"),
    (["--method", "mtp", "--mtp-steps", "0"], "mtp_steps must be within"),
])
def test_speculative_usage_errors(hybrid_dir, drafter_dir, capsys, extra, match):
    args = ["generate", "--model", str(hybrid_dir), "--prompt", "x"]
    args += [a.replace("{drafter}", str(drafter_dir)) for a in extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and "\n" not in err


def test_plan_json_reports_no_valid_plan_from_a_random_model(hybrid_dir, capsys):
    code = main(["plan", "pick up the red cup", "--model", str(hybrid_dir), "--json",
                 "--max-new-tokens", "16", "--no-thinking", "--context", "cup on table",
                 "--no-constrain"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    assert out["success"] is False and out["error"] and "plan" not in out
    assert out["raw_text"] and out["telemetry"]["constrained"] is False
    for key in ("decode_tokens_per_s", "tokens_per_cycle", "mean_accepted", "cycles",
                "ttft_ms", "total_ms", "queue_wait_ms", "total_latency_ms"):
        assert key in out["telemetry"], key


def test_plan_under_the_grammar_reports_its_jump_forward_tokens(hybrid_dir, capsys):
    """A random model under the grammar answers in its shape: here a refusal (its argmax
    prefers `"refusal"`), reported as one, with the tokens jump-forward published."""
    code = main(["plan", "pick up the red cup", "--model", str(hybrid_dir), "--json",
                 "--max-new-tokens", "200", "--no-thinking"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["refusal"] is not None
    assert out["error"].startswith("the planner refused the task")
    t = out["telemetry"]
    assert t["constrained"] is True and t["forced_tokens"] > 0 and "grammar_cut_drafts" in t
    main(["plan", "pick up the red cup", "--model", str(hybrid_dir), "--max-new-tokens", "200",
          "--no-thinking"])
    assert "forced by the grammar" in capsys.readouterr().err


def test_plan_stream_prints_each_step_as_a_json_line(capsys):
    task = "bring the red cup from the kitchen table to the sink"
    assert main(["plan", task, "--stream"]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line.pop("index") for line in lines] == list(range(len(lines)))
    assert main(["plan", task, "--json"]) == 0
    assert lines == json.loads(capsys.readouterr().out)["plan"]
    assert "first step" in err


def test_plan_format_bt_prints_the_plan_as_a_behaviortree_cpp_tree(capsys):
    from flash_planner.planning.bt import from_bt_xml
    from flash_planner.planning.presets import default_skills_path
    from flash_planner.planning.skills import SkillCatalog

    task = "bring the red cup from the kitchen table to the sink"
    assert main(["plan", task, "--format", "bt"]) == 0
    tree = capsys.readouterr().out
    assert tree.startswith("<?xml") and "<TreeNodesModel>" in tree
    assert main(["plan", task, "--json", "--format", "bt"]) == 0
    answer = json.loads(capsys.readouterr().out)
    catalog = SkillCatalog.from_yaml(default_skills_path())
    assert answer["bt_xml"] == tree and from_bt_xml(tree, catalog) == answer["plan"]


def test_catalog_writes_its_tree_nodes_model_and_its_xsd(capsys):
    assert main(["catalog", "--bt-model"]) == 0
    model = capsys.readouterr().out
    assert '<Action ID="navigate_to">' in model and 'name="target"' in model
    assert main(["catalog", "--xsd"]) == 0
    assert "<xs:schema" in capsys.readouterr().out
    assert main(["catalog"]) == 2


def test_a_plan_a_person_reads_prints_names_as_written_and_stays_json(capsys):
    task = "open the kühlschrank"
    assert main(["plan", task]) == 0
    pretty = capsys.readouterr().out
    assert main(["plan", task, "--stream"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "kühlschrank" in pretty and "\\u00fc" not in pretty + "".join(lines)
    steps = json.loads(pretty)["plan"]
    assert [{k: v for k, v in json.loads(line).items() if k != "index"} for line in lines] \
        == steps
    assert any("kühlschrank" in step["args"].values() for step in steps)


@pytest.mark.parametrize("task,why", [("", "task is empty"),
                                      ("x" * 2001, "task is 2001 characters, the limit is 2000"),
                                      ("a\x07b", "the control character U+0007")])
def test_a_bad_task_is_refused_before_torch_is_imported(task, why):
    code = ("import sys; from flash_planner.cli import main; rc = main(['plan', sys.argv[1]]); "
            "print('torch' in sys.modules, rc)")
    proc = subprocess.run([sys.executable, "-c", code, task], capture_output=True, text=True)
    assert proc.stdout.split() == ["False", "2"], proc.stdout + proc.stderr
    assert why in proc.stderr


def test_every_option_has_help_and_a_set_default_is_shown():
    import argparse

    from flash_planner.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    missing, unshown = [], []
    for name, command in commands.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip():
                missing.append(flag)
            elif action.default not in (None, False, [], "", argparse.SUPPRESS) \
                    and not isinstance(action, argparse._StoreFalseAction) \
                    and "default" not in action.help:
                unshown.append(flag)
    assert missing == [] and unshown == [], (missing, unshown)


def test_smoke_prints_counts_and_timings_not_random_text(capsys):
    assert main(["smoke", "--max-new-tokens", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("writing a tiny random hybrid checkpoint")
    assert lines[1].startswith("random weights: the text is noise")
    assert len(lines) == 3 and lines[2].startswith("[") and "+ 8 new tokens" in lines[2]
    assert main(["smoke", "--max-new-tokens", "8", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 8


def test_serve_offers_no_json_output(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--json" not in capsys.readouterr().out
    assert main(["serve", "--json"]) == 2
    assert "unrecognized arguments: --json" in capsys.readouterr().err


def test_plan_plain_output_explains_the_failure(hybrid_dir, capsys):
    assert main(["plan", "open the fridge", "--model", str(hybrid_dir),
                 "--max-new-tokens", "8"]) == 1
    err = capsys.readouterr().err
    assert "no valid plan:" in err and "tok/s" in err


@pytest.mark.parametrize("args,match", [
    (["plan", "  "], "task is empty"),
    (["plan", "x", "--model", "no_such_preset"], "unknown model preset 'no_such_preset'"),
    (["plan", "x", "--model", "./missing/dir"], "model directory ./missing/dir does not exist"),
    (["plan", "x", "--model", "{model}", "--skills", "/no/skills.yaml"], "not readable"),
    (["plan", "x", "--model", "{model}", "--max-context", "64"],
     "exceeds max_context 64: raise the engine's max_context (--max-context, engine.max_context"
     "), lower max_new_tokens, or shorten the prompt"),
    (["plan", "x", "--model", "{model}", "--scene", "cup", "--scene", "mug|"],
     "scene[1] 'mug|': '|' separates a name from its short forms"),
    (["plan", "x", "--model", "{model}", "--reasoning-effort", "HIGH"],
     "reasoning_effort must be a short lowercase word ([a-z_], 1 to 16 characters"),
    (["plan", "x", "--model", "{model}", "--reasoning-effort", "low"],
     "invalid request: the model's chat template does not take reasoning_effort"),
])
def test_plan_usage_errors_exit_2(hybrid_dir, capsys, args, match):
    args = [a.replace("{model}", str(hybrid_dir)) for a in args]
    if args[1].strip() == "":
        args += ["--model", str(hybrid_dir)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and "\n" not in err and "Traceback" not in err


def test_plan_reasoning_effort_reaches_a_chat_template_that_takes_it(tmp_path, capsys):
    """--reasoning-effort renders into the prompt of a model whose template takes it (ours
    here, shaped as Qwen3.8's is described); one it refuses exits 2 with its message."""
    from effort_model import write_effort_checkpoint

    path = write_effort_checkpoint(tmp_path / "effort")
    base = ["plan", "open the fridge", "--model", str(path), "--json", "--max-new-tokens", "4",
            "--no-constrain"]
    assert main(base) == 1
    plain = json.loads(capsys.readouterr().out)["telemetry"]["prompt_tokens"]
    assert main(base + ["--reasoning-effort", "low"]) == 1
    assert json.loads(capsys.readouterr().out)["telemetry"]["prompt_tokens"] > plain
    assert main(base + ["--reasoning-effort", "high"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error.startswith("invalid request: reasoning_effort 'high': ") and \
        "Unexpected reasoning effort high" in error


@pytest.mark.parametrize("missing", ["fastapi", "uvicorn", "prometheus_client"])
def test_serve_without_its_extra_names_the_install_line(monkeypatch, capsys, missing):
    monkeypatch.setitem(sys.modules, missing, None)     # import fails as if not installed
    assert main(["serve", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert missing in err and "pip install 'flash_planner[serve]'" in err
    assert "\n" not in err and "Traceback" not in err


@pytest.fixture(scope="module")
def nan_demo(tmp_path_factory):
    from nan_model import write_nan_demo

    return write_nan_demo(tmp_path_factory.mktemp("nan") / "nan-demo")


@pytest.mark.parametrize("command", [["plan", "bring the red cup to the sink"],
                                     ["generate", "--prompt", "bring the red cup"]])
def test_a_model_with_nan_weights_is_one_line_naming_it_with_exit_2(nan_demo, command):
    """It loads (its files are sound) but cannot decode: `plan` refuses it at its warm-up,
    `generate` while it decodes, each in one line that names the model and the cause."""
    proc = subprocess.run([sys.executable, "-m", "flash_planner.cli", *command, "--model",
                           str(nan_demo), "--device", "cpu"], capture_output=True, text=True)
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stderr
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("flash-planner: error: ") and str(nan_demo) in err, err
    assert "non-finite logits (NaN or Inf)" in err, err
    if command[0] == "plan":
        assert f"warm-up of {nan_demo} failed" in err and proc.stdout == ""


def test_a_warm_up_that_fails_in_the_engine_is_one_line_with_exit_1(monkeypatch, capsys):
    """Not the weights but the run (a kernel, memory): the run failed, exit 1, and the
    line keeps the error's type and first line (a kernel's compile error spans many)."""
    from flash_planner.planning import warmup

    def broken(*args, **kwargs):
        raise RuntimeError("triton: failed to compile verify_block\n  more detail\n")

    monkeypatch.setattr(warmup, "generate", broken)
    assert main(["plan", "open the fridge", "--device", "cpu", "--threads", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("flash-planner: error: warm-up of ") and "demo" in err, err
    assert "failed: RuntimeError: triton: failed to compile verify_block (decoding with " \
        "method " in err, err


def _bound_catalog(tmp_path, places: dict) -> Path:
    """The default catalog with navigate_to bound to an action whose goal is the named
    location of its target (a PoseStamped), and a workspace box."""
    import yaml

    from flash_planner.planning.presets import default_skills_path

    data = yaml.safe_load(Path(default_skills_path()).read_text())
    for skill in data["skills"]:
        if skill["name"] == "navigate_to":
            skill["action"] = {"type": "nav2_msgs/action/NavigateToPose",
                               "server": "/navigate_to_pose",
                               "goal": {"pose": "{location:target}", "behavior_tree": ""}}
    data["locations"] = "places.yaml"
    data["workspace"] = {"frame": "map", "x": [-5, 5], "y": [-5, 5]}
    (tmp_path / "places.yaml").write_text(yaml.safe_dump(places))
    path = tmp_path / "skills.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_goals_prints_what_each_bound_step_would_send(tmp_path, capsys):
    task = "bring the red cup from the kitchen table to the sink"
    skills = _bound_catalog(tmp_path, {"kitchen table": {"frame": "map", "x": 1.0, "y": 2.0},
                                       "sink": {"frame": "map", "x": -1.5, "y": 0.5}})
    assert main(["plan", task, "--skills", str(skills), "--json", "--goals"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan, goals = out["plan"], out["goals"]
    assert [g["index"] for g in goals] == list(range(len(plan))) and "gate_error" not in out
    navigations = [(s, g) for s, g in zip(plan, goals) if s["skill"] == "navigate_to"]
    assert navigations, plan
    for step, goal in navigations:
        assert goal["action"] == "nav2_msgs/action/NavigateToPose"
        assert goal["server"] == "/navigate_to_pose"
        place = {"kitchen table": (1.0, 2.0), "sink": (-1.5, 0.5)}[step["args"]["target"]]
        position = goal["goal"]["pose"]["pose"]["position"]
        assert (position["x"], position["y"]) == place
    assert all(g["goal"] is None for s, g in zip(plan, goals) if s["skill"] != "navigate_to")


def test_plan_goals_reports_the_gates_refusal_and_fails(tmp_path, capsys):
    task = "bring the red cup from the kitchen table to the sink"
    skills = _bound_catalog(tmp_path, {"kitchen table": {"frame": "map", "x": 9.0, "y": 0.0},
                                       "sink": {"frame": "map", "x": 0.0, "y": 0.0}})
    assert main(["plan", task, "--skills", str(skills), "--goals"]) == 1
    err = capsys.readouterr().err
    assert ("flash-planner: the safety gate refuses the plan: step 0 (navigate_to): pose "
            "(9.0, 0.0) is outside the workspace x [-5.0, 5.0]") in err


def test_compile_without_compiling_is_a_usage_error(hybrid_dir, capsys):
    assert main(["compile", "--model", str(hybrid_dir), "--no-compile"]) == 2
    assert "compile --no-compile compiles nothing" in capsys.readouterr().err
