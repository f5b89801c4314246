"""A loopback stand-in for the Hugging Face Hub: the HTTP endpoints that huggingface_hub's
``snapshot_download`` / ``hf_hub_download`` and ``HfApi.create_repo`` / ``upload_folder``
call, over real sockets, so the real client code runs against it (``HF_ENDPOINT``).

Served: ``GET /api/models/{repo}/revision/{rev}`` (``sha``, ``siblings``), ``GET
/api/models/{repo}/tree/{rev}`` (the file listing), ``HEAD``/``GET
/{repo}/resolve/{rev}/{file}`` (``X-Repo-Commit``, ``ETag``, ``Content-Length``), ``POST
/api/repos/create``, ``POST /api/validate-yaml``, ``POST /api/models/{repo}/preupload/{rev}``
(every file "regular": sent inline in the commit) and ``POST /api/models/{repo}/commit/{rev}``
(the NDJSON commit: header + base64 files). Errors carry the ``X-Error-Code`` huggingface_hub
maps to its exceptions (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``). No LFS or
Xet transfers: files of any size are committed inline, which the real Hub would refuse for
large files (it answers "lfs" at preupload).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def _git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch -> sha

    def resolve(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.commits else None


class HubStandIn:
    """Start with ``with HubStandIn() as hub``; ``hub.endpoint`` is the HF_ENDPOINT."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Authorization
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- repository content --------------------------------------------------------------
    def commit(self, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Make ``files`` the new head of ``branch`` (replacing the tree); returns the sha."""
        with self.lock:
            repo = self.repos.setdefault(repo_id, Repo())
            parent = repo.refs.get(branch, "")
            digest = hashlib.sha1(parent.encode())
            for path in sorted(files):
                digest.update(f"{path}\0{_git_blob_sha(files[path])}\n".encode())
            sha = digest.hexdigest()
            repo.commits[sha] = dict(files)
            repo.refs[branch] = sha
            return sha

    def commit_folder(self, repo_id: str, folder: Path, branch: str = "main") -> str:
        files = {p.relative_to(folder).as_posix(): p.read_bytes()
                 for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.commit(repo_id, files, branch)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        sha = repo.resolve(revision)
        assert sha is not None
        return repo.commits[sha]

    def downloads(self) -> list[str]:
        """Paths of the file downloads (resolve GETs) served so far."""
        return [path for method, path, _ in self.requests
                if method == "GET" and "/resolve/" in path]


def _handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        # -- helpers ---------------------------------------------------------------------
        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                  content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, obj: object, status: int = 200) -> None:
            self._send(status, json.dumps(obj).encode())

        def _error(self, status: int, code: str, message: str) -> None:
            self._send(status, json.dumps({"error": message}).encode(),
                       {"X-Error-Code": code, "X-Error-Message": message})

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository Not Found for url: {repo_id}")
            return repo

        def _commit_of(self, repo: Repo, revision: str) -> str | None:
            sha = repo.resolve(revision)
            if sha is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return sha

        def _files_at(self, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
            """The commit ``revision`` names in ``repo_id`` and its files; None once a 404
            naming the missing repo or revision is sent."""
            repo = self._repo(repo_id)
            sha = None if repo is None else self._commit_of(repo, revision)
            return None if sha is None else (sha, repo.commits[sha])

        def _record(self) -> list[str]:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Authorization")))
            return path.strip("/").split("/")

        # -- routes ----------------------------------------------------------------------
        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            parts = self._record()
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in (
                    "revision", "tree"):
                repo_id, action, revision = "/".join(parts[2:4]), parts[4], parts[5]
                found = self._files_at(repo_id, revision)
                if found is None:
                    return
                sha, files = found
                if action == "revision":
                    self._json({"id": repo_id, "modelId": repo_id, "sha": sha,
                                "private": False, "disabled": False, "gated": False,
                                "siblings": [{"rfilename": name} for name in sorted(files)]})
                else:
                    self._json([{"type": "file", "oid": _git_blob_sha(data), "size": len(data),
                                 "path": name} for name, data in sorted(files.items())])
                return
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                found = self._files_at(repo_id, revision)
                if found is None:
                    return
                sha, files = found
                data = files.get(name)
                if data is None:
                    self._error(404, "EntryNotFound", f"{name} does not exist at {revision}")
                    return
                self._send(200, data, {"X-Repo-Commit": sha,
                                       "ETag": f'"{_git_blob_sha(data)}"'},
                           content_type="application/octet-stream")
                return
            self._error(404, "EntryNotFound", f"no route {self.path}")

        def do_POST(self) -> None:
            parts = self._record()
            body = self._body()
            if parts == ["api", "repos", "create"]:
                payload = json.loads(body)
                repo_id = f"{payload['organization']}/{payload['name']}"
                with hub.lock:
                    hub.repos.setdefault(repo_id, Repo())
                self._json({"url": f"{hub.endpoint}/{repo_id}", "name": repo_id,
                            "id": repo_id})
                return
            if parts == ["api", "validate-yaml"]:
                self._json({"errors": [], "warnings": []})
                return
            if parts[:2] == ["api", "models"] and len(parts) == 6 and parts[4] in (
                    "preupload", "commit"):
                repo_id, action, branch = "/".join(parts[2:4]), parts[4], parts[5]
                repo = self._repo(repo_id)
                if repo is None:
                    return
                if action == "preupload":
                    files = json.loads(body)["files"]
                    self._json({"files": [{"path": f["path"], "uploadMode": "regular",
                                           "shouldIgnore": False, "oid": None}
                                          for f in files]})
                    return
                current = dict(repo.commits[repo.refs[branch]]) if branch in repo.refs else {}
                for line in body.splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        value = item["value"]
                        assert value.get("encoding") == "base64", value.get("encoding")
                        current[value["path"]] = base64.b64decode(value["content"])
                    elif item["key"] == "deletedFile":
                        current.pop(item["value"]["path"], None)
                    elif item["key"] not in ("header",):
                        self._error(400, "BadRequest", f"unsupported commit op {item['key']}")
                        return
                sha = hub.commit(repo_id, current, branch)
                self._json({"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{sha}",
                            "commitOid": sha, "pullRequestUrl": None})
                return
            self._error(404, "EntryNotFound", f"no route {self.path}")

    return Handler
