"""`flash-planner`: the command line of the planner and its engine.

    flash-planner plan TASK [--context TEXT] [--model PRESET|DIR|REPO] [options]
    flash-planner generate --model PRESET|DIR|REPO (--prompt TEXT | --prompt-ids 1,2,3)
    flash-planner fetch PRESET|REPO[@REVISION] ...   (download into the Hugging Face cache)
    flash-planner serve [--model PRESET|DIR|REPO] [--host 127.0.0.1] [--port 8000]
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

from .engine.methods import METHODS

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        raise UsageError(message)


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers "
                                         f"({exc})") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _max_batch(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"--max-batch wants a whole number >= 0 (0 = auto), "
                                         f"got {text!r}")
    return value


def _threads(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--threads wants a whole number >= 0 (0 = auto), "
                                         f"got {text!r}")
    return int(text)


def _add_download_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-download", action="store_true", help="fetch a model named by a "
                   "Hugging Face repo id that is not in the local cache (default: cache only)")


MODEL_HELP = "model preset, checkpoint directory or Hugging Face repo id"
DTYPE_HELP = "compute dtype (default: the preset's; auto = bf16 on CUDA, fp32 on CPU)"


def _add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options; None means 'the preset's or the engine's default'."""
    _add_download_arg(p)
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], help=DTYPE_HELP)
    p.add_argument("--kv-dtype", choices=["auto", "fp32", "bf16", "fp16", "fp8"],
                   help="KV cache dtype (default: the preset's; auto = the compute dtype; "
                   "fp8 = e4m3 with a scale per layer and head)")
    p.add_argument("--device", help="auto | cpu | cuda[:N]")
    p.add_argument("--weights", choices=["auto", "bf16", "fp8", "nvfp4", "int4"],
                   help="Linear weights: auto = as stored (fp8/nvfp4/int4 checkpoints load "
                   "unmodified); bf16 = full precision; fp8/nvfp4/int4 = quantize at load")
    p.add_argument("--max-context", type=int, metavar="N", help="prompt + generated tokens "
                   "the state holds (default: the preset's)")
    p.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="prompt tokens per prefill forward (default: 256)")
    p.add_argument("--dense-backend", choices=["torch", "onnxruntime", "tensorrt", "auto"],
                   help="how the dense segments run (default torch; auto = TensorRT on "
                   "CUDA when installed)")
    p.add_argument("--segment-cache", metavar="DIR", help="exported/built segments "
                   "(default ~/.cache/flash_planner/segments)")
    p.add_argument("--no-prefix-cache", action="store_true", help="prefill the system "
                   "prompt for every request instead of restoring its kept state")
    compiled = p.add_mutually_exclusive_group()
    compiled.add_argument("--compile", dest="compile", action="store_const", const="on",
                          help="decode and verify as compiled static-shape graphs (default: "
                          "the preset's; auto = on on CUDA); compiled once, cached on disk")
    compiled.add_argument("--no-compile", dest="compile", action="store_const", const="off",
                          help="every forward eager")
    p.add_argument("--threads", type=_threads, metavar="N", help="torch CPU threads (default: "
                   "the preset's; 0 = auto: 1 with a GPU, else half the usable cores, or "
                   "OMP_NUM_THREADS when set)")
    p.add_argument("--max-batch", type=_max_batch, metavar="N", help="requests decoded at "
                   "once, one verify per cycle for all (default: the preset's; 0 = auto: 8; "
                   "more wait in the queue)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--drafter", metavar="DIR|REPO", help="DFlash drafter directory or "
                      "repo id (turns speculation on)")
    spec.add_argument("--method", choices=METHODS,
                      help="proposer: the DFlash drafter, the checkpoint's own MTP head, "
                      "auto (each cycle to the faster of those loaded; the default) or none")
    spec.add_argument("--mtp-steps", type=int, help="MTP drafts per cycle (default 3)")
    spec.add_argument("--no-spec", action="store_true", help="plain decoding even with a "
                      "proposer (same as --method none for the request)")
    spec.add_argument("--block-size", type=int, help="verify block: anchor + drafts "
                      "(default: the drafter's)")
    spec.add_argument("--window", type=int, help="drafter context window (default 128)")
    spec.add_argument("--no-window-seed", action="store_true",
                      help="do not seed the drafter window from the prompt")
    spec.add_argument("--relaxed-thinking", action="store_true",
                      help="relaxed acceptance inside <think> ... </think>")
    spec.add_argument("--relaxed-topk", type=int, default=3, metavar="K",
                      help="relaxed acceptance: a draft among the target's top K "
                      "(default: %(default)s)")
    spec.add_argument("--relaxed-delta", type=float, default=1.0, metavar="D",
                      help="relaxed acceptance: within D of the top logit (default: "
                      "%(default)s)")


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                  "frequency_penalty", "repetition_penalty")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (default: the preset's; temperature 0 = greedy)")
    g.add_argument("--sampling", metavar="MODE|JSON", help="greedy, model (the checkpoint's "
                   "generation_config.json), card (the Qwen3 cards' values per phase), or a "
                   "JSON object of settings for both phases or per phase under \"thinking\" "
                   "and \"answer\"")
    for name in SAMPLING_FLAGS:
        kind = int if name == "top_k" else float
        g.add_argument("--" + name.replace("_", "-"), type=kind, metavar="X",
                       help=f"{name} of both phases, over --sampling")
    g.add_argument("--seed", type=int, help="makes a sampled run reproducible")


def _sampling(args: argparse.Namespace, engine, base) -> object:
    """The run's Sampling: --sampling (or the preset's `base`) resolved with the model's
    defaults, the single-setting flags over both phases, then --seed."""
    from dataclasses import replace

    from .engine.sampling import Sampling, resolve_sampling
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flash-planner", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser("plan", help="plan a task: a validated JSON plan of skills")
    plan.add_argument("task", help="what the robot should do, in plain language")
    plan.add_argument("--context", default="", help="scene description")
    plan.add_argument("--scene", metavar="NAME", action="append", default=[],
                      help="an object or place of the scene, with short forms after | "
                      "(\"coke can|coke\"); repeat for each: `grounded: scene` arguments "
                      "take only these (default: none, names come from the text)")
    plan.add_argument("--model", metavar="PRESET|DIR|REPO", default="demo",
                      help=f"{MODEL_HELP} (default: the embedded demo planner)")
    plan.add_argument("--skills", metavar="YAML", help="skill catalog (default: "
                      "config/skills.yaml)")
    thinking = plan.add_mutually_exclusive_group()
    thinking.add_argument("--thinking", dest="thinking", action="store_true", default=None,
                          help="think before the plan (default: the planner's, on)")
    thinking.add_argument("--no-thinking", dest="thinking", action="store_false",
                          help="answer with the plan at once")
    plan.add_argument("--reasoning-effort", metavar="WORD",
                      help="passed to chat templates that define reasoning_effort, e.g. "
                      "Qwen3.8's (xhigh, medium, low); refused for a model whose template "
                      "does not take it (default: the template's)")
    plan.add_argument("--max-new-tokens", type=int, default=512, metavar="N",
                      help="tokens generated at most, thought and plan (default: %(default)s)")
    plan.add_argument("--no-constrain", action="store_true", help="decode the answer without "
                      "the catalog's plan grammar (it is only validated afterwards)")
    plan.add_argument("--stream", action="store_true", help="print each plan step the moment "
                      "it closes, one JSON line {\"index\", \"skill\", \"args\"} each")
    plan.add_argument("--backend", choices=["local", "remote", "remote_or_local"],
                      help="where the plan is made (default: the preset's, local)")
    plan.add_argument("--remote-url", metavar="URL", help="an OpenAI-compatible server's base "
                      "URL (e.g. http://gpu-box:8000/v1); its key from "
                      "$FLASH_PLANNER_REMOTE_KEY")
    plan.add_argument("--remote-model", metavar="NAME", help="the model id it serves")
    plan.add_argument("--remote-timeout", type=float, default=30.0, metavar="S",
                      help="the longest silence inside the remote's stream (default: "
                      "%(default)s s)")
    _add_engine_args(plan)
    _add_json_arg(plan)
    _add_sampling_args(plan)

    gen = sub.add_parser("generate", help="generate text from a model (greedy unless told to "
                         "sample)")
    gen.add_argument("--model", required=True, metavar="PRESET|DIR|REPO",
                     help=MODEL_HELP)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt as text")
    src.add_argument("--prompt-ids", type=_prompt_ids, metavar="1,2,3",
                     help="the prompt as token ids")
    gen.add_argument("--chat", action="store_true",
                     help="render --prompt as a user message with the chat template")
    gen.add_argument("--image", action="append", default=[], metavar="FILE",
                     help="an image for a vision-language model, before the --chat text "
                     "(repeatable); with --prompt-ids, one image token (run) per image")
    gen.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                     help="tokens generated at most (default: %(default)s)")
    gen.add_argument("--ignore-eos", action="store_true", help="generate until max-new-tokens")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop string (repeatable)")
    _add_engine_args(gen)
    _add_json_arg(gen)
    _add_sampling_args(gen)

    fetch = sub.add_parser("fetch", help="download models into the Hugging Face cache ahead "
                           "of time (a preset's target and drafter, or repo ids)")
    fetch.add_argument("models", nargs="+", metavar="PRESET|REPO[@REVISION]",
                       help="a preset (its target and drafter) or a Hugging Face repo id")
    _add_json_arg(fetch)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the planner "
                           "(chat completions, /v1/plans, /health, /metrics)")
    serve.add_argument("--model", metavar="PRESET|DIR|REPO", default="demo",
                       help=f"{MODEL_HELP} (default: the embedded demo planner)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default loopback "
                       "only; 0.0.0.0 exposes it to the network)")
    serve.add_argument("--port", type=int, default=8000,
                       help="TCP port (default: %(default)s)")
    serve.add_argument("--served-model-name", metavar="NAME",
                       help="the model id clients name (default: the preset or repo)")
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/* "
                       "(default: $FLASH_PLANNER_API_KEY when set)")
    serve.add_argument("--skills", metavar="YAML", help="skill catalog for /v1/plans")
    serve.add_argument("--queue-depth", type=int, default=8,
                       help="requests waiting at most; more get 429 (default: %(default)s)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                       help="larger request bodies get 413 (default: %(default)s)")
    serve.add_argument("--max-prompt-chars", type=int, default=32_000, metavar="N",
                       help="longer chat prompts get 413 (default: %(default)s)")
    serve.add_argument("--max-tokens", type=int, default=512, metavar="N",
                       help="a chat completion's default max_tokens (default: %(default)s)")
    _add_engine_args(serve)

    build = sub.add_parser("build-engines", help="export (and build) every dense segment")
    build.add_argument("--model", required=True, metavar="PRESET|DIR|REPO",
                       help=MODEL_HELP)
    _add_download_arg(build)
    # The dense backend under the flag name users know; stored where _load_engine reads it
    # (never `backend`, which is where `plan` keeps its local/remote choice).
    build.add_argument("--backend", dest="dense_backend", choices=["onnxruntime", "tensorrt"],
                       default="tensorrt", help="what to build the segments for (default: "
                       "%(default)s)")
    build.add_argument("--segment-cache", metavar="DIR", help="where the segments go "
                       "(default: ~/.cache/flash_planner/segments)")
    build.add_argument("--device", help="auto | cpu | cuda[:N]")
    build.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], help=DTYPE_HELP)

    smoke = sub.add_parser("smoke", help="engine smoke run on a tiny random checkpoint")
    smoke.add_argument("--kind", default="hybrid", choices=["hybrid", "hybrid_vl", "dense"],
                       help="the tiny checkpoint's architecture (default: %(default)s)")
    smoke.add_argument("--prompt", default="pick up the red cup and place it on the table",
                       help="the prompt (default: %(default)r)")
    smoke.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                       help="tokens generated (default: %(default)s)")
    _add_engine_args(smoke)
    _add_json_arg(smoke)
    _add_sampling_args(smoke)
    return parser


def _progress_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _load_engine(args: argparse.Namespace, model: str, progress=_progress_to_stderr):
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
        max_batch=getattr(args, "max_batch", None))
    return Engine.load(config, progress=progress), preset


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
    from .engine.images import read_image
    from .engine.speculative import NonFiniteLogits

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
    from .planning.presets import default_skills_path
    from .planning.service import PlannerConfig, PlannerService
    from .planning.skills import SkillCatalog
    from .planning.warmup import WarmUpError

    catalog = SkillCatalog.from_yaml(args.skills or default_skills_path())
    _one_request(args)
    engine, preset = _load_engine(args, args.model)
    request = replace(request, sampling=_sampling(args, engine, preset.sampling))
    service = PlannerService(engine, catalog, PlannerConfig(
        constrain=not args.no_constrain, refusal_hint=preset.refusal_hint,
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
    if args.json:
        print(json.dumps(result.as_dict()))
    elif result.success and not args.stream:  # valid JSON, one step per line
        # a person reads this: names as written (still valid JSON)
        steps = ",\n".join(f"  {json.dumps(step, ensure_ascii=False)}" for step in result.plan)
        print(f'{{"plan": [\n{steps}\n]}}')
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
    return EXIT_OK if result.success else EXIT_USAGE if result.rejected else EXIT_FAILED


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
        engine, _ = _load_engine(args, args.model)
        service = PlannerService(engine, catalog, PlannerConfig(
            queue_depth=args.queue_depth, refusal_hint=preset.refusal_hint,
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
