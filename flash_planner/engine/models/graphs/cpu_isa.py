"""The CPU vector ISAs inductor compiles for, probed once per machine and kept on record.

Why: before a process compiles or reads its first CPU graph, inductor checks each vector ISA
the CPU's flags name by building a test library and loading it in a new Python process:
1.4 s here for 4 ISAs, more than reading the demo's 29 graphs. The answer depends on the
CPU, the C++ compiler and torch, not on the process. The first start records it beside the
compiled graphs; a later start whose record matches this machine and says every ISA the
flags name passed tells inductor so (`cpp.vec_isa_ok`), which picks the ISA the probe
picked, and skips the probe. A record that does not match (another compiler, another torch,
an ISA that failed) changes nothing: inductor probes as it always does.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

RECORD = Path("graphs") / "cpu_vec_isa.json"


def _x86() -> bool:
    # elsewhere inductor's ISA list does not come from the flags alone
    return platform.machine() in ("x86_64", "AMD64")


def _machine() -> dict[str, object]:
    """What the probe's answer depends on: torch, the CPU's ISA flags, the compiler."""
    from torch._inductor.cpu_vec_isa import x86_isa_checker

    name = os.environ.get("CXX", "g++")
    found = shutil.which(name)
    compiler = name
    if found is not None:
        real = os.path.realpath(found)
        stat = os.stat(real)
        compiler = f"{real} {stat.st_size} {stat.st_mtime_ns}"
    return {"torch": torch.__version__, "flags": x86_isa_checker(), "compiler": compiler}


def _named_by_flags() -> list[str]:
    """The ISAs inductor takes as usable when told the flags are enough (vec_isa_ok)."""
    from torch._inductor.cpu_vec_isa import supported_vec_isa_list, x86_isa_checker

    flags = x86_isa_checker()
    return [str(isa) for isa in supported_vec_isa_list
            if all(flag in flags for flag in str(isa).split())]


def trust_recorded_probe(cache_dir: Path) -> bool:
    """Before a process's first CPU graph: skip inductor's probe where the record in
    `cache_dir` matches this machine and every ISA the flags name passed it (nothing
    changes where someone set vec_isa_ok). -> whether the probe is skipped."""
    from torch._inductor import config

    if not _x86() or config.cpp.vec_isa_ok is not None:
        return False
    try:
        record = json.loads((Path(cache_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return False
    if record != {"machine": _machine(), "valid": _named_by_flags()}:
        return False
    config.cpp.vec_isa_ok = True
    return True


def record_probe(cache_dir: Path) -> None:
    """After graphs were compiled or read with inductor's probe: its answer on record for
    the next start (a record that cannot be written is logged; the next start probes)."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    if (not _x86() or config.cpp.vec_isa_ok is not None
            or valid_vec_isa_list.cache_info().currsize == 0):      # no probe ran
        return
    record = {"machine": _machine(), "valid": [str(isa) for isa in valid_vec_isa_list()]}
    path = Path(cache_dir) / RECORD
    try:
        if path.is_file() and json.loads(path.read_text()) == record:
            return
    except (OSError, ValueError):
        pass                       # unreadable: written again below
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as tmp:
            json.dump(record, tmp)
        os.replace(tmp.name, path)
    except OSError as exc:
        log.warning("the CPU's vector ISAs not recorded in %s (%s); the next start probes "
                    "them again", path, exc)
