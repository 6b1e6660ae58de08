"""A safetensors file's header, read and checked against the file's size, in plain words.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape, data_offsets into the data that follows, plus an optional `__metadata__`), then
the tensors' bytes, back to back. safetensors refuses a file whose header and size disagree,
but says only "incomplete metadata, file not fully covered"; `problem` reads the header
(cheap: a stat and the header's bytes, never the data) and says what is wrong: cut short and
by how much, a header that is not JSON, a tensor whose data_offsets do not hold its dtype x
shape. Messages are of the form `truncated: the header says 1234 bytes of tensor data, the
file has 1000`; callers put the file's path in front.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

# bits per element of each safetensors dtype (F4 and F6 are packed below a byte)
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4,
    "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
    "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}
MAX_HEADER_BYTES = 100_000_000     # safetensors' own limit on the JSON header


def problem(path: Path) -> str | None:
    """What is wrong with the safetensors file `path`, in plain words; None when its header
    parses and its tensors exactly cover the file."""
    try:
        return _parse(path)[0]
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"


def read_header(path: Path, error: type[Exception]) -> tuple[int, dict[str, dict]]:
    """(the byte where the tensor data starts, tensor name -> its header entry) of the
    checked file; raises `error` naming the file and what is wrong with it."""
    try:
        why, start, tensors = _parse(path)
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    if why is not None:
        raise error(f"{path}: {why}")
    return start, tensors


def _parse(path: Path) -> tuple[str | None, int, dict[str, dict]]:
    """(the problem or None, data start, tensors); OSError when the file cannot be read."""
    size = path.stat().st_size
    if size < 8:
        return (f"truncated: {size} byte{'' if size == 1 else 's'}, too short for a "
                "safetensors file (an 8-byte header length comes first)"), 0, {}
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES:
            return (f"not a safetensors file: its first 8 bytes give a header of {length} "
                    f"bytes, over safetensors' limit of {MAX_HEADER_BYTES}"), 0, {}
        if 8 + length > size:
            return (f"truncated inside its header: the header length says {length} bytes, "
                    f"the file has {size - 8} after it"), 0, {}
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except UnicodeDecodeError:
        return "corrupt header: it is not UTF-8 text", 0, {}
    except json.JSONDecodeError as exc:
        return f"corrupt header: not valid JSON ({exc.msg} at byte {exc.pos})", 0, {}
    if not isinstance(header, dict):
        return (f"corrupt header: a JSON {type(header).__name__}, not an object of "
                "tensors"), 0, {}
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    why = _tensors_problem(tensors, size - 8 - length)
    return why, 8 + length, tensors


def _tensors_problem(tensors: dict, data_bytes: int) -> str | None:
    """Whether the tensors' entries are well formed, each holds its dtype x shape, and
    together they cover the `data_bytes` after the header exactly, back to back."""
    spans = []
    for name, entry in tensors.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (_ints(offsets) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1]
                and _ints(shape) and all(d >= 0 for d in shape)
                and isinstance(entry.get("dtype"), str)):
            return (f"corrupt header: tensor {name} has no valid dtype, shape and "
                    f"data_offsets ({json.dumps(entry)[:120]})")
        bits = DTYPE_BITS.get(entry.get("dtype"))
        held = offsets[1] - offsets[0]
        need = math.prod(shape) * bits if bits is not None else held * 8     # in bits
        if need != held * 8:
            return (f"the header lies about tensor {name}: its data_offsets {offsets} hold "
                    f"{held} bytes, its dtype {entry['dtype']} x shape {shape} needs "
                    f"{need // 8 if need % 8 == 0 else need / 8}")
        spans.append((offsets[0], offsets[1], name))
    end, before = 0, None
    for begin, stop, name in sorted(spans):
        if begin != end:
            after = f"tensor {before} ends at byte {end}" if before else "the data starts at 0"
            return (f"corrupt header: the data_offsets of tensor {name} start at byte "
                    f"{begin}, where {after} (tensors follow each other)")
        end, before = stop, name
    if end > data_bytes:
        first_cut = next(name for _, stop, name in sorted(spans) if stop > data_bytes)
        return (f"truncated: the header says {end} bytes of tensor data, the file has "
                f"{data_bytes} (from tensor {first_cut} on, the data is missing)")
    if end < data_bytes:
        return (f"longer than its header says: the header says {end} bytes of tensor data, "
                f"the file has {data_bytes}")
    return None


def _ints(value) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)
