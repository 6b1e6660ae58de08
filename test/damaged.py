"""Damaged safetensors files for the load-failure tests of every front door (the engine, the
CLI, serve, the node): a file cut short, and one whose header lies about a tensor's size.
Each damage returns the cause the engine must report after the file's path."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

DAMAGES = ("truncated", "lying-header")


def header_of(file: Path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8:8 + length])


def truncate(file: Path, cut: int = 4096) -> str:
    """Cut the last `cut` bytes off `file`; the cause the engine names."""
    length, _ = header_of(file)
    data = file.read_bytes()
    file.write_bytes(data[:-cut])
    whole = len(data) - 8 - length
    return f"truncated: the header says {whole} bytes of tensor data, the file has {whole - cut}"


def lie_about_size(file: Path) -> str:
    """Rewrite the header (its 8-byte length and JSON) so that the first tensor's shape
    claims twice the rows its data_offsets hold; the data is untouched."""
    length, header = header_of(file)
    data = file.read_bytes()[8 + length:]
    name = min((n for n in header if n != "__metadata__"),
               key=lambda n: header[n]["data_offsets"][0])
    header[name]["shape"][0] *= 2
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return f"the header lies about tensor {name}: its data_offsets"


def damage(file: Path, how: str) -> str:
    return truncate(file) if how == "truncated" else lie_about_size(file)


def damaged_demo(path: Path, how: str) -> tuple[Path, str]:
    """A copy of the demo target at `path` with its model.safetensors damaged `how`; the
    copy and the one line the engine must say about it (file path, then cause)."""
    from flash_planner.planning.presets import asset_path

    shutil.copytree(asset_path("@assets/demo/target"), path)
    file = path / "model.safetensors"
    return path, f"{file}: {damage(file, how)}"
