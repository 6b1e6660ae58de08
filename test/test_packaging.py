"""Packaging: the kernels inside the package, the colcon install layout and a plain wheel
install.

The kernels ship only as ``flash_planner.kernels`` (a folder of the package), never as a
top-level ``kernels`` package: Hugging Face ships a package of that name and transformers
probes for it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = "flash_planner"
COPY_IGNORE = (".git", ".venv", "build", "install", "log", "dist", "__pycache__", "*.egg-info")
COPY_IGNORE += (".pytest_cache", ".ruff_cache")

# Prints where flash_planner.kernels and a top-level ``kernels`` (if any) come from.
IMPORT_PROBE = """
import importlib.util, json
import flash_planner.kernels as k
top = importlib.util.find_spec("kernels")
print(json.dumps({"kernels": k.__file__, "top": top.origin if top else None}))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    """Environment for child processes, without Python, ROS or colcon overrides."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "AMENT_PREFIX_PATH", "COLCON_PREFIX_PATH")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def _copy_repo(dest: Path) -> Path:
    """Copy what git would ship (tracked + untracked, not ignored) into ``dest``."""
    if (REPO / ".git").exists() and shutil.which("git"):
        cmd = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, check=True).stdout
        for name in filter(None, out.decode().split("\0")):
            src, dst = REPO / name, dest / name
            if not (src.exists() or src.is_symlink()):
                continue  # deleted in the working tree
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_symlink():
                os.symlink(os.readlink(src), dst)
            elif src.is_file():
                shutil.copy2(src, dst)
    else:
        ignore = shutil.ignore_patterns(*COPY_IGNORE)
        shutil.copytree(REPO, dest, symlinks=True, ignore=ignore)
    assert (dest / PKG / "kernels" / "dispatch.py").is_file(), "flash_planner/kernels was lost"
    return dest


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run a command, capturing text output."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def _within(path: str | Path, root: Path) -> bool:
    """Whether ``path`` (symlinks resolved) lies inside ``root``."""
    return Path(path).resolve().is_relative_to(root.resolve())


def test_kernels_are_a_folder_of_the_package():
    import flash_planner.kernels as kernels

    folder = REPO / PKG / "kernels"
    assert Path(kernels.__file__) == folder / "__init__.py"
    assert folder.is_dir() and not folder.is_symlink() and not (REPO / "kernels").exists()


def test_no_bench_or_test_module_shadows_an_installed_package():
    """The tests put bench/ and test/ first on sys.path (conftest.py): a module there named
    as an installed package's (bench/kernels.py beside Hugging Face's `kernels`, which
    transformers 5.25 requires) is what `import` finds, and transformers fails to load."""
    installed = set(metadata.packages_distributions())
    ours = {f.stem for folder in ("bench", "test") for f in (REPO / folder).glob("*.py")}
    assert not ours & installed, sorted(ours & installed)


def test_setup_packages_have_no_top_level_kernels():
    code = (  # run setup.py with setup() replaced by a printer of its packages
        "import json, runpy, setuptools; "
        "setuptools.setup = lambda **kw: print(json.dumps(kw['packages'])); "
        "runpy.run_path('setup.py')"
    )
    proc = _run([sys.executable, "-c", code], 60, cwd=REPO, env=_clean_env())
    assert proc.returncode == 0, proc.stderr
    packages = json.loads(proc.stdout.strip().splitlines()[-1])
    assert PKG in packages and f"{PKG}.kernels" in packages
    assert not [p for p in packages if not p.startswith(PKG)], packages


def test_installed_distribution_does_not_expose_kernels(tmp_path):
    """Whatever is installed in this interpreter (e.g. ``pip install -e``) hides kernels/: a
    top-level ``kernels`` is none of ours (Hugging Face's, which transformers 5.25 requires,
    lies in the venv's site-packages, and the venv may lie inside the checkout)."""
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)"
    proc = _run([sys.executable, "-c", code], 60, cwd=tmp_path, env=_clean_env())
    assert proc.returncode == 0, proc.stderr
    origin = proc.stdout.strip()
    owners = metadata.packages_distributions().get("kernels", [])
    assert not {d.replace("-", "_").lower() for d in owners} & {PKG}, owners
    assert origin == "None" or not _within(origin, REPO) or _within(origin, Path(sys.prefix)), \
        origin


@pytest.mark.skipif(shutil.which("colcon") is None,
                    reason="colcon executable not found: `make test` installs it")
@pytest.mark.parametrize("symlink_install", [False, True], ids=["plain", "symlink-install"])
def test_colcon_install_layout(tmp_path, symlink_install):
    ws = tmp_path / "ws"
    _copy_repo(ws / "src" / PKG)
    cmd = ["colcon", "build", "--base-paths", f"src/{PKG}"]
    cmd += ["--symlink-install"] if symlink_install else []
    env = _clean_env(COLCON_HOME=str(tmp_path / "colcon_home"))
    proc = _run(cmd, 180, cwd=ws, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    inst = ws / "install" / PKG
    share = inst / "share" / PKG
    for path in (
        share / "launch" / "planner.launch.py",
        share / "config" / "planner.yaml",
        share / "package.xml",
        inst / "share" / "ament_index" / "resource_index" / "packages" / PKG,
        inst / "lib" / PKG / "flash-planner",
    ):
        assert path.exists(), path
    node = inst / "lib" / PKG / "planner_node"
    assert node.is_file() and os.access(node, os.X_OK), node
    models = sorted(p.name for p in (REPO / "config" / "models").glob("*.yaml"))
    assert models and sorted(p.name for p in (share / "config" / "models").iterdir()) == models

    # The PYTHONPATH a user gets from sourcing the workspace (symlink installs add build/).
    script = '. "$1" >/dev/null && printf %s "$PYTHONPATH"'
    proc = _run(["bash", "-c", script, "_", "install/setup.sh"], 60, cwd=ws, env=env)
    assert proc.returncode == 0 and proc.stdout, proc.stdout + proc.stderr
    env["PYTHONPATH"] = proc.stdout
    proc = _run([sys.executable, "-c", IMPORT_PROBE], 60, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    kernels_init = Path(found["kernels"])
    assert _within(kernels_init, ws) and kernels_init.resolve().parent.name == "kernels", found
    if not symlink_install:
        assert _within(kernels_init, inst) and not kernels_init.is_symlink(), found
    assert found["top"] is None or not _within(found["top"], ws), found
    _check_planner_node_without_ros(node, env)


def _check_planner_node_without_ros(node: Path, env: dict[str, str]) -> None:
    """The installed executable exits 2 with one clear line where rclpy is missing."""
    shebang = node.read_text().splitlines()[0].removeprefix("#!").split()
    has_rclpy = _run([*shebang, "-c", "import rclpy"], 60, env=env).returncode == 0
    if has_rclpy:
        return  # a ROS machine: the node would start and spin
    proc = _run([str(node)], 60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rclpy" in lines[0] and "setup.bash" in lines[0], proc.stderr


def _no_build_isolation() -> list[str]:
    """Build offline with this interpreter's setuptools when it can build wheels alone."""
    try:
        major, minor = (int(x) for x in metadata.version("setuptools").split(".")[:2])
    except metadata.PackageNotFoundError:
        return []
    has_wheel = (major, minor) >= (70, 1) or _has_dist("wheel")
    return ["--no-build-isolation"] if has_wheel else []


def _has_dist(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_wheel_ships_kernels_inside_flash_planner(tmp_path):
    src = _copy_repo(tmp_path / "src")
    asset = src / PKG / "assets" / "probe" / "probe.json"
    asset.parent.mkdir(parents=True)
    asset.write_text("{}\n")
    pip = [sys.executable, "-m", "pip"]
    env = _clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [*pip, "wheel", "-q", "--no-deps", *_no_build_isolation(), "-w", str(tmp_path / "w")]
    proc = _run([*cmd, str(src)], 120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "w").glob("flash_planner-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    data = "flash_planner-0.1.0.data/data/share/"
    for name in (
        f"{PKG}/kernels/__init__.py",
        f"{PKG}/ros/node.py",
        f"{PKG}/assets/probe/probe.json",
        f"{data}ament_index/resource_index/packages/{PKG}",
        f"{data}{PKG}/package.xml",
        f"{data}{PKG}/launch/planner.launch.py",
        f"{data}{PKG}/config/planner.yaml",
        f"{data}{PKG}/config/models/qwen3_4b.yaml",
    ):
        assert name in names, name
    assert not [n for n in names if n.startswith("kernels/")]

    target = tmp_path / "target"
    cmd = [*pip, "install", "-q", "--no-deps", "--no-index", "--target", str(target)]
    proc = _run([*cmd, str(wheel)], 120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    init = target / PKG / "kernels" / "__init__.py"
    assert init.is_file() and not init.is_symlink() and not init.parent.is_symlink()
    assert not (target / "kernels").exists()
    (dist_info,) = target.glob("flash_planner-*.dist-info")
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert "flash-planner = flash_planner.cli:main" in entry_points
    assert "planner_node = flash_planner.ros.node:main" in entry_points
