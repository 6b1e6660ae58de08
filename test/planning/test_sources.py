"""Models named by Hugging Face repo id (planning/sources.py), through huggingface_hub's own
download and cache code with no network: a Hub on loopback (test/local_hub.py) serves tiny
checkpoints, huggingface_hub writes its cache, and resolution is then checked offline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from local_hub import LocalHub, Repo, hub_env

from flash_planner.cli import main
from flash_planner.engine.engine import Engine
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.planning import sources
from flash_planner.planning.presets import ModelPreset, preset_names, resolve_model
from flash_planner.train.tiny import write_tiny_checkpoint

EXTRA = {"README.md": b"# not read by the engine\n", "modeling_custom.py": b"raise SystemExit\n",
         "pytorch_model.bin": b"\0" * 64}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("sharded"), kind="hybrid",
                                 max_shard_size="300KB")


def _repo(path: Path, seed: str = "") -> Repo:
    repo = Repo.from_dir(path, seed)
    repo.files.update(EXTRA)
    return repo


def _fetch(cache: Path, hub: LocalHub, *models: str, capsys=None) -> int:
    with hub_env(cache, hub.endpoint):
        return main(["fetch", *models])


def test_repo_ids_and_paths_are_told_apart(tmp_path, monkeypatch):
    parse = sources.parse
    assert parse("Qwen/Qwen3.6-27B-FP8") == sources.RepoSource("Qwen/Qwen3.6-27B-FP8")
    assert parse("z-lab/Qwen3.6-27B-DFlash@0919688658996800f86b895034249700e9481106") == \
        sources.RepoSource("z-lab/Qwen3.6-27B-DFlash",
                           "0919688658996800f86b895034249700e9481106")
    assert parse("nvidia/Qwen3.6-35B-A3B-NVFP4@refs/pr/3").revision == "refs/pr/3"
    for path in ("/models/x", "./x/y", "~/x/y", "a/b/c", "demo", "", "org/na me", "a/b@",
                 "a/b@x y"):
        assert parse(path) is None, path
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse("org/name") is None          # an existing directory wins
    assert resolve_model("org/name").target_path == "org/name"


def test_every_thor_preset_names_published_repos_for_target_and_drafter():
    thor = [n for n in preset_names() if n != "demo"]
    assert {"qwen3_6_27b", "qwen3_6_27b_fp8", "qwen3_6_27b_nvfp4", "qwen3_6_35b_a3b",
            "qwen3_6_35b_a3b_fp8", "qwen3_6_35b_a3b_nvfp4", "qwen3_4b", "qwen3_8_27b",
            "qwen3_8_27b_fp8", "qwen3_8_27b_nvfp4"} <= set(thor)
    for name in thor:
        preset = ModelPreset.load(name)
        target = sources.parse(preset.target_path)
        if "flash_next" in name:       # no drafter published for it that we could name
            assert preset.drafter_path is None and preset.method == "none", name
            assert preset.repos() == [target]
            continue
        drafter = sources.parse(preset.drafter_path)
        assert target and drafter, name
        assert drafter.repo_id.startswith("z-lab/") and "DFlash" in drafter.repo_id, name
        assert preset.repos() == [target, drafter]
    assert ModelPreset.load("demo").repos() == []


def test_fetch_writes_huggingface_hubs_cache_with_only_the_engines_files(
        tmp_path, sharded, capsys):
    from huggingface_hub import scan_cache_dir

    cache = tmp_path / "hub"
    with LocalHub({"acme/tiny": _repo(sharded)}) as hub:
        assert _fetch(cache, hub, "acme/tiny") == 0
    out = capsys.readouterr()
    snapshot = Path(out.out.strip().split(": ", 1)[1])
    assert "fetching acme/tiny into" in out.err
    report = scan_cache_dir(cache)
    assert not report.warnings and [r.repo_id for r in report.repos] == ["acme/tiny"]
    fetched = {p.name for p in snapshot.iterdir()}
    assert not fetched & set(EXTRA)
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= fetched
    assert all(p.is_symlink() for p in snapshot.iterdir())        # into blobs/, as hf does


def test_offline_a_cached_repo_loads_and_generates_like_its_directory(tmp_path, sharded):
    cache = tmp_path / "hub"
    with LocalHub({"acme/tiny": _repo(sharded)}) as hub:
        assert _fetch(cache, hub, "acme/tiny") == 0
    settings = GenerationSettings(max_new_tokens=8, ignore_eos=True)
    with hub_env(cache, offline=True):                 # HF_HUB_OFFLINE=1, no Hub reachable
        config = resolve_model("acme/tiny").engine_config(device="cpu", dtype="fp32")
        assert Path(config.model_path).parent.name == "snapshots"
        from_cache = generate(Engine.load(config), [3, 4, 5], settings).token_ids
    direct = Engine.load(ModelPreset("d", str(sharded)).engine_config(device="cpu",
                                                                      dtype="fp32"))
    assert from_cache == generate(direct, [3, 4, 5], settings).token_ids


def test_a_revision_pin_resolves_that_revision(tmp_path, sharded, checkpoints):
    cache = tmp_path / "hub"
    old, new = _repo(sharded, "v1"), _repo(checkpoints("hybrid"), "v2")
    old.refs["v1"] = old.commit
    with LocalHub({"acme/tiny": old}) as hub:
        assert _fetch(cache, hub, "acme/tiny@v1") == 0
    with LocalHub({"acme/tiny": new}) as hub:
        assert _fetch(cache, hub, "acme/tiny") == 0
    with hub_env(cache):
        by_tag = Path(sources.resolve("acme/tiny@v1"))
        by_commit = Path(sources.resolve(f"acme/tiny@{old.commit}"))
        latest = Path(sources.resolve("acme/tiny"))
        with pytest.raises(sources.SourceError, match="acme/tiny@v9 is not in the Hugging "
                           "Face cache .* `flash-planner fetch acme/tiny@v9`"):
            sources.resolve("acme/tiny@v9")
    assert by_tag == by_commit and by_tag.name == old.commit and latest.name == new.commit
    assert (by_tag / "model.safetensors.index.json").is_file()
    assert not (latest / "model.safetensors.index.json").exists()


def test_a_model_missing_from_the_cache_names_the_command_that_fetches_it(tmp_path, capsys):
    with hub_env(tmp_path / "empty"):
        assert main(["plan", "bring the cup", "--model", "qwen3_4b"]) == 2
        assert main(["generate", "--model", "acme/tiny", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "model Qwen/Qwen3-4B is not in the Hugging Face cache" in err[0]
    assert "downloads are off" in err[0] and "`flash-planner fetch Qwen/Qwen3-4B`" in err[0]
    assert "`flash-planner fetch acme/tiny`" in err[1]


def test_a_file_lost_from_the_cache_and_a_corrupt_one_are_refused(tmp_path, sharded):
    cache = tmp_path / "hub"
    with LocalHub({"acme/tiny": _repo(sharded)}) as hub, hub_env(cache, hub.endpoint):
        snapshot = Path(sources.resolve("acme/tiny", allow_download=True))
    shard = sorted(snapshot.glob("model-*.safetensors"))[0]
    blob = shard.resolve()
    data = blob.read_bytes()
    with hub_env(cache):
        blob.write_bytes(data[:len(data) - 100])      # cut short after the download
        with pytest.raises(sources.SourceError, match=f"{shard.name}: truncated: the header "
                           "says [0-9]+ bytes of tensor data, the file has [0-9]+ .*; delete it"):
            sources.resolve("acme/tiny")
        blob.write_bytes(data)
        shard.unlink()                                # gone from the snapshot
        with pytest.raises(sources.SourceError, match="snapshot of model acme/tiny is "
                           "incomplete .* run `flash-planner fetch acme/tiny` again"):
            sources.resolve("acme/tiny")


def test_a_download_cut_short_and_a_repo_that_does_not_exist(tmp_path, sharded, capsys):
    cache = tmp_path / "hub"
    with LocalHub({"acme/tiny": _repo(sharded)}, truncate=("model.safetensors.index.json",
                                                           "model-00001-of-00002.safetensors",
                                                           "tokenizer.json")) as hub:
        assert _fetch(cache, hub, "acme/tiny") == 2
        assert _fetch(cache, hub, "acme/nope") == 2
        assert _fetch(cache, hub, "acme/tiny@v9") == 2
    err = capsys.readouterr().err
    assert "fetching acme/tiny failed: Consistency check failed" in err
    assert "no model repository acme/nope on the Hub" in err
    assert "model acme/tiny has no revision 'v9'" in err
    with hub_env(cache):                       # nothing half-downloaded passes for a model
        with pytest.raises(sources.SourceError):
            sources.resolve("acme/tiny")


def test_the_node_parameters_take_repo_ids_and_respect_allow_download(tmp_path, sharded):
    from flash_planner.ros.params import build_configs

    cache = tmp_path / "hub"
    values = {"model.preset": "", "model.path": "acme/tiny", "model.device": "cpu"}
    with LocalHub({"acme/tiny": _repo(sharded)}) as hub, hub_env(cache, hub.endpoint):
        with pytest.raises(ValueError, match="model/engine parameters: model acme/tiny is not "
                           "in the Hugging Face cache .*flash-planner fetch acme/tiny"):
            build_configs(values)
        assert not cache.exists() or not any(cache.iterdir())   # nothing was downloaded
        engine, _, _ = build_configs({**values, "model.allow_download": True})
    with hub_env(cache, offline=True):
        assert build_configs(values)[0].model_path == engine.model_path
    assert json.loads((Path(engine.model_path) / "config.json").read_text())


def test_fetch_of_a_preset_fetches_its_target_and_drafter(tmp_path, checkpoints, capsys):
    cache = tmp_path / "hub"
    target = checkpoints("dense")
    drafter = tmp_path / "drafter"
    shutil.copytree(target, drafter)                  # any checkpoint stands in here
    repos = {"Qwen/Qwen3-4B": _repo(target), "z-lab/Qwen3-4B-DFlash-b16": _repo(drafter, "d")}
    with LocalHub(repos) as hub:
        with hub_env(cache, hub.endpoint):
            assert main(["fetch", "qwen3_4b", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got["models"]) == set(repos) and got["cache"] == str(cache)
    with hub_env(cache):
        config = ModelPreset.load("qwen3_4b").engine_config()
    assert (config.model_path, config.drafter_path) == (got["models"]["Qwen/Qwen3-4B"],
                                                        got["models"][
                                                            "z-lab/Qwen3-4B-DFlash-b16"])
    assert main(["fetch", "demo"]) == 2
    assert "names local directories only" in capsys.readouterr().err
