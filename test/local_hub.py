"""A Hugging Face Hub on loopback, so that huggingface_hub's own download code writes its own
cache in tests with no network.

It answers the requests `snapshot_download` makes (repo info, the recursive file tree, and
HEAD/GET of each file under /resolve/) for the repos it is given, and answers the Hub's
errors (404 with `X-Error-Code: RepoNotFound` / `RevisionNotFound`) for anything else.
`truncate` names files whose body is cut short on the wire, as a dropped connection leaves
it. Point huggingface_hub at it with `HF_ENDPOINT` (read at import) or `endpoint=`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

LFS_SUFFIXES = (".safetensors",)


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = ""
    refs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, path: Path, commit_seed: str = "") -> Repo:
        files = {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
        digest = hashlib.sha1(commit_seed.encode())
        for name, data in files.items():
            digest.update(name.encode() + hashlib.sha1(data).digest())
        commit = digest.hexdigest()
        return cls(files=files, commit=commit, refs={"main": commit})


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class LocalHub:
    def __init__(self, repos: dict[str, Repo], truncate: tuple[str, ...] = ()) -> None:
        self.repos, self.truncate, self.requests = repos, truncate, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:       # keep test output clean
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> LocalHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- answers -----------------------------------------------------------------------
    def _send(self, h, status: int, data: bytes, headers: dict[str, str], body: bool,
              length: int | None = None) -> None:
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(data) if length is None else length))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _error(self, h, code: str, body: bool) -> None:
        data = json.dumps({"error": code}).encode()
        self._send(h, 404, data, {"X-Error-Code": code, "Content-Type": "application/json"},
                   body)

    def _find(self, parts: list[str]) -> tuple[str, Repo] | None:
        repo_id = "/".join(parts[:2])
        return (repo_id, self.repos[repo_id]) if repo_id in self.repos else None

    def _commit(self, repo: Repo, revision: str) -> str | None:
        return revision if revision == repo.commit else repo.refs.get(revision)

    def answer(self, h, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path))
        parts = [p for p in path.split("/") if p]
        api = parts[:2] == ["api", "models"]
        found = self._find(parts[2:] if api else parts)
        if found is None:
            return self._error(h, "RepoNotFound", body)
        repo_id, repo = found
        rest = parts[4:] if api else parts[2:]
        if len(rest) < 2:
            return self._error(h, "EntryNotFound", body)
        kind, revision = rest[0], rest[1]
        commit = self._commit(repo, revision)
        if commit is None:
            return self._error(h, "RevisionNotFound", body)
        if api and kind == "revision":
            info = {"id": repo_id, "sha": commit,
                    "siblings": [{"rfilename": name} for name in repo.files]}
            return self._send(h, 200, json.dumps(info).encode(),
                              {"Content-Type": "application/json"}, body)
        if api and kind == "tree":
            entries = []
            for name, data in repo.files.items():
                entry = {"type": "file", "path": name, "size": len(data),
                         "oid": _git_blob_sha1(data)}
                if name.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                    "pointerSize": 134}
                entries.append(entry)
            return self._send(h, 200, json.dumps(entries).encode(),
                              {"Content-Type": "application/json"}, body)
        name = "/".join(rest[2:])
        if kind != "resolve" or name not in repo.files:
            return self._error(h, "EntryNotFound", body)
        data = repo.files[name]
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if name.endswith(LFS_SUFFIXES):
            headers.update({"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"',
                            "X-Linked-Size": str(len(data)), "ETag": f'"{_git_blob_sha1(data)}"'})
        else:
            headers["ETag"] = f'"{_git_blob_sha1(data)}"'
        if body and name in self.truncate:
            data = data[:len(data) // 2]      # the connection drops halfway
        self._send(h, 200, data, headers, body)


@contextmanager
def hub_env(cache: Path, endpoint: str = "http://127.0.0.1:9", offline: bool = False):
    """huggingface_hub pointed at `cache` and `endpoint` (by default a closed port: no Hub
    reachable), as HF_HUB_CACHE / HF_ENDPOINT / HF_HUB_OFFLINE would set it."""
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_CACHE", str(cache))
        mp.setattr(constants, "ENDPOINT", endpoint)
        mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                   endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        mp.setattr(constants, "HF_HUB_OFFLINE", offline)
        yield
