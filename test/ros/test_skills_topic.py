"""`~/skills` (ros/skills_topic.py) without ROS: every shipped catalog's message reads back
as the same skills, so a client grounds a scene exactly as the node does, and its `tools`
are the catalog's OpenAI tools as /v1/skills lists them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.skill_tools import skill_tools
from flash_planner.planning.skills import SkillCatalog
from flash_planner.ros.skills_topic import catalog_json, catalog_of

EXAMPLES = Path(__file__).resolve().parents[2] / "config" / "catalogs"
CATALOGS = [default_skills_path(), *sorted(p for p in EXAMPLES.glob("*.yaml")
                                           if not p.stem.endswith("_examples"))]


@pytest.mark.parametrize("path", CATALOGS, ids=lambda p: p.name)
def test_a_catalog_reads_back_as_the_same_skills(path):
    catalog = SkillCatalog.from_yaml(path)
    text = catalog_json(catalog)
    assert catalog_of(text).skills == catalog.skills
    scene = ["blue mug|mug", "kitchen sink|sink"]
    assert skill_tools(catalog_of(text), scene) == skill_tools(catalog, scene)
    assert json.loads(text)["tools"] == skill_tools(catalog)


@pytest.mark.parametrize("text, message", [("{", "not JSON"), ("[]", "not a JSON object"),
                                           ('{"tools": []}', "a 'skills' list")])
def test_a_message_without_skills_is_an_error_naming_it(text, message):
    with pytest.raises(ValueError, match=message):
        catalog_of(text)
