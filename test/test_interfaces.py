"""The nested ament_cmake package ``flash_planner_interfaces/``, checked without ROS.

The ``.msg``/``.action`` files are read with ``flash_planner.ros.interface_spec`` and must
hold exactly the fields the node fills in; ``package.xml`` must make it a rosidl interface
package; ``colcon list`` must find both packages when both paths are named (colcon stops
descending at the root package, so a plain ``--base-paths <repo>`` finds only one).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from flash_planner.ros.interface_spec import interfaces_dir, read_action, read_fields

REPO = Path(__file__).resolve().parents[1]
IFACE = REPO / "flash_planner_interfaces"
MSG = IFACE / "msg" / "PlanTelemetry.msg"
ACTION = IFACE / "action" / "Plan.action"

TELEMETRY = [
    ("builtin_interfaces/Time", "stamp"),
    ("string", "request_id"),
    ("float64", "queue_wait_ms"),
    ("float64", "ttft_ms"),
    ("float64", "decode_ms"),
    ("float64", "total_latency_ms"),
    ("int32", "prompt_tokens"),
    ("int32", "new_tokens"),
    ("float64", "tokens_per_s"),
    ("int32", "cycles"),
    ("float64", "mean_accepted_length"),
    ("float64", "tokens_per_cycle"),
    ("float64", "draft_ms_per_cycle"),
    ("float64", "verify_ms_per_cycle"),
    ("float64", "first_step_ms"),
    ("bool", "prefix_hit"),
    ("int32", "prefix_tokens"),
    ("float64", "prefix_restore_ms"),
    ("int32", "images"),
    ("int32", "image_tokens"),
    ("float64", "vision_ms"),
    ("float64", "image_age_ms"),
    ("string", "finish_reason"),
]
PLAN = {
    "goal": [
        ("string", "task"),
        ("string", "context"),
        ("string[]", "scene"),
        ("sensor_msgs/Image[]", "images"),
        ("int32", "max_new_tokens"),
        ("bool", "enable_thinking"),
        ("string", "sampling"),
        ("int64", "seed"),
    ],
    "result": [
        ("bool", "success"),
        ("string", "plan_json"),
        ("string", "bt_xml"),
        ("string", "error"),
        ("string", "raw_text"),
        ("PlanTelemetry", "telemetry"),  # same package: rosidl resolves the bare name
    ],
    "feedback": [
        ("string", "delta_text"),
        ("int32", "tokens_so_far"),
        ("float32", "tokens_per_s"),
        ("float32", "mean_accepted_length"),
        ("int32[]", "step_indices"),
        ("string[]", "steps_json"),
    ],
}

# rosidl_adapter's rules (parser.py): primitive types, field names, message names.
PRIMITIVES = set(
    "bool byte char float32 float64 int8 uint8 int16 uint16 int32 uint32 int64 uint64"
    " string wstring".split()
)
FIELD_NAME = re.compile(r"^(?!.*__)(?!.*_$)[a-z][a-z0-9_]*$")
TYPE_NAME = re.compile(r"^(?:[a-z](?:[a-z0-9_]*[a-z0-9])?/)?[A-Z][A-Za-z0-9]*$")


def action_fields() -> dict[str, list[str]]:
    """Field names of each section of Plan.action: {"goal": [...], "result": [...], ...}."""
    sections = read_action(ACTION)
    return {section: [name for _, name in fields] for section, fields in sections.items()}


def _check_rosidl_names(fields: list[tuple[str, str]]) -> None:
    for type_, name in fields:
        assert FIELD_NAME.match(name), f"{name!r} is not a valid rosidl field name"
        base = type_.removesuffix("[]")
        assert base in PRIMITIVES or TYPE_NAME.match(base), f"{type_!r} is not a valid type"


def test_interfaces_dir_is_found_in_the_source_tree():
    assert interfaces_dir() == IFACE.resolve()


def test_plan_telemetry_fields():
    fields = read_fields(MSG)
    assert fields == TELEMETRY
    _check_rosidl_names(fields)


def test_plan_telemetry_groups_are_commented():
    """Every blank-line-separated group of fields starts with a comment line (units)."""
    blocks = [b.strip().splitlines() for b in MSG.read_text().split("\n\n") if b.strip()]
    for block in blocks:
        assert block[0].startswith("#"), block


def test_plan_action_sections_and_fields():
    sections = read_action(ACTION)
    assert list(sections) == ["goal", "result", "feedback"]
    assert sections == PLAN
    for fields in sections.values():
        _check_rosidl_names(fields)
    assert action_fields()["result"] == ["success", "plan_json", "bt_xml", "error", "raw_text",
                                         "telemetry"]
    assert "0 = the node's default" in ACTION.read_text()


def test_parser_rejects_wrong_section_counts(tmp_path):
    bad = tmp_path / "Bad.action"
    bad.write_text("string a\n---\nstring b\n")
    with pytest.raises(ValueError, match="3 sections"):
        read_action(bad)
    with pytest.raises(ValueError, match="one section"):
        read_fields(bad)
    const = tmp_path / "Const.msg"
    const.write_text('# c\nint32 LIMIT=3  # constant\nint32 x 7\nstring s "a # b"\n')
    assert read_fields(const) == [("int32", "x"), ("string", "s")]


def test_cmakelists_generates_exactly_the_interface_files():
    text = (IFACE / "CMakeLists.txt").read_text()
    listed = set(re.findall(r'"((?:msg|srv|action)/[^"]+)"', text))
    on_disk = {
        p.relative_to(IFACE).as_posix()
        for sub in ("msg", "srv", "action")
        for p in (IFACE / sub).glob("*")
        if p.suffix in (".msg", ".srv", ".action")
    }
    assert listed == on_disk == {"msg/PlanTelemetry.msg", "action/Plan.action",
                                 "action/ExecutePlan.action", "srv/Approve.srv",
                                 "srv/CancelExecution.srv"}
    for needle in (
        "find_package(ament_cmake REQUIRED)",
        "find_package(rosidl_default_generators REQUIRED)",
        "find_package(builtin_interfaces REQUIRED)",
        "find_package(sensor_msgs REQUIRED)",
        "rosidl_generate_interfaces(${PROJECT_NAME}",
        "DEPENDENCIES builtin_interfaces sensor_msgs",
        "ament_export_dependencies(rosidl_default_runtime)",
        "ament_package()",
    ):
        assert needle in text, needle


def _package_xml(path: Path) -> dict[str, object]:
    """Name, version, format, build type, groups and dependencies of a package.xml."""
    try:
        from catkin_pkg.package import parse_package
    except ImportError:
        parse_package = None
    if parse_package is not None:
        pkg = parse_package(str(path))
        both = {d.name for d in pkg.build_depends} & {d.name for d in pkg.exec_depends}
        return {
            "name": pkg.name,
            "version": pkg.version,
            "format": pkg.package_format,
            "licenses": [str(lic) for lic in pkg.licenses],
            "build_type": pkg.get_build_type(),
            "groups": [g.name for g in pkg.member_of_groups],
            "buildtool_depend": [d.name for d in pkg.buildtool_depends],
            "depend": sorted(both),
            "exec_depend": [d.name for d in pkg.exec_depends],
            "test_depend": [d.name for d in pkg.test_depends],
        }
    root = ET.parse(path).getroot()

    def texts(tag: str) -> list[str]:
        return [(e.text or "").strip() for e in root.findall(tag)]

    depend = texts("depend")
    return {
        "name": root.findtext("name"),
        "version": root.findtext("version"),
        "format": int(root.get("format", "1")),
        "licenses": texts("license"),
        "build_type": root.findtext("export/build_type"),
        "groups": texts("member_of_group"),
        "buildtool_depend": texts("buildtool_depend"),
        "depend": sorted(depend),
        "exec_depend": depend + texts("exec_depend"),
        "test_depend": depend + texts("test_depend"),
    }


def test_package_xml_declares_an_interface_package():
    pkg = _package_xml(IFACE / "package.xml")
    assert pkg["name"] == "flash_planner_interfaces"
    assert pkg["version"] == "0.1.0"
    assert pkg["format"] == 3
    assert pkg["licenses"] == ["Apache-2.0"]
    assert pkg["build_type"] == "ament_cmake"
    assert pkg["groups"] == ["rosidl_interface_packages"]
    assert pkg["buildtool_depend"] == ["ament_cmake", "rosidl_default_generators"]
    assert pkg["depend"] == ["builtin_interfaces", "sensor_msgs"]
    assert "rosidl_default_runtime" in pkg["exec_depend"]
    assert "ament_lint_auto" in pkg["test_depend"]
    # The Python package depends on it at run time.
    assert "flash_planner_interfaces" in _package_xml(REPO / "package.xml")["exec_depend"]


@pytest.mark.skipif(shutil.which("colcon") is None,
                    reason="colcon executable not found: `make test` installs it")
def test_colcon_lists_both_packages(tmp_path):
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "AMENT_PREFIX_PATH", "COLCON_PREFIX_PATH")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["COLCON_HOME"] = str(tmp_path / "colcon_home")  # no user defaults
    cmd = ["colcon", "--log-base", str(tmp_path / "log"), "list", "--base-paths"]
    cmd += [str(REPO), str(IFACE)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = {}
    for line in proc.stdout.splitlines():
        name, path, kind = line.split("\t")
        found[name] = (Path(path).resolve(), kind)
    assert found == {
        "flash_planner": (REPO.resolve(), "(ros.ament_python)"),
        "flash_planner_interfaces": (IFACE.resolve(), "(ros.ament_cmake)"),
    }, proc.stdout


def test_execute_plan_fields_are_what_the_execute_server_fills():
    """Every key execute_server writes is a field of ExecutePlan.action, and every field of
    its result and feedback is written (a field the server forgot would stay at its zero)."""
    from flash_planner.planning.execution import ExecutionResult, StepEvent
    from flash_planner.ros.execute_server import feedback_fields, result_fields

    sections = read_action(IFACE / "action" / "ExecutePlan.action")
    for fields in sections.values():
        _check_rosidl_names(fields)
    names = {part: [name for _, name in fields] for part, fields in sections.items()}
    assert names["goal"] == ["task", "context", "scene", "plan_json", "dry_run", "max_replans"]
    assert list(result_fields(ExecutionResult())) == names["result"]
    assert list(feedback_fields("e", StepEvent(0, 0, "say", "sent"))) == names["feedback"]
    request, response = (IFACE / "srv" / "Approve.srv").read_text().split("---")
    assert "string execution_id" in request and "bool approve" in request
    assert "int32 plan_index" in request
    assert "bool accepted" in response and "string message" in response
