"""Compiled graphs on disk: a warm start reads each graph instead of tracing it again.

Why: inductor's own cache skips code generation on a second start, but dynamo still traces
every graph and AOTAutograd still lowers it (about 1.2 s a graph here, 18 s for the 64-layer
stand-in's 15). torch's AOT compile (`aot_compile` of a fullgraph torch.compile) hands back
the traced function with its compiled code, which serializes whole; read back, it runs
without tracing (about 0.05 s a graph once inductor's cache in the same directory holds its
compiled module; without that module the C++ wrapper is built again, seconds a graph).

An entry's key is everything that decides its code (`entry_key`): the graph function, its
arguments' structure (tensors by shape, stride, dtype and aliasing; modules by their type,
attributes and tensor shapes), the compile options, this package's engine sources, the
torch, Triton and Python versions and the device. The file is named by what the graph is
(function and arguments) and starts with the whole key: a file whose key differs (another
torch, another build, copied from another machine) or that cannot be read is compiled again
and replaced, with one log line, never a crash; an upgrade leaves no stale entry behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAGIC = b"flash_planner compiled graph 1\n"
SUBDIR = "graphs"
# the sources whose change changes a compiled graph's code: the engine (models, their
# layers, the graphs) and the kernels the graphs call
SOURCE_DIRS = ("engine", "kernels")


@lru_cache(maxsize=1)
def source_digest() -> str:
    """A hash of this package's engine and kernel sources (read once per process)."""
    root = Path(__file__).resolve().parents[3]
    digest = hashlib.sha256()
    for sub in SOURCE_DIRS:
        for path in sorted((root / sub).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def device_description(device: torch.device) -> str:
    """What a graph's code is specific to on this device."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return (f"cuda {torch.cuda.get_device_name(index)} sm_{major}{minor} "
                f"CUDA {torch.version.cuda}")
    return f"cpu {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def _plain(value: object) -> bool:
    """Whether an attribute's repr describes its value (not an object's address)."""
    return " at 0x" not in repr(value)


def module_description(module: torch.nn.Module) -> list[object]:
    """A module as its graph sees it: per submodule its type and plain attributes (eps,
    head counts, a config dataclass, a span's tensor slots), per tensor its shape and
    dtype. Not its values: weights are inputs of the graph, never baked into it."""
    out: list[object] = []
    for name, sub in module.named_modules():
        attrs = sorted((k, repr(v)) for k, v in vars(sub).items()
                       if not k.startswith("_") and _plain(v))
        tensors = [(n, tuple(t.shape), str(t.dtype))
                   for n, t in (*sub.named_parameters(recurse=False),
                                *sub.named_buffers(recurse=False))]
        out.append((name, type(sub).__qualname__, attrs, tensors))
    return out


def arguments_description(leaves: list[object], spec: object) -> list[object]:
    """What decides a graph's code among its arguments: their structure, each tensor's
    shape, stride, dtype, device and which earlier leaf is the same tensor, each module's
    `module_description`, every other value as it is."""
    out: list[object] = [repr(spec)]
    first: dict[int, int] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            out.append(("tensor", tuple(x.shape), x.stride(), str(x.dtype), x.device.type,
                        first.setdefault(id(x), i)))
        elif isinstance(x, torch.nn.Module):
            out.append(("module", module_description(x)))
        else:
            out.append(("value", repr(x)))
    return out


def entry_key(name: str, leaves: list[object], spec: object, options: dict[str, object],
              device: torch.device) -> dict[str, str]:
    """The key of one compiled graph: what it is (readable) and the digest of what decides
    its code."""
    arguments = json.dumps(arguments_description(leaves, spec), default=repr)
    return {"graph": name, "torch": torch.__version__, "triton": _triton_version(),
            "python": platform.python_version(), "device": device_description(device),
            "sources": source_digest(), "options": repr(sorted(options.items())),
            "arguments": hashlib.sha256(arguments.encode()).hexdigest()[:32]}


@lru_cache(maxsize=1)
def _unguarded() -> type:
    """torch's AOTCompiledFunction read back without building its guards (about 0.15 s a
    graph, three quarters of reading it): the caller calls it with guard checks off, its
    arguments chosen by the same key the entry was stored under."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    class Unguarded(AOTCompiledFunction):
        def __post_init__(self) -> None:
            self._artifacts.guard_manager = _NO_GUARDS
            super().__post_init__()

    return Unguarded


class _NoGuards:
    """Stands where a graph's guard manager would be; never asked (guard checks are off)."""

    def check(self, f_locals) -> bool:
        raise AssertionError("a stored graph's guards were checked; they were never built")


_NO_GUARDS = _NoGuards()


class GraphStore:
    """Compiled graphs (torch's AOTCompiledFunction) under `<cache dir>/graphs`, one file
    per `entry_key`."""

    def __init__(self, cache_dir: Path):
        self.root = Path(cache_dir) / SUBDIR

    def path(self, key: dict[str, str]) -> Path:
        """Where the graph of `key` lives: by its function and arguments only, so that one
        built for another torch, device or build is found, reported and replaced."""
        what = {k: key[k] for k in ("graph", "arguments")}
        digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]
        safe = "".join(c if c.isalnum() else "_" for c in key["graph"])[:60]
        return self.root / f"{safe}-{digest}.aot"

    def load(self, key: dict[str, str]):
        """The graph stored under `key`, or None: not there, or (logged once) written
        for another key or unreadable."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("compile cache entry %s unreadable (%s); compiling it again", path, exc)
            return None
        try:
            if not data.startswith(MAGIC):
                raise ValueError("not a compiled graph of this format")
            header, _, payload = data[len(MAGIC):].partition(b"\n")
            stored = json.loads(header)
            if stored != key:
                differs = sorted(k for k in set(key) | set(stored)
                                 if stored.get(k) != key.get(k))
                log.warning("compile cache entry %s was written for another %s; compiling "
                            "it again", path, ", ".join(differs))
                return None
            graph = _unguarded().deserialize(payload)
        except Exception as exc:    # truncated, another torch's pickle, a bad header ...
            first_line = (str(exc).splitlines() or [""])[0][:200]
            log.warning("compile cache entry %s could not be read (%s: %s); compiling it "
                        "again", path, type(exc).__name__, first_line)
            return None
        return graph

    def save(self, key: dict[str, str], graph) -> None:
        """Store `graph` under `key` (atomically: a reader never sees half a file); a
        store that cannot be written is logged and the graph still serves."""
        path = self.path(key)
        try:
            payload = type(graph).serialize(graph).serialized_data
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
                tmp.write(MAGIC + json.dumps(key).encode() + b"\n" + payload)
            os.replace(tmp.name, path)
        except Exception as exc:    # a read-only image, a full disk, an unpicklable graph
            log.warning("compiled graph %s not stored in the cache (%s: %s)", key["graph"],
                        type(exc).__name__, exc)

