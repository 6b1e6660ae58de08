"""A damaged safetensors file fails the load with one error naming the file and the cause in
plain words (engine/weights/shard.py): a file cut short, a header that is not JSON or lies
about a tensor's size. Checked at the target, the MTP head's own shard, the drafter and the
n-gram reader, then through the CLI (one line, exit 2, no traceback). serve and the node:
test/server/test_serve.py and test/ros/test_node_lifecycle.py."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from damaged import DAMAGES, damage, damaged_demo
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from flash_planner.cli import main
from flash_planner.engine.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_mtp_head,
    read_config,
)
from flash_planner.engine.models.drafters.dflash import DrafterError, load_drafter
from flash_planner.engine.models.flash_next.ngram import StoredTensor
from flash_planner.engine.weights.shard import problem


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """damage -> (a damaged copy of the demo target, the line the engine must say)."""
    return {how: damaged_demo(tmp_path_factory.mktemp(how) / "target", how)
            for how in DAMAGES}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A sound two-tensor file: a F32 [100] at data bytes 0-400, b BF16 [4, 4] at 400-432."""
    path = tmp_path_factory.mktemp("small") / "small.safetensors"
    save_file({"a": torch.arange(100.0), "b": torch.ones(4, 4, dtype=torch.bfloat16)},
              str(path))
    return path


def _rewritten(raw: bytes, edit) -> bytes:
    """`raw` with its header edited (its 8-byte length and JSON rewritten), data untouched."""
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + raw[8 + length:]


def _past_end(h):
    h["a"].update(shape=[1100], data_offsets=[0, 4400])
    h["b"]["data_offsets"] = [4400, 4432]


FILES = {   # name -> (the file's bytes from the sound one's, what `problem` says)
    "cut-in-data": (lambda raw: raw[:-10], "truncated: the header says 432 bytes of tensor "
                    "data, the file has 422 (from tensor b on, the data is missing)"),
    "cut-in-header": (lambda raw: raw[:30], "truncated inside its header: the header length "
                      "says {length} bytes, the file has 22 after it"),
    "too-short": (lambda raw: raw[:5], "truncated: 5 bytes, too short for a safetensors file"),
    "empty": (lambda raw: b"", "truncated: 0 bytes, too short for a safetensors file"),
    "not-json": (lambda raw: raw[:8] + b"[" + raw[9:], "corrupt header: not valid JSON ("),
    "not-an-object": (lambda raw: struct.pack("<Q", 2) + b"[]",
                      "corrupt header: a JSON list, not an object of tensors"),
    "shape-lies": (lambda raw: _rewritten(raw, lambda h: h["a"].update(shape=[200])),
                   "the header lies about tensor a: its data_offsets [0, 400] hold 400 bytes, "
                   "its dtype F32 x shape [200] needs 800"),
    "offsets-lie": (lambda raw: _rewritten(raw, lambda h: h["a"].update(data_offsets=[0, 4400])),
                    "the header lies about tensor a: its data_offsets [0, 4400] hold 4400 "
                    "bytes, its dtype F32 x shape [100] needs 400"),
    "offsets-past-the-end": (lambda raw: _rewritten(raw, _past_end),
                             "truncated: the header says 4432 bytes of tensor data, the file "
                             "has 432 (from tensor a on, the data is missing)"),
    "offsets-overlap": (lambda raw: _rewritten(raw, lambda h: h["b"].update(
        data_offsets=[396, 428])), "corrupt header: the data_offsets of tensor b start at byte "
        "396, where tensor a ends at byte 400"),
    "trailing-bytes": (lambda raw: raw + bytes(8), "longer than its header says: the header "
                       "says 432 bytes of tensor data, the file has 440"),
}


@pytest.mark.parametrize("case", list(FILES))
def test_what_is_wrong_with_a_file_in_plain_words_and_safetensors_refuses_it(small, tmp_path,
                                                                            case):
    make, expected = FILES[case]
    raw = small.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(make(raw))
    assert problem(small) is None
    assert problem(bad).startswith(expected.format(length=length)), problem(bad)
    with pytest.raises(SafetensorError):    # the format as safetensors reads it: refused too
        safe_open(str(bad), framework="pt")


@pytest.mark.parametrize("how", DAMAGES)
def test_the_target_names_the_file_and_the_cause(demos, how):
    path, line = demos[how]
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path)
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value), caught.value
    assert "not a readable safetensors file" not in str(caught.value)


def test_the_mtp_heads_own_shard_is_checked_when_the_head_loads(checkpoints, tmp_path):
    """Sharded, the head's tensors sit in model-mtp.safetensors, which the target never
    opens: the target loads, the head's load names its file."""
    path = tmp_path / "target"
    shutil.copytree(checkpoints("hybrid", mtp=True, max_shard_size="100KB"), path)
    file = path / "model-mtp.safetensors"
    line = f"{file}: {damage(file, 'truncated')}"
    checkpoint = load_checkpoint(path, with_tokenizer=False)
    with pytest.raises(CheckpointError, match=re.escape(line)):
        load_mtp_head(checkpoint, torch.float32, "cpu")


@pytest.mark.parametrize("how", DAMAGES)
def test_the_drafter_names_the_file_and_the_cause(hybrid_dir, tmp_path, how):
    from flash_planner.train.tiny import write_tiny_drafter

    path = write_tiny_drafter(tmp_path / "drafter", hybrid_dir)
    file = path / "model.safetensors"
    line = f"{file}: {damage(file, how)}"
    with pytest.raises(DrafterError, match=re.escape(line)):
        load_drafter(path, read_config(hybrid_dir), torch.float32, "cpu")


def test_the_ngram_reader_checks_the_header_before_reading_rows(small, tmp_path):
    """It reads rows with pread, never through safetensors: a short file is refused when
    the table opens, not read past its end mid-forward."""
    bad = tmp_path / "table.safetensors"
    bad.write_bytes(small.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=re.escape(f"{bad}: truncated: the header says "
                                                        "432 bytes of tensor data")):
        StoredTensor(bad, "b", CheckpointError)


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("command", [["plan", "open the fridge"], ["generate", "--prompt", "x"]],
                         ids=["plan", "generate"])
def test_the_cli_says_it_in_one_line_with_exit_2(demos, capsys, how, command):
    path, line = demos[how]
    assert main([*command, "--model", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flash-planner: error: {line}"), err
    assert "\n" not in err and "Traceback" not in err, err


def test_the_console_entry_point_prints_no_traceback(demos):
    path, line = demos["truncated"]
    proc = subprocess.run([sys.executable, "-m", "flash_planner.cli", "plan", "open the fridge",
                           "--model", str(path), "--device", "cpu"], capture_output=True,
                          text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"flash-planner: error: {line}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
