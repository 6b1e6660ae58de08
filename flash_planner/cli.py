"""`flash-planner`: the command line of the planner and its engine.

    flash-planner plan TASK [--context TEXT] [--model PRESET|DIR|REPO] [options]
    flash-planner generate --model PRESET|DIR|REPO (--prompt TEXT | --prompt-ids 1,2,3)
    flash-planner fetch PRESET|REPO[@REVISION] ...   (download into the Hugging Face cache)
    flash-planner serve [--model PRESET|DIR|REPO] [--host 127.0.0.1] [--port 8000]
    flash-planner mcp [--model PRESET|DIR|REPO | --url URL] [--transport stdio|http]
    flash-planner catalog [--skills YAML] (--bt-model | --xsd)   (the catalog for BT.CPP)
    flash-planner compile --model PRESET|DIR|REPO [--compile-cache DIR]   (fill the cache)
    flash-planner build-engines --model PRESET|DIR|REPO [--backend onnxruntime|tensorrt]
    flash-planner smoke    (writes a tiny random checkpoint and generates from it)

REPO is a Hugging Face repo id (org/name, optionally @revision); `plan` and `generate` read
it from the local cache and download only with --allow-download.

Exit codes: 0 success, 1 no valid plan / the run failed, 2 bad input or usage (a model
that produces NaN or Inf logits included). Expected failures print one line on stderr, never
a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from .cli_parser import MCP_URL, SAMPLING_FLAGS, UsageError, build_parser

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _file_bytes(name: str, flag: str) -> bytes:
    try:
        return Path(name).read_bytes()
    except OSError as exc:
        raise UsageError(f"{flag} {name}: {exc.strerror or exc}") from None


def _sampling(args: argparse.Namespace, engine, base) -> object:
    """The run's Sampling: --sampling (or the preset's `base`) resolved with the model's
    defaults, the single-setting flags over both phases, then --seed."""
    from dataclasses import replace

    from .engine.loop.sampling import Sampling, resolve_sampling
    from .planning.request import sampling_spec

    spec = sampling_spec(args.sampling, "--sampling") if args.sampling else base
    sampling = resolve_sampling(spec, Sampling(), engine.generation_defaults,
                                "--sampling" if args.sampling else "the preset's sampling")
    flat = {name: getattr(args, name) for name in SAMPLING_FLAGS
            if getattr(args, name) is not None}
    if flat:
        try:
            sampling = Sampling(replace(sampling.thinking, **flat),
                                replace(sampling.answer, **flat), sampling.seed)
        except ValueError as exc:
            raise ValueError(f"--{str(exc).replace('_', '-')}") from None
    return sampling.with_seed(args.seed)


def _progress_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _load_engine(args: argparse.Namespace, model: str, progress=_progress_to_stderr,
                 hold_background: bool = False):
    from .engine.engine import Engine
    from .planning.presets import resolve_model

    preset = resolve_model(model)
    block = getattr(args, "block_size", None)
    config = preset.engine_config(
        allow_download=args.allow_download, progress=progress,
        dtype=args.dtype, kv_dtype=getattr(args, "kv_dtype", None), device=args.device,
        weights=getattr(args, "weights", None), max_context=getattr(args, "max_context", None),
        prefill_chunk=getattr(args, "prefill_chunk", None),
        drafter_path=getattr(args, "drafter", None), block_size=block,
        method=getattr(args, "method", None), mtp_steps=getattr(args, "mtp_steps", None),
        max_block=max(16, block or 0), window=getattr(args, "window", None),
        window_seed=False if getattr(args, "no_window_seed", False) else None,
        dense_backend=getattr(args, "dense_backend", None),
        segment_cache=args.segment_cache,
        prefix_cache=False if getattr(args, "no_prefix_cache", False) else None,
        compile=getattr(args, "compile", None), threads=getattr(args, "threads", None),
        compile_cache=getattr(args, "compile_cache", None),
        compile_lazy=getattr(args, "compile_lazy", None),
        max_batch=getattr(args, "max_batch", None))
    return Engine.load(config, progress=progress, hold_background=hold_background), preset


def _backend(args: argparse.Namespace, preset) -> dict:
    from .planning.remote import RemoteConfig

    backend = args.backend or preset.backend
    if backend == "local":
        return {"backend": "local"}
    url, model = args.remote_url or preset.remote_url, args.remote_model or preset.remote_model
    if not url or not model:
        raise UsageError(f"--backend {backend} needs --remote-url and --remote-model")
    return {"backend": backend, "remote": RemoteConfig(url, model,
                                                       read_timeout_s=args.remote_timeout)}


def _spec_settings(args: argparse.Namespace, preset) -> dict:
    return dict(speculative=not args.no_spec,
                relaxed_thinking=args.relaxed_thinking or preset.relaxed_thinking,
                relaxed_topk=args.relaxed_topk, relaxed_delta=args.relaxed_delta)


def _summary(stats) -> str:
    spec = ""
    if stats.drafted:
        spec = (f", {stats.tokens_per_cycle:.2f} tokens/cycle "
                f"(mean accepted {stats.mean_accepted:.2f})")
    return (f"{stats.prompt_tokens} prompt + {stats.new_tokens} new tokens, "
            f"TTFT {stats.ttft_ms:.1f} ms, {stats.decode_tokens_per_s:.1f} tok/s{spec}, "
            f"total {stats.total_ms:.1f} ms")


def _one_request(args: argparse.Namespace) -> None:
    """A one-request command: the engine's own state, no batch slots, unless --max-batch."""
    if getattr(args, "max_batch", None) is None:
        args.max_batch = 1


def _generate(args: argparse.Namespace, model: str, show_text: bool = True) -> int:
    """Generate and print the text (unless `show_text` is off), then the run's summary."""
    from .engine.generate import GenerationSettings, generate
    from .engine.inputs.images import read_image
    from .engine.loop.speculative import NonFiniteLogits

    _one_request(args)
    engine, preset = _load_engine(args, model)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens,
                                  ignore_eos=args.ignore_eos, stop_strings=tuple(args.stop),
                                  sampling=_sampling(args, engine, "greedy"),
                                  **_spec_settings(args, preset))
    prompt = args.prompt_ids if getattr(args, "prompt_ids", None) else args.prompt
    files = getattr(args, "image", [])
    config = engine.require_vision().image_config if files else None   # exit 2: text-only
    images = [read_image(name, config, f"--image {name}") for name in files]
    if getattr(args, "chat", False):
        prompt = [{"role": "user", "content": args.prompt if not files else
                   [{"type": "image"} for _ in files] + [{"type": "text", "text": args.prompt}]}]
    stream = (lambda ids, delta: print(delta, end="", flush=True)) \
        if show_text and not args.json else None
    try:
        result = generate(engine, prompt, settings, on_token=stream, images=images)
    except NonFiniteLogits as exc:   # the model's fault, as `plan` finds it at warm-up
        print(f"flash-planner: error: {engine.config.model_path}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                          "finish_reason": result.finish_reason,
                          "stats": result.stats.as_dict(),
                          "memory_bytes": engine.memory.as_dict()}))
    else:
        print(("\n" if show_text else "") + f"[{_summary(result.stats)}, "
              f"finish={result.finish_reason}; {engine.memory}]")
    return EXIT_OK


def _plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .planning.request import MAX_CONTEXT_CHARS, MAX_TASK_CHARS, PlanRequest

    # checked before torch is imported: a bad task is answered at once
    request = PlanRequest(task=args.task, context=args.context, scene=tuple(args.scene),
                          max_new_tokens=args.max_new_tokens, enable_thinking=args.thinking,
                          reasoning_effort=args.reasoning_effort
                          ).checked(MAX_TASK_CHARS, MAX_CONTEXT_CHARS)
    from .planning.bt import to_bt_xml
    from .planning.images import ImageSource
    from .planning.presets import default_skills_path
    from .planning.service import PlannerConfig, PlannerService
    from .planning.skills import SkillCatalog
    from .planning.warmup import WarmUpError

    images = tuple(ImageSource(_file_bytes(name, "--image"), f"--image {name}")
                   for name in args.image)
    catalog = SkillCatalog.from_yaml(args.skills or default_skills_path())
    _one_request(args)
    engine, preset = _load_engine(args, args.model, hold_background=True)
    request = replace(request, sampling=_sampling(args, engine, preset.sampling), images=images)
    service = PlannerService(engine, catalog, PlannerConfig(
        constrain=not args.no_constrain, refusal_hint=preset.refusal_hint,
        recovery=preset.recovery,
        reasoning_effort=preset.reasoning_effort,
        **_backend(args, preset), **_spec_settings(args, preset)))

    def print_steps(feedback) -> None:
        for index, step in feedback.steps:
            print(json.dumps({"index": index, **step}, ensure_ascii=False), flush=True)

    service.start()
    try:
        # as the node and `serve` do: the request then pays neither the prefix nor first
        # calls, and a model that cannot decode is refused before it
        service.warm_up()
        result = service.plan(request, on_feedback=print_steps if args.stream else None)
    except WarmUpError as exc:  # the model's fault (exit 2, as a bad checkpoint) or the run's
        print(f"flash-planner: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.broken_weights else EXIT_FAILED
    finally:
        service.stop()
    goals, refusal = _goals(catalog, result) if args.goals else (None, "")
    tree = (to_bt_xml(result.plan, catalog) if args.format == "bt" and result.success
            else None)
    if args.json:
        print(json.dumps({**result.as_dict(), **({} if goals is None else {"goals": goals}),
                          **({"gate_error": refusal} if refusal else {}),
                          **({} if tree is None else {"bt_xml": tree})}))
    elif tree is not None:
        print(tree, end="")
    elif result.success and not args.stream:  # valid JSON, one step per line
        # a person reads this: names as written (still valid JSON)
        steps = ",\n".join(f"  {json.dumps(step, ensure_ascii=False)}" for step in result.plan)
        print(f'{{"plan": [\n{steps}\n]}}')
    if not args.json and goals is not None:
        for goal in goals:
            print(json.dumps(goal, ensure_ascii=False))
    if not args.json and refusal:
        print(f"flash-planner: the safety gate refuses the plan: {refusal}", file=sys.stderr)
    if not args.json and not result.success:
        print(f"flash-planner: no valid plan: {result.error}", file=sys.stderr)
    if not args.json and not result.rejected:     # a rejected request never decoded
        t = result.telemetry
        step = (f"first step {t['first_step_ms']:.1f} ms, " if "first_step_ms" in t else "")
        print(f"[{t.get('new_tokens', 0)} tokens, TTFT {t.get('ttft_ms', 0):.1f} ms, {step}"
              f"{t.get('decode_tokens_per_s', 0):.1f} tok/s, "
              f"{t.get('tokens_per_cycle', 0):.2f} tokens/cycle, "
              + (f"{t['forced_tokens']} forced by the grammar, " if t.get("constrained") else "")
              + f"total {t.get('total_latency_ms', 0):.1f} ms]", file=sys.stderr)
    if refusal:
        return EXIT_FAILED
    return EXIT_OK if result.success else EXIT_USAGE if result.rejected else EXIT_FAILED


def _goals(catalog, result) -> tuple[list[dict] | None, str]:
    """`--goals`: each bound step's goal as the safety gate fills and checks it (a plan-only
    step has none), or the gate's refusal; nothing is sent (planning/gate.py)."""
    from .planning import plan_tree
    from .planning.gate import GateError, gate

    if not result.success:
        return None, ""
    try:
        filled = gate(result.plan, catalog.bindings, catalog.locations, catalog.workspace)
    except GateError as exc:
        return None, str(exc)
    out = []
    for leaf in plan_tree.leaves(plan_tree.tree_of(result.plan)):
        step, goal = leaf.step, filled[leaf.index]
        b = catalog.bindings.get(step["skill"])
        out.append({"index": leaf.index, "path": plan_tree.label(leaf.path),
                    "skill": step["skill"],
                    **({} if b is None else {b.kind: b.type, "server": b.server}),
                    "goal": goal})
    return out, ""


def _catalog(args: argparse.Namespace) -> int:
    """`flash-planner catalog`: the skill catalog as BehaviorTree.CPP sees it (its
    TreeNodesModel for Groot2 and a BT.CPP factory, or the XSD BT XML trees are read
    against), after the checks a catalog passes at load."""
    from .planning.bt import catalog_xsd, tree_nodes_model
    from .planning.presets import default_skills_path
    from .planning.skills import SkillCatalog

    catalog = SkillCatalog.from_yaml(args.skills or default_skills_path())
    print(catalog_xsd(catalog) if args.xsd else tree_nodes_model(catalog), end="")
    return EXIT_OK


SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def _check_serve_extra() -> None:
    """`serve` needs the `serve` extra; say which line installs it instead of a traceback."""
    import importlib.util

    missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"serve needs {', '.join(missing)}, which are not installed: "
                         "pip install 'flash_planner[serve]' (from a checkout: "
                         "pip install -e '.[serve]')")


def _serve(args: argparse.Namespace) -> int:
    import os

    _check_serve_extra()
    import uvicorn

    from .planning.images import ImageLimits
    from .planning.presets import default_skills_path, resolve_model
    from .planning.service import PlannerConfig, PlannerService
    from .planning.skills import SkillCatalog
    from .server.app import ServerState, create_app

    for name in ("port", "queue_depth", "max_body_bytes", "max_prompt_chars", "max_tokens"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    preset = resolve_model(args.model)
    catalog = SkillCatalog.from_yaml(args.skills or default_skills_path())
    state = ServerState(model_name=args.served_model_name or args.model,
                        api_key=args.api_key or os.environ.get("FLASH_PLANNER_API_KEY") or None,
                        max_body_bytes=args.max_body_bytes,
                        max_prompt_chars=args.max_prompt_chars,
                        default_max_tokens=args.max_tokens)

    def load() -> PlannerService:
        engine, _ = _load_engine(args, args.model, hold_background=True)
        service = PlannerService(engine, catalog, PlannerConfig(
            queue_depth=args.queue_depth, refusal_hint=preset.refusal_hint,
            recovery=preset.recovery,
            images=ImageLimits(allow_urls=args.allow_image_urls),
            sampling=preset.sampling, reasoning_effort=preset.reasoning_effort,
            **_spec_settings(args, preset)))
        service.start()
        try:
            service.warm_up()
        except Exception:   # /health and every request say why; no idle worker is left
            service.stop(reason="the model failed its warm-up")
            raise
        _progress_to_stderr(f"serving {state.model_name} on http://{args.host}:{args.port}")
        return service

    uvicorn.run(create_app(state, load), host=args.host, port=args.port, log_level="warning")
    return EXIT_OK


def _mcp(args: argparse.Namespace) -> int:
    """`flash-planner mcp`: the MCP server on the planner loaded in this process (--model)
    or on a running `serve` (--url, checked first: exit 2 with one line if it does not
    answer); over a running node: `planner_mcp`, ros/mcp_door.py. Over stdio, stdout is the
    host's channel: every other line goes to stderr."""
    import importlib.util
    import os

    if importlib.util.find_spec("mcp") is None:
        raise UsageError("mcp needs the MCP SDK, which is not installed: pip install "
                         "'flash_planner[mcp]' (from a checkout: pip install -e '.[mcp]')")
    from .server.mcp_server import DoorError, HttpDoor, ServiceDoor, check_port, serve

    check_port(args.port)
    if args.model is None:
        door = HttpDoor(args.url or MCP_URL,
                        args.api_key or os.environ.get("FLASH_PLANNER_API_KEY"))
        try:
            door.check()
        except DoorError as exc:
            raise UsageError(f"mcp: {exc} (start `flash-planner serve` there first, or "
                             "host the planner in this process: --model PRESET)") from None
    else:
        door = ServiceDoor(_mcp_planner(args), args.model, _progress_to_stderr)
    serve(door, args.transport, args.host, args.port)
    return EXIT_OK


def _mcp_planner(args: argparse.Namespace):
    """`mcp --model`'s load: the preset and catalog checked now (a bad one exits 2 before
    the server starts), the engine loaded and warmed up later, in the door's thread, as
    `serve` does it."""
    from .planning.presets import default_skills_path, resolve_model
    from .planning.skills import SkillCatalog

    preset = resolve_model(args.model)
    catalog = SkillCatalog.from_yaml(args.skills or default_skills_path())

    def load():
        # imported here, in the load's thread: torch takes seconds the handshake never waits
        from .planning.service import PlannerConfig, PlannerService

        engine, _ = _load_engine(args, args.model, hold_background=True)
        service = PlannerService(engine, catalog, PlannerConfig(
            refusal_hint=preset.refusal_hint, recovery=preset.recovery,
            sampling=preset.sampling,
            reasoning_effort=preset.reasoning_effort, **_spec_settings(args, preset)))
        service.start()
        try:
            service.warm_up()
        except Exception:   # every call then says why; no idle worker is left
            service.stop(reason="the model failed its warm-up")
            raise
        _progress_to_stderr(f"planner {args.model} ready")
        return service

    return load


def _fetch(args: argparse.Namespace) -> int:
    """Every repo the named presets (or repo ids) come from, into the Hugging Face cache;
    huggingface_hub draws its progress bars on stderr."""
    from .planning import sources
    from .planning.presets import PresetError, resolve_model

    repos = []
    for model in args.models:
        preset = resolve_model(model)
        if not preset.repos():
            raise PresetError(f"{model} names local directories only "
                              f"({preset.target_path}): nothing to fetch")
        repos += [r for r in preset.repos() if r not in repos]
    fetched = {}
    for repo in repos:
        fetched[str(repo)] = sources.resolve(str(repo), allow_download=True,
                                             progress=_progress_to_stderr)
    if args.json:
        print(json.dumps({"cache": str(sources.hub_cache()), "models": fetched}))
    else:
        for repo, path in fetched.items():
            print(f"{repo}: {path}")
    return EXIT_OK


def _build_engines(args: argparse.Namespace) -> int:
    backend = args.dense_backend
    print(f"building dense segments of {args.model} with {backend} ...", flush=True)
    engine, _ = _load_engine(args, args.model,
                             progress=lambda line: print(line, flush=True))
    got = engine.model.dense.name
    if got != backend:
        print(f"flash-planner: {backend} could not serve (see the warning above); "
              f"the engine would run the dense segments with {got}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{len(engine.model.segments)} segments ready for {backend}")
    return EXIT_OK


def _compile(args: argparse.Namespace) -> int:
    """Load the model with its forwards compiled: every graph compiled (or already in the
    cache) and stored, so that the next start reads them."""
    if args.compile == "off":
        raise UsageError("compile --no-compile compiles nothing; leave the flag out")
    args.compile, args.compile_lazy = "on", False     # every bucket now, none deferred
    engine, _ = _load_engine(args, args.model)
    report = engine.compile_report
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print(f"{report.graphs} graphs ready in {report.cache_dir} ({report.read} were "
              f"already there, {report.graphs - report.read} compiled in "
              f"{report.seconds:.1f} s)")
    return EXIT_OK


def _smoke(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from .train.tiny import write_tiny_checkpoint

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="flash-planner-smoke-") as tmp:
        if not args.json:
            print(f"writing a tiny random {args.kind} checkpoint to {tmp} ...", flush=True)
        write_tiny_checkpoint(tmp, kind=args.kind)
        args.ignore_eos, args.stop, args.prompt_ids = True, [], None  # random weights
        if not args.json:
            print("random weights: the text is noise and not shown; counts and timings:",
                  flush=True)
        return _generate(args, tmp, show_text=False)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
        if args.command == "generate":
            return _generate(args, args.model)
        if args.command == "plan":
            return _plan(args)
        if args.command == "build-engines":
            return _build_engines(args)
        if args.command == "fetch":
            return _fetch(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "mcp":
            return _mcp(args)
        if args.command == "catalog":
            return _catalog(args)
        if args.command == "compile":
            return _compile(args)
        return _smoke(args)
    except UsageError as exc:
        print(f"flash-planner: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:  # every expected error type here derives from ValueError
        print(f"flash-planner: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("flash-planner: interrupted", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
