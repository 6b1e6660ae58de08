"""The skill catalog from YAML and the plan JSON-Schema generated from it."""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator

from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.skills import CatalogError, SkillCatalog


@pytest.fixture(scope="module")
def catalog():
    return SkillCatalog.from_yaml(default_skills_path())


def test_shipped_catalog_has_the_documented_skills(catalog):
    assert set(catalog.names) >= {"navigate_to", "pick", "place", "open", "close", "say",
                                  "wait"}
    assert catalog.get("place").signature() == "place(object, location)"
    assert "minimum 0" in catalog.get("wait").signature()


def test_plan_schema_accepts_valid_and_rejects_invalid_plans(catalog):
    schema = Draft202012Validator(catalog.plan_schema())
    good = {"plan": [{"skill": "pick", "args": {"object": "cup"}},
                     {"skill": "wait", "args": {"seconds": 2.5}}]}
    assert schema.is_valid(good)
    for bad in ({"plan": []}, {"plan": [{"skill": "fly", "args": {}}]},
                {"plan": [{"skill": "pick", "args": {}}]},
                {"plan": [{"skill": "wait", "args": {"seconds": -1}}]},
                {"plan": [{"skill": "pick", "args": {"object": "cup", "hand": "left"}}]}):
        assert not schema.is_valid(bad), bad


@pytest.mark.parametrize("data,match", [
    ({"skills": []}, "has no skills"),
    ({"tools": []}, "'skills' list"),
    ({"skills": [{"name": "go to"}]}, "identifier"),
    ({"skills": [{"name": "a"}, {"name": "a"}]}, "defined twice"),
    ({"skills": [{"name": "a", "args": {"x": {"type": "float"}}}]}, "'type' must be one of"),
    ({"skills": [{"name": "a", "args": {"x": {"type": "string", "regex": "."}}}]},
     r"unknown field\(s\) \['regex'\]"),
    ({"skills": [{"name": "a", "args": {"x": {"type": "number", "minimum": 5, "maximum": 1}}}]},
     r"argument 'x': minimum 5 is above maximum 1"),
    ({"skills": [{"name": "a", "args": {"x": {"type": "string", "enum": []}}}]},
     "'enum' must be a non-empty list"),
    ({"skills": [{"name": "a", "args": {"x": {"type": "integer", "enum": [1, "two"]}}}]},
     "enum value .two. is not of type integer"),
    ({"skills": [{"name": "a", "args": {"x": {"type": "string", "maximum": 3}}}]},
     "'maximum' applies to number and integer arguments"),
    ({"skills": [{"name": "a", "args": {"x": {"type": "number", "minimum": "0"}}}]},
     "'minimum' must be a number"),
])
def test_bad_catalogs_name_the_problem(data, match):
    with pytest.raises(CatalogError, match=match):
        SkillCatalog.from_dict(data)


def test_unreadable_catalog_file(tmp_path):
    with pytest.raises(CatalogError, match="not readable"):
        SkillCatalog.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("skills: [unclosed")
    with pytest.raises(CatalogError, match="not valid YAML"):
        SkillCatalog.from_yaml(bad)
