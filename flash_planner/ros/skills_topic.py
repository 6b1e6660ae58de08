"""`~/skills` (latched `std_msgs/String`): the node's skill catalog as it loaded it, so that a
client showing the robot's skills (planner_mcp's `skills` tool) shows the node's own, never
a file of its own that may differ.

The message is JSON: `tools`, the catalog as OpenAI function tools (what `/v1/skills` lists
with no scene), and `skills`, the catalog's skills in its file's own shape (name,
description, args; bindings left out), from which `catalog_of` rebuilds them, so a client
holds a scene's names as the node's grammar does (`skill_tools(catalog_of(text), scene)`).
rclpy is imported by `SkillsTopic` only.
"""

from __future__ import annotations

import json
from typing import Any

from ..planning.skill_tools import skill_tools
from ..planning.skills import Argument, SkillCatalog


def latched_qos():
    """Reliable and transient local: a client that subscribes late gets the catalog."""
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

    return QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                      durability=DurabilityPolicy.TRANSIENT_LOCAL)


def _arg_spec(arg: Argument) -> dict[str, Any]:
    """An argument as the catalog file writes it (the keys `skills._argument` reads back)."""
    spec: dict[str, Any] = {"type": arg.type, "description": arg.description,
                            **dict(arg.constraints)}
    if arg.grounded:
        spec["grounded"] = arg.grounded
    if not arg.required:
        spec["required"] = False
    if arg.default is not None:
        spec["default"] = arg.default
    return spec


def catalog_json(catalog: SkillCatalog) -> str:
    """The message's text for `catalog`."""
    skills = [{"name": s.name, "description": s.description,
               "args": {a.name: _arg_spec(a) for a in s.args}} for s in catalog.skills]
    return json.dumps({"tools": skill_tools(catalog), "skills": skills}, ensure_ascii=False)


def catalog_of(text: str) -> SkillCatalog:
    """The skills of a `~/skills` message (CatalogError, a ValueError, if it holds none)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"~/skills is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("~/skills is not a JSON object")
    return SkillCatalog.from_dict({"skills": data.get("skills")}, where="~/skills")


class SkillsTopic:
    """The node's `~/skills` publisher; `publish` at every catalog the node loads."""

    def __init__(self, node):
        from std_msgs.msg import String

        self._node, self._string = node, String
        self._pub = node.create_publisher(String, "~/skills", latched_qos())

    def publish(self, catalog: SkillCatalog) -> None:
        self._pub.publish(self._string(data=catalog_json(catalog)))

    def close(self) -> None:
        self._node.destroy_publisher(self._pub)
