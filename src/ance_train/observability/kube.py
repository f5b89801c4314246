"""A run's progress on its ``AnceRun`` custom resource and as Kubernetes Events.

Status fields are sent as JSON merge patches on the ``anceruns/status`` subresource (each
service writes only its own fields) and Events as core/v1 Events whose involvedObject is the
AnceRun. One daemon thread sends what the services queue, so a slow or absent API server never
blocks or crashes a service: status updates are merged (the newest value of a field wins) and
throttled, failures are logged at most once a minute and retried with backoff.

The API calls made — the chart's Role grants exactly these: ``get`` on ``anceruns`` (the uid
the Events refer to), ``patch`` on ``anceruns/status``, ``create`` on core ``events``.

Enabled when ``ANCE_ANCERUN`` names the resource; ``ANCE_K8S_NAMESPACE`` (default: the pod's
namespace) and ``ANCE_KUBE_API`` (an API base URL without auth, for tests and out-of-cluster
use; default: the in-cluster service account) say where it is.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from ance_train.infra.credentials import redact

log = logging.getLogger(__name__)

GROUP = "ance-train.io"
VERSION = "v1alpha1"
PLURAL = "anceruns"
KIND = "AnceRun"
ANCERUN_VAR = "ANCE_ANCERUN"
NAMESPACE_VAR = "ANCE_K8S_NAMESPACE"
KUBE_API_VAR = "ANCE_KUBE_API"
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
MAX_QUEUED_EVENTS = 100
MAX_MESSAGE_CHARS = 1000
ERROR_LOG_INTERVAL_S = 60.0
REQUEST_TIMEOUT_S = 5.0


class KubeConfigError(ValueError):
    pass


def rfc3339_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class KubeSettings:
    """Where the run's AnceRun lives and how to reach the API server."""

    name: str
    namespace: str
    api: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> KubeSettings | None:
        """The settings, or None when ``ANCE_ANCERUN`` is unset (reporting off)."""
        name = env.get(ANCERUN_VAR, "").strip()
        if not name:
            return None
        if not _DNS_NAME.match(name):
            raise KubeConfigError(f"{ANCERUN_VAR}={name!r} is not a Kubernetes object name")
        namespace = env.get(NAMESPACE_VAR, "").strip() or _pod_namespace()
        if not namespace:
            raise KubeConfigError(f"{ANCERUN_VAR} is set but {NAMESPACE_VAR} is not, and this "
                                  "process is not in a pod")
        api = env.get(KUBE_API_VAR, "").strip() or None
        if api is None and not env.get("KUBERNETES_SERVICE_HOST"):
            raise KubeConfigError(f"{ANCERUN_VAR} is set but {KUBE_API_VAR} is not, and this "
                                  "process is not in a pod (KUBERNETES_SERVICE_HOST unset)")
        if importlib.util.find_spec("kubernetes") is None:
            raise KubeConfigError(f"{ANCERUN_VAR} is set but the kubernetes client is not "
                                  "installed: pip install 'ance-train[k8s]'")
        return cls(name, namespace, api)


def _pod_namespace() -> str:
    try:
        return POD_NAMESPACE_FILE.read_text().strip()
    except OSError:
        return ""


def _transient(error: BaseException) -> bool:
    from kubernetes.client.exceptions import ApiException

    if isinstance(error, ApiException):
        return error.status is None or error.status >= 500 or error.status == 429
    return True  # connection refused, timeouts, DNS: worth another quick try


def _refused(error: BaseException) -> bool:
    """The server rejected the body itself (400/422): sending it again cannot succeed."""
    from kubernetes.client.exceptions import ApiException

    return isinstance(error, ApiException) and error.status in (400, 422)


def _describe(error: BaseException) -> str:
    from kubernetes.client.exceptions import ApiException

    if isinstance(error, ApiException):
        return f"HTTP {error.status} {error.reason}"
    return f"{type(error).__name__}: {error}"


class _AnceRunApi:
    """The three calls, through the official client (each retried briefly on transient errors)."""

    def __init__(self, settings: KubeSettings, role: str, instance: str) -> None:
        from kubernetes import client, config

        configuration = client.Configuration()
        configuration.retries = 0  # retried here (tenacity), without urllib3's log lines
        if settings.api:
            configuration.host = settings.api
        else:
            config.load_incluster_config(client_configuration=configuration)
        api_client = client.ApiClient(configuration)
        self.client = client
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.settings = settings
        self.role = role
        self.instance = instance
        self.uid: str | None = None

    def _call(self, fn, *args: Any, **kwargs: Any) -> Any:
        for attempt in Retrying(stop=stop_after_attempt(3), reraise=True,
                                wait=wait_exponential(multiplier=0.2, max=1.0),
                                retry=retry_if_exception(_transient)):
            with attempt:
                return fn(*args, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
        raise AssertionError("unreachable")

    def patch_status(self, fields: dict[str, Any]) -> None:
        s = self.settings
        self._call(self.custom.patch_namespaced_custom_object_status, GROUP, VERSION,
                   s.namespace, PLURAL, s.name, {"status": fields})

    def create_event(self, event: dict[str, Any]) -> None:
        s, client = self.settings, self.client
        if self.uid is None:
            run = self._call(self.custom.get_namespaced_custom_object, GROUP, VERSION,
                             s.namespace, PLURAL, s.name)
            self.uid = run["metadata"]["uid"]
        component = f"ance-train-{self.role}"
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=f"{s.name}.{uuid.uuid4().hex[:16]}",
                                         namespace=s.namespace),
            involved_object=client.V1ObjectReference(
                api_version=f"{GROUP}/{VERSION}", kind=KIND, name=s.name,
                namespace=s.namespace, uid=self.uid),
            reason=event["reason"], message=event["message"], type=event["type"], count=1,
            first_timestamp=event["time"], last_timestamp=event["time"],
            source=client.V1EventSource(component=component, host=self.instance),
            reporting_component=component, reporting_instance=self.instance)
        self._call(self.core.create_namespaced_event, s.namespace, body)


class RunReporter:
    """Queues AnceRun status fields and Events; a background thread sends them.

    Disabled (every method a no-op) when built without settings.
    """

    def __init__(self, settings: KubeSettings | None, role: str, instance: str,
                 min_interval_s: float = 3.0, max_backoff_s: float = 15.0) -> None:
        self.settings = settings
        self.role = role
        self.instance = instance
        self.min_interval_s = min_interval_s
        self.max_backoff_s = max_backoff_s
        self._cond = threading.Condition()
        self._status: dict[str, Any] = {}
        self._events: list[dict[str, Any]] = []
        self._urgent = False
        self._closing = False
        self._next_status_at = 0.0
        self._retry_at = 0.0
        self._failures = 0
        self._last_error_log = -ERROR_LOG_INTERVAL_S
        self._suppressed = 0
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.settings is not None

    @property
    def _sending(self) -> KubeSettings:
        """The settings, on the paths only an enabled reporter takes (its sending thread)."""
        assert self.settings is not None
        return self.settings

    @classmethod
    def from_env(cls, role: str, instance: str) -> RunReporter:
        return cls(KubeSettings.from_env(), role, instance)

    @classmethod
    def disabled(cls) -> RunReporter:
        """A reporter that sends nothing (no AnceRun: tests, tools)."""
        return cls(None, "", "")

    # -- what the services call --------------------------------------------------------------
    def start(self) -> RunReporter:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="anceruns", daemon=True)
            self._thread.start()
        return self

    def update(self, urgent: bool = False, **fields: Any) -> None:
        """Merge status fields; sent within ``min_interval_s`` (at once when ``urgent``)."""
        if not self.enabled:
            return
        with self._cond:
            self._status.update(fields)
            self._urgent = self._urgent or urgent
            self._cond.notify()

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        if not self.enabled:
            return
        with self._cond:
            self._events.append({"reason": reason, "type": "Warning" if warning else "Normal",
                                 "message": redact(message)[:MAX_MESSAGE_CHARS],
                                 "time": datetime.now(UTC)})
            self._drop_oldest_events()
            self._cond.notify()

    def failed(self, error: BaseException, restarting: bool = False) -> None:
        """An unhandled exception: the trainer's fails the run, any other is a ServiceFailed.
        ``restarting``: a trainer rank whose group torch.distributed.run starts again
        (``--max-restarts`` not used up): a RankFailed warning, the run goes on."""
        message = redact(f"{self.role} {self.instance}: {type(error).__name__}: {error}")
        if self.role == "trainer" and restarting:
            self.event("RankFailed", f"{message} (torch.distributed.run restarts the ranks)",
                       warning=True)
        elif self.role == "trainer":
            self.update(urgent=True, phase="Failed", message=message[:MAX_MESSAGE_CHARS])
            self.event("RunFailed", message, warning=True)
        else:
            self.event("ServiceFailed", message, warning=True)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued (trying for at most ``timeout_s``), then stop the thread."""
        if self._thread is None:
            return
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("AnceRun %s: gave up sending %d status field(s) and %d event(s) "
                        "at shutdown", self._sending.name, len(self._status), len(self._events))
        self._thread = None

    # -- the sending thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            api = _AnceRunApi(self._sending, self.role, self.instance)
        except Exception as error:  # e.g. no service account token: report, never crash
            log.error("AnceRun reporting disabled: %s", redact(_describe(error)))
            return
        while True:
            with self._cond:
                while not self._due(time.monotonic()):
                    if self._closing and not (self._status or self._events):
                        return
                    self._cond.wait(timeout=0.25)
                status, self._status = self._status, {}
                events, self._events = self._events, []
                self._urgent = False
            self._send(api, status, events)

    def _due(self, now: float) -> bool:
        if now < self._retry_at:
            return False
        if self._events:
            return True
        return bool(self._status) and (self._urgent or self._closing
                                       or now >= self._next_status_at)

    def _send(self, api: _AnceRunApi, status: dict[str, Any], events: list[dict]) -> None:
        try:
            if status:
                self._unless_refused(api.patch_status, {**status, "updated": rfc3339_now()})
                status = {}
                self._next_status_at = time.monotonic() + self.min_interval_s
            while events:
                self._unless_refused(api.create_event, events[0])
                events.pop(0)
        except Exception as error:
            with self._cond:  # put back what was not sent; newer values win
                self._status = {**status, **self._status}
                self._events = events + self._events
                self._drop_oldest_events()
            self._failures += 1
            self._retry_at = time.monotonic() + min(self.max_backoff_s, 2.0 ** self._failures)
            self._log_failure(error)
            return
        if self._failures:
            log.info("AnceRun %s: reporting works again after %d failed attempt(s)",
                     self._sending.name, self._failures)
        self._failures = 0

    def _unless_refused(self, send, body: dict[str, Any]) -> None:
        """Send ``body``; one the server refuses as invalid is logged and dropped, not retried."""
        try:
            send(body)
        except Exception as error:
            if not _refused(error):
                raise
            log.error("AnceRun %s: the API server refused %s (%s); dropped", self._sending.name,
                      redact(str(body))[:MAX_MESSAGE_CHARS], redact(_describe(error)))

    def _drop_oldest_events(self) -> None:
        dropped = len(self._events) - MAX_QUEUED_EVENTS
        if dropped > 0:
            del self._events[:dropped]
            log.warning("AnceRun %s: dropped %d unsent event(s)", self._sending.name, dropped)

    def _log_failure(self, error: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_error_log < ERROR_LOG_INTERVAL_S:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} similar failure(s) not logged)" if self._suppressed else ""
        log.warning("cannot report to AnceRun %s/%s, will retry: %s%s", self._sending.namespace,
                    self._sending.name, redact(_describe(error)), more)
        self._last_error_log = now
        self._suppressed = 0
