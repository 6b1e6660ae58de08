"""The llama-cpp-python source distribution from PyPI, pinned by hash and cached on disk.

It is the one registry package that carries llama.cpp whole: its sources under
`vendor/llama.cpp` (bench/peer.py builds llama-bench from them), its Hugging Face to GGUF
converter, and the real Qwen2/2.5/3 vocabulary (`models/ggml-vocab-qwen2.gguf`, which
`qwen_vocab.py` turns into a Hugging Face tokenizer). Nothing of it is committed here.

The file is found through PyPI's simple index (JSON form, PEP 691), downloaded once into
`cache_home()/llama_cpp/`, checked against the pinned sha256, and unpacked on demand.
`$FLASH_PLANNER_PYPI_SIMPLE` points at another index (a mirror); the hash pin still holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ..engine.config import cache_home

NAME = "llama-cpp-python"
VERSION = "0.3.36"
FILENAME = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
ROOT = f"llama_cpp_python-{VERSION}"          # the archive's top folder
LLAMA_CPP = f"{ROOT}/vendor/llama.cpp"        # llama.cpp's own tree inside it

Progress = Callable[[str], None]


class SourceError(RuntimeError):
    """The source distribution could not be found, downloaded or verified."""


def source_dir() -> Path:
    return cache_home() / "llama_cpp"


def _index_url() -> str:
    base = os.environ.get("FLASH_PLANNER_PYPI_SIMPLE", "https://pypi.org/simple").rstrip("/")
    return f"{base}/{NAME}/"


def _file_url() -> str:
    request = urllib.request.Request(
        _index_url(), headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.loads(response.read())["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise SourceError(f"cannot read the package index {_index_url()}: {exc}") from exc
    for entry in files:
        if entry.get("filename") == FILENAME:
            return entry["url"]
    raise SourceError(f"{_index_url()} does not list {FILENAME}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(progress: Progress | None = None) -> Path:
    """The verified archive, downloaded on first use (77 MB)."""
    say = progress or (lambda line: None)
    target = source_dir() / FILENAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    url = _file_url()
    partial = target.with_suffix(".partial")
    say(f"downloading {FILENAME} from {url}")
    try:
        with urllib.request.urlopen(url, timeout=120) as response, partial.open("wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            done, shown = 0, 0
            for chunk in iter(lambda: response.read(1 << 20), b""):
                out.write(chunk)
                done += len(chunk)
                if total and done * 10 // total > shown:
                    shown = done * 10 // total
                    say(f"  {done >> 20} of {total >> 20} MB")
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise SourceError(f"downloading {url} failed: {exc}") from exc
    got = _sha256(partial)
    if got != SHA256:
        partial.unlink()
        raise SourceError(f"{FILENAME}: sha256 {got} is not the pinned {SHA256}")
    partial.replace(target)
    return target


def _extract(archive: Path, members: list[tarfile.TarInfo], into: Path) -> None:
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):   # 3.10.12+/3.11.4+: refuse links out of `into`
            tar.extractall(into, members=members, filter="data")
        else:
            for member in members:
                if member.name.startswith(("/", "..")) or ".." in Path(member.name).parts:
                    raise SourceError(f"{archive.name}: unsafe member {member.name}")
            tar.extractall(into, members=members)


def unpacked(prefix: str = ROOT, progress: Progress | None = None) -> Path:
    """The archive's members under `prefix`, unpacked once (a stamp file marks a whole
    unpack, so an interrupted one is redone). Returns the unpack root (the folder holding
    `llama_cpp_python-<version>/`)."""
    say = progress or (lambda line: None)
    into = source_dir() / "src"
    stamp = into / (".unpacked-" + hashlib.sha256(prefix.encode()).hexdigest()[:16])
    if stamp.is_file():
        return into
    archive = fetch_sdist(progress)
    say(f"unpacking {prefix} from {archive.name}")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers()
                   if m.name == prefix or m.name.startswith(prefix.rstrip("/") + "/")]
    if not members:
        raise SourceError(f"{archive.name} has nothing under {prefix}")
    if prefix == ROOT and (into / ROOT).exists():
        shutil.rmtree(into / ROOT)
    _extract(archive, members, into)
    stamp.touch()
    return into
