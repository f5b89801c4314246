"""A stand-in for the Kubernetes API server: a real HTTP server on loopback, for tests.

Why a stand-in: no Kubernetes API server can run here (no kube-apiserver / etcd binaries and
no cluster; only the ``kubectl`` client is installed). Everything else in the tests is real:
the services reach this server through the official ``kubernetes`` Python client
(``ANCE_KUBE_API``), over HTTP.

It holds one AnceRun and answers the REST calls a namespaced custom resource with a status
subresource and core/v1 Events get:

* ``GET  /apis/<group>/<version>/namespaces/<ns>/anceruns/<name>[/status]``
* ``PATCH .../anceruns/<name>/status`` — ``application/merge-patch+json`` only (RFC 7386),
  applied to ``.status`` alone; the result is checked against the CRD's status schema (422
  on a type or enum error) and fields the schema lacks are pruned, as a real server does.
* ``POST /api/v1/namespaces/<ns>/events`` and ``PATCH .../events/<name>``.

Every request is recorded as an :class:`ApiRequest` (verb, apiGroup, resource[/subresource],
namespace, name) for RBAC checks; every accepted status is kept in order. :meth:`stop` and
:meth:`start` take it down and bring it back on the same port.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jsonschema

from ance_train.launcher.ports import free_port

VERBS = {"GET": "get", "POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


@dataclass(frozen=True)
class ApiRequest:
    verb: str
    api_group: str  # "" for the core group
    resource: str  # "anceruns", "anceruns/status", "events"
    namespace: str
    name: str  # "" for a collection


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def parse_path(method: str, path: str) -> ApiRequest | None:
    """``/apis/<g>/<v>/namespaces/<ns>/<res>[/<name>[/<sub>]]`` or the ``/api/v1/...`` form."""
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    if parts[:1] == ["apis"] and len(parts) >= 6 and parts[3] == "namespaces":
        group, rest = parts[1], parts[4:]
    elif parts[:2] == ["api", "v1"] and len(parts) >= 5 and parts[2] == "namespaces":
        group, rest = "", parts[3:]
    else:
        return None
    namespace, resource, tail = rest[0], rest[1], rest[2:]
    name = tail[0] if tail else ""
    if len(tail) > 1:
        resource = f"{resource}/{tail[1]}"
    verb = VERBS.get(method, method.lower())
    if verb == "get" and not name:
        verb = "list"
    return ApiRequest(verb, group, resource, namespace, name)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class KubeStandIn:
    """The server and its state: one AnceRun, its status history, Events, the request log."""

    def __init__(self, ancerun: dict[str, Any], namespace: str, crd: dict[str, Any]) -> None:
        self.group, self.version = ancerun["apiVersion"].split("/")
        self.namespace = namespace
        self.name = ancerun["metadata"]["name"]
        self.ancerun = merge_patch(ancerun, {"metadata": {
            "namespace": namespace, "uid": str(uuid.uuid4()), "resourceVersion": "1",
            "creationTimestamp": _now()}})
        version = next(v for v in crd["spec"]["versions"] if v["name"] == self.version)
        self.status_schema = version["schema"]["openAPIV3Schema"]["properties"]["status"]
        self.plural = crd["spec"]["names"]["plural"]
        self.requests: list[ApiRequest] = []
        self.statuses: list[dict[str, Any]] = []  # every accepted status, in order
        self.pruned: set[str] = set()  # status fields the schema does not know
        self.rejected: list[str] = []  # why a patch was refused (422)
        self.events: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        # Below the ephemeral range (and in this test worker's slice): while the stand-in is
        # down, no outgoing connection can be given its port, so it comes back on it.
        self.port = free_port()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def status(self) -> dict[str, Any]:
        with self.lock:
            return copy.deepcopy(self.ancerun.get("status", {}))

    def start(self) -> KubeStandIn:
        standin = self

        class Handler(_Handler):
            server_state = standin

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="kube-standin",
                         daemon=True).start()
        return self

    def stop(self) -> None:
        """Down: the port refuses connections until :meth:`start` (HTTP/1.0, no keep-alive)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> KubeStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- request handling (called by the handler threads) ------------------------------------
    def handle(self, method: str, path: str, content_type: str,
               body: Any) -> tuple[int, dict[str, Any]]:
        request = parse_path(method, path)
        with self.lock:
            if request is not None:
                self.requests.append(request)
            if request is None or request.namespace != self.namespace:
                return _status(404, "NotFound", f"{path} not found")
            if request.api_group == self.group and request.resource.split("/")[0] == self.plural:
                return self._ancerun(request, content_type, body)
            if request.api_group == "" and request.resource == "events":
                return self._event(request, content_type, body)
            return _status(404, "NotFound", f"{request.resource} not served here")

    def _ancerun(self, request: ApiRequest, content_type: str,
                 body: Any) -> tuple[int, dict[str, Any]]:
        if request.name != self.name:
            return _status(404, "NotFound", f"{self.plural} {request.name!r} not found")
        if request.verb == "get":
            return 200, copy.deepcopy(self.ancerun)
        if request.verb != "patch" or request.resource != f"{self.plural}/status":
            return _status(405, "MethodNotAllowed", f"{request.verb} {request.resource}")
        if content_type != "application/merge-patch+json":
            return _status(415, "UnsupportedMediaType", f"content type {content_type!r}")
        status = merge_patch(self.ancerun.get("status", {}), (body or {}).get("status", {}))
        known = self.status_schema.get("properties", {})
        self.pruned.update(key for key in status if key not in known)
        status = {key: value for key, value in status.items() if key in known}
        try:
            jsonschema.validate(status, self.status_schema)
        except jsonschema.ValidationError as error:
            self.rejected.append(error.message)
            return _status(422, "Invalid", error.message)
        self.ancerun["status"] = status
        version = int(self.ancerun["metadata"]["resourceVersion"]) + 1
        self.ancerun["metadata"]["resourceVersion"] = str(version)
        self.statuses.append(copy.deepcopy(status))
        return 200, copy.deepcopy(self.ancerun)

    def _event(self, request: ApiRequest, content_type: str,
               body: Any) -> tuple[int, dict[str, Any]]:
        if request.verb == "create":
            event = merge_patch(body, {"metadata": {"uid": str(uuid.uuid4()),
                                                    "resourceVersion": "1",
                                                    "creationTimestamp": _now()}})
            self.events[event["metadata"]["name"]] = event
            return 201, copy.deepcopy(event)
        if request.verb == "patch" and request.name in self.events:
            if content_type not in ("application/merge-patch+json",
                                    "application/strategic-merge-patch+json"):
                return _status(415, "UnsupportedMediaType", f"content type {content_type!r}")
            self.events[request.name] = merge_patch(self.events[request.name], body)
            return 200, copy.deepcopy(self.events[request.name])
        return _status(404, "NotFound", f"event {request.name!r} not found")


class _Handler(BaseHTTPRequestHandler):
    server_state: KubeStandIn

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            code, reply = _status(400, "BadRequest", "body is not JSON")
        else:
            code, reply = self.server_state.handle(self.command, self.path, content_type, body)
        data = json.dumps(reply).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                  "reason": reason, "message": message, "code": code}


def role_allows(rules: list[dict[str, Any]], request: ApiRequest) -> bool:
    """Whether an RBAC Role's rules allow ``request`` (apiGroups, resources, resourceNames,
    verbs; ``*`` wildcards as Kubernetes reads them)."""
    for rule in rules:
        if not _matches(rule.get("apiGroups", []), request.api_group):
            continue
        if not _matches(rule.get("resources", []), request.resource):
            continue
        if not _matches(rule.get("verbs", []), request.verb):
            continue
        names = rule.get("resourceNames") or []
        if names and request.name not in names:  # a create has no name: never matches
            continue
        return True
    return False


def _matches(allowed: list[str], value: str) -> bool:
    return "*" in allowed or value in allowed
