"""The `flash-planner` command line's arguments: its parser, each subcommand's flags and
their checks (cli.py runs the commands)."""

from __future__ import annotations

import argparse

from .engine.methods import METHODS

DESCRIPTION = "`flash-planner`: the command line of the planner and its engine."

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


MCP_URL = "http://127.0.0.1:8000"     # `flash-planner mcp` with neither --model nor --url
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flash-planner", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser("plan", help="plan a task: a validated JSON plan of skills")
    plan.add_argument("task", help="what the robot should do, in plain language")
    plan.add_argument("--context", default="", help="scene description")
    plan.add_argument("--scene", metavar="NAME", action="append", default=[],
                      help="an object or place of the scene, with short forms after | "
                      "(\"coke can|coke\"); repeat for each: `grounded: scene` arguments "
                      "take only these (default: none, names come from the text)")
    plan.add_argument("--image", action="append", default=[], metavar="FILE",
                      help="a camera image shown before the task, for a vision-language "
                      "model (repeatable)")
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
    plan.add_argument("--goals", action="store_true", help="also print the goal each step "
                      "bound in the catalog would send (its action or service; nothing is sent), "
                      "or the safety gate's refusal of the whole plan (exit 1)")
    plan.add_argument("--format", choices=["json", "bt"], default="json",
                      help="how the plan is printed: JSON, or a BehaviorTree.CPP v4 XML tree "
                      "with its skills' TreeNodesModel (with --json: both; default: "
                      "%(default)s)")
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
    serve.add_argument("--max-body-bytes", type=int, default=16 << 20, metavar="N",
                       help="larger request bodies get 413 (default: %(default)s; images "
                       "come as data URLs inside them)")
    serve.add_argument("--allow-image-urls", action="store_true", help="fetch http(s) image "
                       "URLs of requests (default: data URLs only)")
    serve.add_argument("--max-prompt-chars", type=int, default=32_000, metavar="N",
                       help="longer chat prompts get 413 (default: %(default)s)")
    serve.add_argument("--max-tokens", type=int, default=512, metavar="N",
                       help="a chat completion's default max_tokens (default: %(default)s)")
    _add_engine_args(serve)

    mcp = sub.add_parser("mcp", help="an MCP server (stdio or streamable HTTP) on the "
                         "planner, loaded in this process (--model) or at a running serve "
                         "(--url): tools plan, skills")
    planner = mcp.add_mutually_exclusive_group()
    planner.add_argument("--model", metavar="PRESET|DIR|REPO", help=f"{MODEL_HELP}: the "
                         "planner loaded in this process (the options below as serve takes "
                         "them)")
    planner.add_argument("--url", help="a running `flash-planner serve` the tools call, "
                         f"checked at start (the default without --model: {MCP_URL})")
    mcp.add_argument("--api-key", help="the --url server's key (default: "
                     "$FLASH_PLANNER_API_KEY)")
    mcp.add_argument("--skills", metavar="YAML", help="skill catalog of a --model planner "
                     "(default: config/skills.yaml)")
    from .server.mcp_server import add_transport_args

    add_transport_args(mcp)
    _add_engine_args(mcp)
    # over a running ROS node instead: `planner_mcp` (ros/mcp_door.py; the cli never
    # imports the ROS layer)

    catalog = sub.add_parser("catalog", help="the skill catalog as BehaviorTree.CPP sees it: "
                             "its TreeNodesModel (Groot2's palette) or its XSD")
    catalog.add_argument("--skills", metavar="YAML", help="skill catalog (default: "
                         "config/skills.yaml)")
    what = catalog.add_mutually_exclusive_group(required=True)
    what.add_argument("--bt-model", action="store_true", help="the <TreeNodesModel>: each "
                      "skill an Action with typed, described input ports")
    what.add_argument("--xsd", action="store_true", help="the XML Schema BT XML trees given "
                      "to ~/execute are read against (its ports exactly the skill's args)")
    comp = sub.add_parser("compile", help="compile the engine's graphs into the compile "
                          "cache ahead of time (a robot image can ship the cache)")
    comp.add_argument("--model", required=True, metavar="PRESET|DIR|REPO", help=MODEL_HELP)
    comp.add_argument("--compile-cache", metavar="DIR", help="where the compiled graphs go "
                      "(default: $TORCHINDUCTOR_CACHE_DIR, else "
                      "~/.cache/flash_planner/torch_compile)")
    _add_engine_args(comp)
    _add_json_arg(comp)

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
