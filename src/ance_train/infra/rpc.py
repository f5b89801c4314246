"""gRPC plumbing shared by the services: health + Control.Status, and client helpers.

Every server and channel of the project is made here, so that TLS (``ANCE_GRPC_TLS*``,
:class:`ance_train.infra.tls.GrpcTls`) covers all of them; off by default (plaintext, as the
embedded launcher's services on loopback use it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ance_train.infra.proto import ance_pb2, ance_pb2_grpc
from ance_train.infra.tls import GrpcTls

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class ServiceState:
    """What a service reports through ``Control.Status``; updated by the service's threads."""

    role: str
    run_id: str
    instance: str
    step: int = 0
    checkpoint_step: int = -1
    index_step: int = -1
    phase: str = "starting"
    done: int = 0
    total: int = 0
    state: str = "starting"
    message: str = ""
    store_bytes: int = -1  # the run's store size at the service's last listing; -1: none yet
    metrics: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def update(self, **changes: Any) -> None:
        with self.lock:
            metrics = changes.pop("metrics", None)
            for name, value in changes.items():
                setattr(self, name, value)
            if metrics:
                self.metrics.update({k: float(v) for k, v in metrics.items() if v is not None})

    def to_proto(self) -> ance_pb2.StatusReply:
        with self.lock:
            return ance_pb2.StatusReply(
                role=self.role, run_id=self.run_id, instance=self.instance, step=self.step,
                checkpoint_step=self.checkpoint_step, index_step=self.index_step,
                progress=ance_pb2.Progress(phase=self.phase, done=self.done, total=self.total),
                metrics=dict(self.metrics), state=self.state, message=self.message,
                store_bytes=self.store_bytes,
            )


class _Control(ance_pb2_grpc.ControlServicer):
    def __init__(self, state: ServiceState) -> None:
        self.state = state

    def Status(self, request, context):
        return self.state.to_proto()


class GrpcServer:
    """A gRPC server with the health service and Control.Status; more servicers may be added.

    ``tls``: the TLS settings; None: those of the environment; False: plaintext."""

    def __init__(self, state: ServiceState, port: int = 0, host: str = "127.0.0.1",
                 add_servicers: Callable[[grpc.Server], None] | None = None,
                 max_workers: int = 8, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_concurrent_rpcs: int | None = None,
                 tls: GrpcTls | Literal[False] | None = None) -> None:
        # Limits (the indexer's from ``index.search``): a larger message is RESOURCE_EXHAUSTED;
        # beyond ``max_concurrent_rpcs`` in flight gRPC answers RESOURCE_EXHAUSTED at once
        # instead of queueing for the workers without bound (None: no cap).
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        # Shut down with the server (stop): its idle workers would otherwise keep the process
        # from ending without the interpreter's teardown (infra/process.py).
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers)
        self.server = grpc.server(self._executor,
                                  options=options, maximum_concurrent_rpcs=max_concurrent_rpcs)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        ance_pb2_grpc.add_ControlServicer_to_server(_Control(state), self.server)
        if add_servicers is not None:
            add_servicers(self.server)
        self.tls = GrpcTls.from_env() if tls is None else tls or None
        bind = f"{host}:{port}"
        self.port = (self.server.add_secure_port(bind, self.tls.server_credentials()) if self.tls
                     else self.server.add_insecure_port(bind))
        if self.port == 0:
            raise RuntimeError(f"cannot bind gRPC port {host}:{port}")
        self.host = host

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "[::]") else self.host
        return f"{host}:{self.port}"

    def start(self) -> GrpcServer:
        self.server.start()
        self.set_serving(True)
        return self

    def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        self.health.set("", status)

    def stop(self, grace_s: float = 2.0) -> None:
        self.set_serving(False)
        self.server.stop(grace_s).wait()
        self._executor.shutdown(wait=True)


def channel(address: str, tls: GrpcTls | Literal[False] | None = None) -> grpc.Channel:
    """A channel to ``address``; TLS as ``tls`` says (None: the environment's settings;
    False: plaintext)."""
    settings = GrpcTls.from_env() if tls is None else tls or None
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    if settings is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, settings.channel_credentials(),
                               options=options + settings.channel_options())


def fetch_status(address: str, timeout_s: float = 3.0) -> ance_pb2.StatusReply:
    with channel(address) as ch:
        return ance_pb2_grpc.ControlStub(ch).Status(ance_pb2.StatusRequest(), timeout=timeout_s)


def check_health(address: str, timeout_s: float = 3.0) -> bool:
    with channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                     timeout=timeout_s)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def search(address: str, queries: list[str] | None = None,
           embeddings: list[list[float]] | None = None, k: int = 10,
           timeout_s: float = 30.0) -> ance_pb2.SearchReply:
    """Call ``Retrieval.Search`` on an indexer with query texts or query embeddings; the
    deadline (``timeout_s``) travels with the call and the server stops work once it passes."""
    request = ance_pb2.SearchRequest(
        queries=queries or [], k=k,
        embeddings=[ance_pb2.Embedding(values=vector) for vector in embeddings or []])
    with channel(address) as ch:
        return ance_pb2_grpc.RetrievalStub(ch).Search(request, timeout=timeout_s)
