"""`flash-planner`: the command-line face of the engine.

    flash-planner generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) [options]
    flash-planner smoke    (writes a tiny random checkpoint and generates from it)

Exit codes: 0 success, 1 the run failed, 2 bad input or usage. Expected failures print one
line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile

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


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="generate until max-new-tokens")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--kv-dtype", default="auto",
                   choices=["auto", "fp32", "bf16", "fp16", "fp8"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--drafter", metavar="DIR", help="DFlash drafter directory (turns "
                      "speculation on)")
    spec.add_argument("--no-spec", action="store_true", help="plain decoding even with a "
                      "drafter")
    spec.add_argument("--block-size", type=int, help="verify block: anchor + drafts "
                      "(default: the drafter's)")
    spec.add_argument("--window", type=int, default=128, help="drafter context window")
    spec.add_argument("--no-window-seed", action="store_true",
                      help="do not seed the drafter window from the prompt")
    spec.add_argument("--relaxed-thinking", action="store_true",
                      help="relaxed acceptance inside <think> ... </think>")
    spec.add_argument("--relaxed-topk", type=int, default=3)
    spec.add_argument("--relaxed-delta", type=float, default=1.0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flash-planner", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="greedy generation from a model directory")
    gen.add_argument("--model", required=True, metavar="DIR")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT")
    src.add_argument("--prompt-ids", type=_prompt_ids, metavar="1,2,3")
    gen.add_argument("--chat", action="store_true",
                     help="render --prompt as a user message with the chat template")
    _add_engine_args(gen)
    smoke = sub.add_parser("smoke", help="engine smoke run on a tiny random checkpoint")
    smoke.add_argument("--kind", default="hybrid", choices=["hybrid", "hybrid_vl", "dense"])
    smoke.add_argument("--prompt", default="pick up the red cup and place it on the table")
    _add_engine_args(smoke)
    return parser


def _run(args: argparse.Namespace, model_path: str) -> int:
    from .engine.engine import Engine, EngineConfig
    from .engine.generate import GenerationSettings, generate

    block = args.block_size
    config = EngineConfig(model_path=model_path, dtype=args.dtype, kv_dtype=args.kv_dtype,
                          device=args.device, max_context=args.max_context,
                          prefill_chunk=args.prefill_chunk, drafter_path=args.drafter,
                          block_size=block, max_block=max(16, block or 0),
                          window=args.window, window_seed=not args.no_window_seed)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens,
                                  ignore_eos=args.ignore_eos, stop_strings=tuple(args.stop),
                                  speculative=not args.no_spec,
                                  relaxed_thinking=args.relaxed_thinking,
                                  relaxed_topk=args.relaxed_topk,
                                  relaxed_delta=args.relaxed_delta)
    engine = Engine.load(config)
    prompt = args.prompt_ids if getattr(args, "prompt_ids", None) else args.prompt
    if getattr(args, "chat", False):
        prompt = [{"role": "user", "content": args.prompt}]
    stream = None if args.json else (lambda ids, delta: print(delta, end="", flush=True))
    result = generate(engine, prompt, settings, on_token=stream)
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                          "finish_reason": result.finish_reason,
                          "stats": result.stats.as_dict(),
                          "memory_bytes": engine.memory.as_dict()}))
    else:
        s = result.stats
        spec = ""
        if s.drafted:
            spec = (f", {s.tokens_per_cycle:.2f} tokens/cycle "
                    f"(mean accepted {s.mean_accepted:.2f})")
        print(f"\n[{s.prompt_tokens} prompt + {s.new_tokens} new tokens, "
              f"finish={result.finish_reason}, TTFT {s.ttft_ms:.1f} ms, "
              f"{s.decode_tokens_per_s:.1f} tok/s{spec}, total {s.total_ms:.1f} ms; "
              f"{engine.memory}]")
    return EXIT_OK


def _smoke(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from .engine.tiny import write_tiny_checkpoint

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="flash-planner-smoke-") as tmp:
        if not args.json:
            print(f"writing a tiny random {args.kind} checkpoint to {tmp} ...", flush=True)
        write_tiny_checkpoint(tmp, kind=args.kind)
        args.ignore_eos = True  # random weights: show a full run of tokens
        return _run(args, tmp)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from .engine.cache import ContextOverflowError
    from .engine.checkpoint import CheckpointError
    from .engine.config import ConfigError

    try:
        args = build_parser().parse_args(argv)
        if args.command == "generate":
            return _run(args, args.model)
        return _smoke(args)
    except UsageError as exc:
        print(f"flash-planner: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointError, ConfigError, ContextOverflowError, ValueError) as exc:
        print(f"flash-planner: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("flash-planner: interrupted", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
