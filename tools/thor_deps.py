"""Can the Thor image install our Python dependencies? A check that needs no Thor.

Thor runs JetPack 7: Ubuntu 24.04 (glibc 2.39), Python 3.12, aarch64. NVIDIA's container
provides torch, triton and TensorRT (and the CUDA libraries); ROS 2 Jazzy comes from apt.
Everything else the runtime imports is pinned, with its whole dependency closure, in
tools/requirements-thor.txt, which the image installs with `pip install --no-deps`.

`python tools/thor_deps.py` (`make thor-deps`, run by `make test`) asks pip to resolve that
file for cp312 / manylinux aarch64 with binary wheels only, as a dry run that installs
nothing (from a registry serving PEP 658 metadata pip reads no wheel at all), then walks each
wheel's own requirements, with markers evaluated for Thor, and checks the file pins every one
of them at a version that satisfies it. A pin with no aarch64 wheel fails with the package's
name; so does a dependency the file forgets.

`--lock` rewrites the file from this machine's environment: ROOTS and their closure on Thor,
at the versions installed here (what the tests ran against).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

HERE = Path(__file__).resolve().parent
LOCK = HERE / "requirements-thor.txt"
# What the runtime imports (setup.py's install_requires but the container's own, and the
# `serve` and `vision` extras: a camera's images are resized by Pillow)
ROOTS = ("transformers", "safetensors", "tokenizers", "pyyaml", "jsonschema", "xgrammar",
         "numpy", "huggingface-hub", "fastapi", "uvicorn", "prometheus-client", "pillow")
# Provided by NVIDIA's JetPack container (or not needed on aarch64); never pip-installed
PROVIDED = re.compile(r"^(torch|triton|tensorrt.*|nvidia-.*|cuda-.*)$")
PYTHON = "3.12"
# manylinux tags a glibc 2.39 aarch64 system accepts (pip takes them as given)
PLATFORMS = [f"manylinux_2_{m}_aarch64" for m in (39, 38, 35, 34, 31, 28, 27, 26, 24, 17)]
PLATFORMS.append("manylinux2014_aarch64")
THOR = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.3", "os_name": "posix",
        "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "aarch64",
        "platform_python_implementation": "CPython", "implementation_name": "cpython",
        "platform_release": "", "platform_version": "", "implementation_version": "3.12.3"}


class DepsError(RuntimeError):
    pass


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            version = next((s.version for s in req.specifier if s.operator == "=="), None)
            if version is None:
                raise DepsError(f"{path.name}: {line!r} is not pinned with ==")
            pins[canonicalize_name(req.name)] = version
    return pins


def applies(req: Requirement, extras: tuple[str, ...] = ("",)) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**THOR, "extra": extra}) for extra in extras)


# (name, version) -> its wheel's entry in pip's report: each pin resolves alone (--no-deps),
# so a process that checks several files asks pip only for the pins it has not seen
_RESOLVED: dict[tuple[str, Version], dict] = {}


def resolve_wheels(pins: dict[str, str]) -> list[dict]:
    """pip's dry-run report entries for exactly these pins, cp312 aarch64, wheels only."""
    wanted = {(name, Version(version)): (name, version) for name, version in pins.items()}
    todo = dict(pin for key, pin in wanted.items() if key not in _RESOLVED)
    if todo:
        for item in _pip_dry_run(todo):
            meta = item["metadata"]
            _RESOLVED[canonicalize_name(meta["name"]), Version(meta["version"])] = item
    missing = [f"{name}=={version}" for key, (name, version) in wanted.items()
               if key not in _RESOLVED]
    if missing:
        raise DepsError("pip's report left out " + ", ".join(missing))
    return [_RESOLVED[key] for key in wanted]


def _pip_dry_run(pins: dict[str, str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="thor-deps-") as tmp:
        reqs = Path(tmp) / "requirements.txt"
        reqs.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
               "--ignore-installed", "--target", str(Path(tmp) / "target"),
               "--python-version", PYTHON, "--implementation", "cp", "--abi", "cp312",
               "--only-binary=:all:", *[f"--platform={p}" for p in PLATFORMS],
               "-r", str(reqs), "--report", str(report), "--quiet"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            missing = re.findall(r"No matching distribution found for (\S+)", done.stderr)
            if missing:
                raise DepsError("no Python 3.12 manylinux aarch64 wheel for "
                                + ", ".join(missing))
            raise DepsError("pip could not resolve the Thor requirements:\n"
                            + done.stderr.strip()[-2000:])
        return json.loads(report.read_text())["install"]


def check(lock: Path = LOCK) -> list[str]:
    """The problems with `lock` for Thor (empty when it installs)."""
    pins = read_lock(lock)
    problems = []
    for item in resolve_wheels(pins):
        meta = item["metadata"]
        for line in meta.get("requires_dist") or []:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            if not applies(req) or PROVIDED.match(name):
                continue
            if name not in pins:
                problems.append(f"{meta['name']} {meta['version']} requires {req}, which "
                                f"{lock.name} does not pin")
            elif not req.specifier.contains(pins[name], prereleases=True):
                problems.append(f"{meta['name']} {meta['version']} requires {req}, but "
                                f"{lock.name} pins {name}=={pins[name]}")
    return problems


def closure() -> dict[str, str]:
    """ROOTS and what they require on Thor, at the versions installed here."""
    pins, todo = {}, list(ROOTS)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in pins or PROVIDED.match(name):
            continue
        dist = metadata.distribution(name)
        pins[name] = dist.version
        todo += [Requirement(r).name for r in dist.requires or [] if applies(Requirement(r))]
    return dict(sorted(pins.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lock", action="store_true", help=f"rewrite {LOCK.name} from here")
    parser.add_argument("--requirements", type=Path, default=LOCK)
    args = parser.parse_args(argv)
    if args.lock:
        lines = [f"{name}=={version}\n" for name, version in closure().items()]
        args.requirements.write_text(
            "# Python dependencies of the Thor image (tools/thor_deps.py --lock; installed with\n"
            "# pip install --no-deps). torch, triton and TensorRT come with NVIDIA's JetPack\n"
            "# container, ROS 2 Jazzy from apt.\n" + "".join(lines))
        print(f"wrote {len(lines)} pins to {args.requirements}")
    try:
        problems = check(args.requirements)
    except DepsError as exc:
        print(f"thor-deps: {exc}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"thor-deps: {problem}", file=sys.stderr)
    if not problems:
        print(f"thor-deps: {len(read_lock(args.requirements))} pinned packages install on "
              f"Python {PYTHON} manylinux aarch64 from wheels, every dependency pinned")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
