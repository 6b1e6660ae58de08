"""The CPU vector ISA probe on record (engine/models/graphs/cpu_isa.py): a start whose record
matches this machine skips inductor's probe and picks the ISA the probe picked; any other
record changes nothing."""

from __future__ import annotations

import json
import platform
import subprocess

import pytest
import torch
from torch._inductor import config, cpu_vec_isa

from flash_planner.engine.models.graphs import cpu_isa

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="inductor's ISA list comes from x86 flags only")


@pytest.fixture
def probed(tmp_path):
    """The probe run as inductor runs it, recorded in tmp_path -> (its ISAs, its pick);
    inductor's setting restored afterwards."""
    with config.patch({"cpp.vec_isa_ok": None}):
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
        picked = str(cpu_vec_isa.pick_vec_isa())
        cpu_isa.record_probe(tmp_path)
        yield valid, picked
    cpu_vec_isa.valid_vec_isa_list.cache_clear()


def _no_probe(*args, **kwargs):
    raise AssertionError("inductor probed an ISA in a new process")


def test_a_matching_record_skips_the_probe_and_picks_the_same_isa(probed, tmp_path,
                                                                  monkeypatch):
    valid, picked = probed
    record = json.loads((tmp_path / cpu_isa.RECORD).read_text())
    assert record["valid"] == valid and record["machine"]["torch"] == torch.__version__
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    if valid != cpu_isa._named_by_flags():         # an ISA the flags name failed the probe
        assert not cpu_isa.trust_recorded_probe(tmp_path)
        return
    assert cpu_isa.trust_recorded_probe(tmp_path) and config.cpp.vec_isa_ok is True
    monkeypatch.setattr(subprocess, "run", _no_probe)
    assert [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] == valid
    assert str(cpu_vec_isa.pick_vec_isa()) == picked


@pytest.mark.parametrize("change", ["compiler", "torch", "failed", "unreadable", "missing"])
def test_any_other_record_changes_nothing(probed, tmp_path, change):
    path = tmp_path / cpu_isa.RECORD
    record = json.loads(path.read_text())
    if change == "compiler":
        record["machine"]["compiler"] = "/usr/bin/another-g++ 1 2"
    elif change == "torch":
        record["machine"]["torch"] = "2.0.0"
    elif change == "failed":                        # the probe refused an ISA
        record["valid"] = record["valid"][1:]
    path.write_text(json.dumps(record))
    if change == "unreadable":
        path.write_text("{not json")
    elif change == "missing":
        path.unlink()
    assert not cpu_isa.trust_recorded_probe(tmp_path)
    assert config.cpp.vec_isa_ok is None


def test_a_setting_of_vec_isa_ok_is_left_alone(probed, tmp_path):
    config.cpp.vec_isa_ok = False                  # the fixture restores it
    assert not cpu_isa.trust_recorded_probe(tmp_path) and config.cpp.vec_isa_ok is False
