"""Ours against llama.cpp, side by side in one run: plain greedy decode and prefill on CPU.

llama.cpp is what a user would run instead of us on a CPU or a Jetson. It is built here
from the llama-cpp-python source distribution on PyPI (pinned by hash,
`flash_planner/train/llama_cpp_sdist.py`): cmake builds its library once into
`~/.cache/flash_planner/llama_cpp/build` (about 3 minutes on 2 cores; later runs reuse it),
and `bench/peer_greedy.cpp` (ours) drives it through llama.cpp's C API. Its own converter
(`convert_hf_to_gguf.py`, with its own gguf-py) turns each benchmark checkpoint into an
fp32 GGUF. The checkpoints carry the real Qwen vocabulary (the converter accepts only
tokenizers it knows; `qwen_vocab.py`) and Qwen-shaped GDN heads (key dim = value dim, as
llama.cpp requires).

Per shape, on the same fp32 weights and one thread each (`--threads`): the greedy tokens of
both engines are compared first (the same ids, or the first divergence with both engines'
logit margins at that step, and the row is marked), then timed: decode ms per token (the
mean over the tokens after the first) and prefill tokens/s (a 128-token prompt to the first
token), medians over `--rounds` rounds in which the engines take turns (`--repeats` runs
each, after a warm-up). Ours runs eager and compiled (`EngineConfig.compile`, warm-up not
timed). The Qwen-vocabulary rows pay the 151,936-row output head, which dominates the tiny
widths in both engines; the small-vocabulary rows (`smallN`, 384 rows, converted through
`peer_convert.py`) show each engine's per-token floor. The per-layer slope between depths 4
and 64 is printed for both.

    python bench/peer.py [--shapes small4 hybrid4 ...] [--threads 1] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from flash_planner.train import llama_cpp_sdist  # noqa: E402

# Only the library our tool links; static, so the tool does not depend on where it is.
LIBRARY_ONLY = ("-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_COMMON=OFF")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", *LIBRARY_ONLY)
# The tests need a llama.cpp that decodes our checkpoints, not a fast one: -O1 and no
# llamafile GEMMs build in 60% of the Release build's compile time (206 s against 351 on one
# core of a 2-core machine). Timings (main()) always use the Release build.
CHECK_FLAGS = ("-DCMAKE_BUILD_TYPE=None", "-DCMAKE_C_FLAGS=-O1", "-DCMAKE_CXX_FLAGS=-O1",
               "-DGGML_LLAMAFILE=OFF", *LIBRARY_ONLY)
TOOL_SOURCE = HERE / "peer_greedy.cpp"
# name: (kind, size, depth, vocabulary); hidden 64 ("tiny") leaves host work per layer as
# the cost. "qwen": the real 151,936-row vocabulary, whose output head dominates a tiny
# model's step in both engines; "small": the tiny checkpoints' own 384 rows, so that each
# engine's per-token floor (dispatch, graph calls, the loop) shows.
SHAPES = {
    "hybrid4": ("hybrid", "tiny", 4, "qwen"),
    "hybrid40": ("hybrid", "tiny", 40, "qwen"),
    "hybrid64": ("hybrid", "tiny", 64, "qwen"),
    "wide16": ("hybrid", "bench", 16, "qwen"),
    "moe40": ("hybrid_moe", "tiny", 40, "qwen"),
    "small4": ("hybrid", "tiny", 4, "small"),
    "small64": ("hybrid", "tiny", 64, "small"),
}
# 16 ordinary ids for the decode prompt, 128 for the prefill one
PROMPTS = {"qwen": (list(range(1000, 1016)), list(range(2000, 2128))),
           "small": (list(range(100, 116)), [50 + i % 300 for i in range(128)])}


class PeerError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run(cmd: list[str], what: str, progress=log, env: dict | None = None) -> str:
    """Run a build or convert step; its output is shown only when it fails (build steps
    report cmake's percentage as they go)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines, shown = [], -10
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[") and "%]" in line[:7]:
            pct = int(line[1:line.index("%")])
            if pct >= shown + 10:
                shown = pct
                progress(f"  {what}: {pct}%")
    if proc.wait() != 0:
        raise PeerError(f"{what} failed ({' '.join(cmd[:3])} ...):\n" + "".join(lines[-40:]))
    return "".join(lines)


def build_dir(flags: tuple[str, ...] = CMAKE_FLAGS) -> Path:
    digest = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:12]
    return llama_cpp_sdist.source_dir() / f"build-{llama_cpp_sdist.VERSION}-{digest}"


def tool_path(flags: tuple[str, ...] = CMAKE_FLAGS) -> Path:
    digest = hashlib.sha256(TOOL_SOURCE.read_bytes()).hexdigest()[:12]
    return build_dir(flags) / f"peer_greedy-{digest}"


def llama_cpp_tree(progress=log) -> Path:
    root = llama_cpp_sdist.unpacked(llama_cpp_sdist.ROOT, progress)
    return root / llama_cpp_sdist.LLAMA_CPP


def build(progress=log, flags: tuple[str, ...] = CMAKE_FLAGS) -> Path:
    """llama.cpp's library (cmake, once per set of flags) and our greedy tool linked to it;
    returns the tool."""
    tool = tool_path(flags)
    if tool.is_file():
        return tool
    tree, out = llama_cpp_tree(progress), build_dir(flags)
    libs = [out / "src" / "libllama.a", out / "ggml" / "src" / "libggml.a",
            out / "ggml" / "src" / "libggml-cpu.a", out / "ggml" / "src" / "libggml-base.a"]
    if not all(lib.is_file() for lib in libs):
        t0 = time.perf_counter()
        progress(f"building llama.cpp ({llama_cpp_sdist.FILENAME}) into {out}")
        _run(["cmake", "-S", str(tree), "-B", str(out), *flags], "cmake configure",
             progress)
        _run(["cmake", "--build", str(out), "--target", "llama", "-j", str(os.cpu_count())],
             "cmake build", progress)
        progress(f"  built in {time.perf_counter() - t0:.0f} s")
    _run(["g++", "-O2", "-std=c++17", f"-I{tree / 'include'}", f"-I{tree / 'ggml/include'}",
          str(TOOL_SOURCE), "-o", str(tool), *map(str, libs), "-fopenmp", "-lpthread"],
         "compile peer_greedy", progress)
    return tool


def convert(checkpoint: Path, out: Path, progress=log, known_tokenizer: bool = True) -> Path:
    """An fp32 GGUF of `checkpoint` by llama.cpp's own converter (MTP layers kept when the
    checkpoint has them). known_tokenizer=False: a tokenizer the converter has no entry
    for (the tiny checkpoints' small one) goes through `peer_convert.py`."""
    tree = llama_cpp_tree(progress)
    config = json.loads((checkpoint / "config.json").read_text())
    mtp = (config.get("text_config") or config).get("mtp_num_hidden_layers", 0)
    env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"))
    script = ([str(tree / "convert_hf_to_gguf.py")] if known_tokenizer
              else [str(HERE / "peer_convert.py"), str(tree)])
    _run([sys.executable, *script, str(checkpoint), "--outtype", "f32", "--outfile",
          str(out), *([] if mtp else ["--no-mtp"])], f"convert {checkpoint.name}", progress,
         env=env)
    return out


def theirs(tool: Path, gguf: Path, prompt: list[int], n: int, repeats: int,
           threads: int) -> dict:
    cmd = [str(tool), str(gguf), str(threads), str(n), str(repeats),
           ",".join(map(str, prompt))]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerError(f"llama.cpp on {gguf.name} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def ours(engine, prompt: list[int], n: int, repeats: int) -> dict:
    from flash_planner.engine.generate import GenerationSettings, generate

    runs = []
    for _ in range(repeats + 1):                          # the first run warms up
        result = generate(engine, prompt, GenerationSettings(max_new_tokens=n,
                                                             ignore_eos=True))
        runs.append(result)
    tokens = [list(r.token_ids) for r in runs]
    if any(t != tokens[0] for t in tokens):
        raise PeerError("our engine gave different tokens on repeated runs")
    return {"tokens": tokens[0],
            "prefill_ms": [r.stats.ttft_ms for r in runs[1:]],
            "decode_ms_per_token": [r.stats.decode_ms / max(1, r.stats.new_tokens - 1)
                                    for r in runs[1:]]}


def our_margin(engine, ids: list[int], token: int) -> tuple[int, float]:
    """Our greedy token after `ids` and how far its logit is above `token`'s."""
    from flash_planner.engine.generate import prefill

    engine.state.reset()
    logits, _ = prefill(engine, ids)
    engine.state.reset()
    best = int(logits.argmax())
    return best, float(logits[best] - logits[token])


def agreement(engine, prompt: list[int], mine: list[int], peer: dict) -> dict:
    """Same greedy ids, or where they part and how close each engine was to a tie there."""
    for at, (a, b) in enumerate(zip(mine, peer["tokens"])):
        if a != b:
            _, margin = our_margin(engine, prompt + mine[:at], b)
            return {"agree": False, "at": at, "ours": a, "theirs": b,
                    "our_margin": margin, "their_margin": peer["margins"][at]}
    return {"agree": True, "tokens": len(mine), "min_margin": min(peer["margins"])}


def load_engine(path: Path, compile: str):
    from flash_planner.engine.engine import Engine, EngineConfig

    return Engine.load(EngineConfig(model_path=str(path), device="cpu", dtype="fp32",
                                    max_context=512, method="none", compile=compile,
                                    max_block=2, mtp_steps=1))   # compile buckets 1 and 2


def checkpoint(name: str, workdir: Path) -> Path:
    from flash_planner.train.tiny import write_tiny_checkpoint

    kind, size, depth, vocab = SHAPES[name]
    return write_tiny_checkpoint(workdir / name, kind=kind, size=size, layers=depth,
                                 attention_every=4, init=0.25 if size == "tiny" else None,
                                 qwen_vocab=vocab == "qwen")


def bench_shape(name: str, tool: Path, workdir: Path, args) -> dict:
    """One shape: the three engines' greedy tokens checked, then timed in `args.rounds`
    rounds of llama.cpp, ours eager, ours compiled (each `args.repeats` runs), so that a
    shared machine's slow minutes fall on all three alike; medians over every run."""
    kind, size, depth, vocab = SHAPES[name]
    prompt, prefill = PROMPTS[vocab]
    path = checkpoint(name, workdir)
    gguf = convert(path, workdir / f"{name}.gguf", known_tokenizer=vocab == "qwen")
    engines = {}
    for mode, label in (("off", "eager"), ("on", "compiled")):
        log(f"{name}: loading ours, {label}")
        engines[label] = load_engine(path, mode)
    runs = {who: {"decode": [], "prefill": []} for who in ("llama_cpp", *engines)}
    tokens = {}
    for r in range(args.rounds):
        log(f"{name}: round {r + 1}/{args.rounds}")
        decode = theirs(tool, gguf, prompt, args.new_tokens, args.repeats, args.threads)
        first = theirs(tool, gguf, prefill, 1, args.repeats, args.threads)
        runs["llama_cpp"]["decode"] += decode["decode_ms_per_token"]
        runs["llama_cpp"]["prefill"] += first["prefill_ms"]
        tokens["llama_cpp"] = decode
        for label, engine in engines.items():
            mine = ours(engine, prompt, args.new_tokens, args.repeats)
            runs[label]["decode"] += mine["decode_ms_per_token"]
            runs[label]["prefill"] += ours(engine, prefill, 1, args.repeats)["prefill_ms"]
            tokens[label] = mine["tokens"]
    row = {"shape": name, "kind": kind, "size": size, "depth": depth, "vocab": vocab}
    for who, timed in runs.items():
        row[who] = {"decode_ms": statistics.median(timed["decode"]),
                    "prefill_tok_s": len(prefill) * 1000 / statistics.median(timed["prefill"])}
        if who in engines:
            row[who]["agreement"] = agreement(engines[who], prompt, tokens[who],
                                              tokens["llama_cpp"])
    log(f"{name}: {json.dumps(row)}")
    return row


def print_report(report: dict) -> None:
    print(f"plain greedy decode and prefill, ours against llama.cpp "
          f"{report['llama_cpp']}, {report['threads']} thread(s), fp32 weights "
          f"({report['new_tokens']} new tokens after a 16-token prompt; prefill: 128 "
          f"tokens; medians of {report['rounds']} rounds x {report['repeats']} runs each, "
          f"the engines taking turns)")
    head = (f"{'shape':<10}{'layers':>7}{'vocab':>8}{'llama.cpp':>11}{'eager':>9}{'x':>7}"
            f"{'compiled':>10}{'x':>7}{'llama.cpp':>12}{'eager':>9}{'compiled':>10}"
            f"{'agree':>7}")
    print(f"{'':<25}{' decode ms per token ':-^54}{' prefill tok/s ':-^31}\n{head}\n"
          + "-" * len(head))
    for r in report["rows"]:
        peer, eager, comp = r["llama_cpp"], r["eager"], r["compiled"]
        agree = all(r[m]["agreement"]["agree"] for m in ("eager", "compiled"))
        vocab = "151936" if r["vocab"] == "qwen" else "384"
        print(f"{r['shape']:<10}{r['depth']:>7}{vocab:>8}{peer['decode_ms']:>11.2f}"
              f"{eager['decode_ms']:>9.2f}{eager['decode_ms'] / peer['decode_ms']:>6.1f}x"
              f"{comp['decode_ms']:>10.2f}{comp['decode_ms'] / peer['decode_ms']:>6.1f}x"
              f"{peer['prefill_tok_s']:>12.0f}{eager['prefill_tok_s']:>9.0f}"
              f"{comp['prefill_tok_s']:>10.0f}{'yes' if agree else 'NO':>7}")
    for vocab in ("qwen", "small"):
        by_depth = {r["depth"]: r for r in report["rows"]
                    if r["kind"] == "hybrid" and r["size"] == "tiny" and r["vocab"] == vocab}
        if 4 in by_depth and 64 in by_depth:
            slope = {who: (by_depth[64][who]["decode_ms"] - by_depth[4][who]["decode_ms"])
                     / 60 * 1000 for who in ("llama_cpp", "eager", "compiled")}
            print(f"decode cost per added layer (depth 4 -> 64, hidden 64, {vocab} "
                  "vocabulary): " + ", ".join(f"{who.replace('_', '.')} {us:.0f} us"
                                              for who, us in slope.items()))
    for r in report["rows"]:
        for mode in ("eager", "compiled"):
            a = r[mode]["agreement"]
            if not a["agree"]:
                print(f"{r['shape']} ({mode}): tokens part at {a['at']}: ours {a['ours']} "
                      f"(ahead of llama.cpp's by {a['our_margin']:.3g} in our logits), "
                      f"llama.cpp {a['theirs']} (margin {a['their_margin']:.3g} in its own)")


def llama_cpp_version() -> str:
    head = llama_cpp_tree().parent.parent / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    commit = head.read_text().strip()[:9] if head.is_file() else "unknown commit"
    return f"{commit} (llama-cpp-python {llama_cpp_sdist.VERSION})"


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="turns the three engines take (medians over all of them)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--png-dir", type=Path, default=None,
                        help="write the chart there (make bench-peer: docs/img)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tool = build()
    with tempfile.TemporaryDirectory(prefix="fp-peer-") as tmp:
        rows = [bench_shape(name, tool, Path(tmp), args) for name in args.shapes]
    report = {"llama_cpp": llama_cpp_version(), "threads": args.threads,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "rounds": args.rounds,
              "rows": rows,
              "wall_s": time.perf_counter() - t0}
    if args.png_dir is not None:
        from charts import grouped_bars

        shapes = [r["shape"] for r in rows]
        print(grouped_bars(args.png_dir / "peer_decode.png",
                           f"greedy decode ms per token, ours against llama.cpp "
                           f"({args.threads} thread, fp32)", shapes,
                           {"llama.cpp": [r["llama_cpp"]["decode_ms"] for r in rows],
                            "ours eager": [r["eager"]["decode_ms"] for r in rows],
                            "ours compiled": [r["compiled"]["decode_ms"] for r in rows]},
                           "ms per token (lower is better)", "bench/peer.py; hybridN = N "
                           "layers at hidden 64 (Qwen vocabulary), smallN the same with 384 "
                           "tokens, wide16 = hidden 640, moe40 = 40 MoE layers; tokens "
                           "checked equal first", "{:.1f}"))
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
        print(f"wall time {report['wall_s']:.0f} s")
    return 0 if all(r[m]["agreement"]["agree"] for r in rows for m in ("eager", "compiled")) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
