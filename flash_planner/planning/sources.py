"""Where a model comes from: a local checkpoint directory, or a Hugging Face repo id.

A preset's `target_path` / `drafter_path`, `model.path` / `model.drafter_path` on the node and
`--model` on the command line may each name a repo id, `org/name`, optionally pinned as
`org/name@revision` (a branch, tag or commit). It is resolved by huggingface_hub into its
standard cache ($HF_HUB_CACHE, ~/.cache/huggingface/hub), fetching only the files the
engine reads (ENGINE_FILES). A robot never downloads unless told to (`model.allow_download`,
`--allow-download`); `flash-planner fetch` downloads ahead of time. Offline
(HF_HUB_OFFLINE=1, or downloads off) a repo id resolves from the cache alone, and a missing
model is an error that names the command that fetches it.

An existing local path always wins over a repo id of the same spelling.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..engine.weights.shard import problem as shard_problem

# What the engine reads from a checkpoint: config, weights (one file or shards and their
# index), quantization metadata, generation defaults, and the tokenizer files.
ENGINE_FILES = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "hf_quant_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
    "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json",
)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_REVISION = re.compile(r"^[\w./-]+$")


class SourceError(ValueError):
    """A model source that cannot be resolved; the message says why and what to run."""


@dataclass(frozen=True)
class RepoSource:
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse(text: str | None) -> RepoSource | None:
    """The repo id `text` names, or None when it is a local path (or not a repo id)."""
    if not text or text.startswith(("/", ".", "~")) or Path(text).expanduser().exists():
        return None
    repo, at, revision = text.partition("@")
    if not _REPO_ID.match(repo) or (at and not _REVISION.match(revision)):
        return None
    return RepoSource(repo, revision or None)


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def fetch_command(source: RepoSource | str) -> str:
    return f"flash-planner fetch {source}"


def resolve(text: str | None, allow_download: bool = False,
            progress: Callable[[str], None] | None = None) -> str | None:
    """A local directory for `text`: itself when it is a path, else the repo's cached
    snapshot (downloaded first when `allow_download`)."""
    source = parse(text)
    if source is None:
        return text
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if progress and allow_download:
        progress(f"fetching {source} into {hub_cache()} (only the files the engine reads)")
    try:
        path = snapshot_download(source.repo_id, revision=source.revision,
                                 allow_patterns=list(ENGINE_FILES),
                                 local_files_only=not allow_download)
    except IncompleteSnapshotError as exc:
        raise SourceError(f"the cached snapshot of model {source} is incomplete ({exc}); "
                          f"run `{fetch_command(source)}` again") from None
    except LocalEntryNotFoundError as exc:
        why = ("downloads are off (model.allow_download, --allow-download)"
               if not allow_download else f"the Hub could not be reached ({exc})")
        raise SourceError(f"model {source} is not in the Hugging Face cache {hub_cache()} "
                          f"and {why}: fetch it first with `{fetch_command(source)}`") from None
    except GatedRepoError:
        raise SourceError(f"model {source} is gated: accept its terms on the Hub and log in "
                          "(`hf auth login` or HF_TOKEN), then fetch it again") from None
    except RevisionNotFoundError:
        raise SourceError(f"model {source.repo_id} has no revision "
                          f"{source.revision!r}") from None
    except RepositoryNotFoundError:
        raise SourceError(f"no model repository {source.repo_id} on the Hub (check the "
                          "spelling; a private one needs `hf auth login` or HF_TOKEN)") from None
    except (HfHubHTTPError, OSError) as exc:
        raise SourceError(f"fetching {source} failed: {exc}") from None
    check_snapshot(Path(path), source)
    return path


def check_snapshot(path: Path, source: RepoSource | str) -> None:
    """Every file the engine will read is there and whole: config.json, the index's every
    shard, and each safetensors file as long as its header says."""
    again = f"delete it and run `{fetch_command(source)}` again"
    if not (path / "config.json").is_file():
        raise SourceError(f"model {source}: {path} has no config.json; {again}")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise SourceError(f"model {source}: {path} has no safetensors weights; {again}")
    for name in shards:
        shard = path / name
        if not shard.is_file():
            raise SourceError(f"model {source}: shard {name} is missing from {path}; {again}")
        problem = shard_problem(shard)   # its size against its header's, and the header
        if problem:
            raise SourceError(f"model {source}: {name}: {problem}; {again}")
