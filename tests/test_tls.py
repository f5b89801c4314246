"""Encrypted and authenticated traffic: gRPC with TLS (and mutual TLS), Redis with TLS and the
run's ACL user of least privilege. Real servers on loopback, certificates made for the test
(dev/ance_train_dev/tls_certs.py): clients without the certificate, with another CA's, or with
the wrong ACL user are refused; the services' own client code works with the right ones."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from ance_train.infra import bus as bus_module
from ance_train.infra.bus import EventBus, RedisAuthError, WorkQueue
from ance_train.infra.proto import ance_pb2, ance_pb2_grpc
from ance_train.infra.rpc import GrpcServer, ServiceState, channel, fetch_status
from ance_train.infra.tls import (
    REDIS_ACL_COMMANDS,
    GrpcTls,
    TlsConfigError,
    redis_acl_rule,
    redis_client_options,
)
from ance_train.launcher.ports import free_port
from ance_train.launcher.redis_server import RedisServer
from ance_train.protocol.events import RunFinished
from ance_train.protocol.work import ShardKind, ShardWork

from ance_train_dev.servers import redis_tls_server
from ance_train_dev.tls_certs import SERVICE_NAME, Pki, make_pki

RUN = "tls-run"
ACL_USER = "ance-run"
ACL_PASSWORD = "acl-password-for-the-test"
ADMIN_PASSWORD = "admin-password-for-the-test"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _read(path: Path) -> bytes:
    return path.read_bytes()


def _status(address: str, tls: GrpcTls | bool) -> ance_pb2.StatusReply:
    with channel(address, tls=tls or False) as ch:
        return ance_pb2_grpc.ControlStub(ch).Status(ance_pb2.StatusRequest(), timeout=5)


def _refused(address: str, tls: GrpcTls | bool) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _status(address, tls)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.fixture
def tls_server(pki: Pki) -> Iterator[GrpcServer]:
    server_tls = GrpcTls(ca=_read(pki.ca), cert=_read(pki.server_cert), key=_read(pki.server_key))
    server = GrpcServer(ServiceState("indexer", RUN, "indexer-0"), tls=server_tls).start()
    yield server
    server.stop(grace_s=0.1)


def test_grpc_tls_accepts_a_client_with_the_ca_and_refuses_the_others(
        tls_server: GrpcServer, pki: Pki) -> None:
    assert _status(tls_server.address, GrpcTls(ca=_read(pki.ca))).instance == "indexer-0"
    _refused(tls_server.address, False)  # plaintext
    _refused(tls_server.address, GrpcTls(ca=_read(pki.other_ca)))  # does not trust the server
    # The certificate names the service, not the pod IP the registry advertises: the name
    # checked is ANCE_GRPC_TLS_SERVER_NAME's, and a name the certificate lacks is refused.
    assert _status(tls_server.address, GrpcTls(ca=_read(pki.ca), server_name=SERVICE_NAME)).role
    _refused(tls_server.address, GrpcTls(ca=_read(pki.ca), server_name="someone-else.svc"))


def test_grpc_mutual_tls_refuses_a_client_without_a_certificate_of_the_ca(pki: Pki) -> None:
    mutual = GrpcTls(ca=_read(pki.ca), cert=_read(pki.server_cert), key=_read(pki.server_key),
                     mutual=True)
    server = GrpcServer(ServiceState("trainer", RUN, "trainer-0"), tls=mutual).start()
    try:
        client = GrpcTls(ca=_read(pki.ca), cert=_read(pki.client_cert),
                         key=_read(pki.client_key), mutual=True)
        assert _status(server.address, client).instance == "trainer-0"
        assert _status(server.address, mutual).instance == "trainer-0"  # service to service
        _refused(server.address, GrpcTls(ca=_read(pki.ca)))  # no client certificate
        _refused(server.address, GrpcTls(ca=_read(pki.ca), cert=_read(pki.other_client_cert),
                                          key=_read(pki.other_client_key), mutual=True))
        _refused(server.address, False)
    finally:
        server.stop(grace_s=0.1)


def _grpc_env(pki: Pki, mutual: bool) -> dict[str, str]:
    return {"ANCE_GRPC_TLS": "1", "ANCE_GRPC_TLS_CA": str(pki.ca),
            "ANCE_GRPC_TLS_CERT": str(pki.server_cert), "ANCE_GRPC_TLS_KEY": str(pki.server_key),
            "ANCE_GRPC_TLS_MUTUAL": "1" if mutual else "0",
            "ANCE_GRPC_TLS_SERVER_NAME": SERVICE_NAME}


def test_tls_settings_from_the_environment_name_what_is_wrong(pki: Pki, tmp_path: Path) -> None:
    assert GrpcTls.from_env({}) is None  # off by default: plaintext (the embedded launcher)
    settings = GrpcTls.from_env(_grpc_env(pki, mutual=True))
    assert settings is not None and settings.mutual and settings.server_name == SERVICE_NAME
    with pytest.raises(TlsConfigError, match="ANCE_GRPC_TLS_CA is required with ANCE_GRPC_TLS=1"):
        GrpcTls.from_env({"ANCE_GRPC_TLS": "1"})
    with pytest.raises(TlsConfigError, match="ANCE_GRPC_TLS_CERT is required with "
                                             "ANCE_GRPC_TLS_MUTUAL=1"):
        GrpcTls.from_env({"ANCE_GRPC_TLS": "1", "ANCE_GRPC_TLS_CA": str(pki.ca),
                          "ANCE_GRPC_TLS_MUTUAL": "1"})
    missing = tmp_path / "nope.crt"
    with pytest.raises(TlsConfigError, match=f"ANCE_GRPC_TLS_CA={missing}: cannot read"):
        GrpcTls.from_env({"ANCE_GRPC_TLS": "1", "ANCE_GRPC_TLS_CA": str(missing)})
    with pytest.raises(TlsConfigError, match="ANCE_GRPC_TLS_CERT and ANCE_GRPC_TLS_KEY"):
        GrpcServer(ServiceState("indexer", RUN, "x"), tls=GrpcTls(ca=_read(pki.ca)))
    with pytest.raises(TlsConfigError, match="ANCE_REDIS_TLS_CA set but the Redis URL is not "
                                             "rediss://"):
        redis_client_options("redis://127.0.0.1:1/0", {"ANCE_REDIS_TLS_CA": str(pki.ca)})


# -- Redis: the run's ACL user -----------------------------------------------------------------
def _acl_args() -> list[str]:
    """The ACL user as redis.conf / the chart's redis-server arguments declare it."""
    return ["--user", ACL_USER, "on", f">{ACL_PASSWORD}", *redis_acl_rule(RUN)]


def _use_acl_user(monkeypatch: pytest.MonkeyPatch, password: str = ACL_PASSWORD) -> None:
    monkeypatch.setenv("ANCE_REDIS_USERNAME", ACL_USER)
    monkeypatch.setenv("ANCE_REDIS_PASSWORD", password)


def _exercise_bus(client: redis.Redis) -> None:
    """Every kind of Redis call the services make (infra/bus.py and the inferencer's script)."""
    bus = EventBus(client, RUN)
    bus.publish(RunFinished(step=1))
    received = bus.consume(RunFinished, "launcher", "c-1", block_ms=100)
    assert [r.event.step for r in received] == [1]
    bus.ack(RunFinished, "launcher", received[0].entry_id)
    assert [r.event.step for r in bus.read_all(RunFinished)] == [1]
    assert [r.event.step for r in bus.history(RunFinished)] == [1]
    assert bus.last_entry_id(RunFinished) == received[0].entry_id
    queue = WorkQueue(bus, claim_timeout_s=0.0)
    queue.enqueue([ShardWork(step=0, kind=ShardKind("corpus"), shard=0, start=0, stop=4)])
    item = queue.claim("inferencer-0", block_ms=100)
    assert item is not None and item.stop == 4
    queue.heartbeat("inferencer-0", item)
    assert queue.pending_count() == 1
    again = queue.claim("inferencer-1", block_ms=100)  # XAUTOCLAIM of an idle item
    assert again is not None and again.attempt == 2
    queue.done(again)
    bus.dead_letter(bus.stream(RunFinished), "1-0", {"data": "junk"}, ValueError("bad"))
    assert [d.error for d in bus.dead_letters()] == ["bad"]
    bus.set_latest_checkpoint(3)
    assert bus.latest_checkpoint() == 3
    bus.register("indexer", "indexer-0", "10.0.0.1:50051")
    assert bus.services() == {"indexer:indexer-0": "10.0.0.1:50051"}
    # Supersession's markers (the inferencers' atomic raise is a Lua script the ACL user must
    # be able to run on a key of its run): the latest checkpoint's item is worth encoding and
    # raises the refresh under way; an overtaken one is not; checkpoint 0 always is, and
    # never lowers the marker.
    bus.set_latest_checkpoint(5)
    assert bus.start_encoding(5) and bus.refresh_under_way() == 5
    bus.set_latest_checkpoint(8)
    assert not bus.start_encoding(2) and bus.refresh_under_way() == 5
    assert bus.start_encoding(0) and bus.refresh_under_way() == 5


def test_redis_acl_user_runs_the_bus_and_nothing_else(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with RedisServer(tmp_path / "redis", password=ADMIN_PASSWORD,
                     extra_args=_acl_args()) as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        _use_acl_user(monkeypatch)
        client = bus_module.connect(url)
        _exercise_bus(client)
        # Outside the run's keys, or a command not on the list: refused.
        for forbidden in (lambda: client.get("elsewhere"),
                          lambda: client.set("ance:other-run:checkpoint:latest", 1),
                          lambda: client.xadd("ance:other-run:run.finished", {"data": "x"}),
                          lambda: client.flushall(), lambda: client.config_get("*"),
                          lambda: client.keys("*"), lambda: client.delete(f"ance:{RUN}:x"),
                          lambda: client.execute_command("ACL", "LIST"),
                          lambda: client.eval("return 1", 0),  # only the loaded script
                          lambda: client.publish("ance", "x")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
        # A wrong password, or the right password for another user: refused, not retried.
        _use_acl_user(monkeypatch, password="wrong-password")
        with pytest.raises(RedisAuthError, match="ANCE_REDIS_USERNAME and ANCE_REDIS_PASSWORD"):
            bus_module.connect(url).ping()
        _use_acl_user(monkeypatch)
        monkeypatch.setenv("ANCE_REDIS_USERNAME", "default")
        with pytest.raises(RedisAuthError):
            bus_module.connect(url).ping()
        # The data is all there for the administrator: the ACL user wrote where it should.
        admin = redis.Redis(port=server.port, password=ADMIN_PASSWORD, decode_responses=True)
        assert set(admin.keys("*")) and all(key.startswith(f"ance:{RUN}:")
                                            for key in admin.keys("*"))
        rule, = [line for line in admin.execute_command("ACL", "LIST")
                 if line.startswith(f"user {ACL_USER} ")]
        assert f" ~ance:{RUN}:* " in rule and " ~* " not in rule and "+@all" not in rule
        assert len(REDIS_ACL_COMMANDS) == len(set(REDIS_ACL_COMMANDS))


# -- Redis over TLS ----------------------------------------------------------------------------
@pytest.fixture
def tls_redis(tmp_path: Path, pki: Pki) -> Iterator[int]:
    """A TLS-built redis-server: TLS port with client certificates required, the ACL user; its
    plaintext port is only for RedisServer's own readiness check. Yields the TLS port."""
    binary, env = redis_tls_server()
    tls_port = free_port()
    with RedisServer(tmp_path / "redis", password=ADMIN_PASSWORD, binary=binary, env=env,
                     extra_args=["--tls-port", str(tls_port), "--tls-cert-file",
                                 str(pki.server_cert), "--tls-key-file", str(pki.server_key),
                                 "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "yes",
                                 *_acl_args()]):
        yield tls_port


def _direct(url: str, env: dict[str, str]) -> redis.Redis:
    """The project's client options (tls.redis_client_options) without bus.connect's retries:
    a refused handshake fails at once."""
    return redis.Redis.from_url(url, password=ACL_PASSWORD, socket_connect_timeout=5,
                                **redis_client_options(url, env))


def test_redis_tls_refuses_clients_without_the_certificates(tls_redis: int, pki: Pki) -> None:
    url = f"rediss://127.0.0.1:{tls_redis}/0"
    good = {"ANCE_REDIS_USERNAME": ACL_USER, "ANCE_REDIS_TLS_CA": str(pki.ca),
            "ANCE_REDIS_TLS_CERT": str(pki.client_cert), "ANCE_REDIS_TLS_KEY": str(pki.client_key)}
    assert _direct(url, good).ping()
    for refused in (
        {k: v for k, v in good.items() if k != "ANCE_REDIS_TLS_CA"},  # does not trust the server
        {**good, "ANCE_REDIS_TLS_CA": str(pki.other_ca)},
        {"ANCE_REDIS_USERNAME": ACL_USER, "ANCE_REDIS_TLS_CA": str(pki.ca)},  # no client cert
        {**good, "ANCE_REDIS_TLS_CERT": str(pki.other_client_cert),
         "ANCE_REDIS_TLS_KEY": str(pki.other_client_key)},
    ):
        with pytest.raises(redis.ConnectionError):
            _direct(url, refused).ping()
    with pytest.raises(redis.ConnectionError):  # plaintext on the TLS port
        _direct(f"redis://127.0.0.1:{tls_redis}/0", {"ANCE_REDIS_USERNAME": ACL_USER}).ping()
    with pytest.raises(redis.AuthenticationError):  # TLS is fine, the ACL user is not
        _direct(url, {**good, "ANCE_REDIS_USERNAME": "default"}).ping()


def test_services_bus_and_rpc_work_over_tls_with_the_acl_user(
        tls_redis: int, pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a service does at start, configured as the chart configures it: Redis over TLS as
    the ACL user (bus.connect), a mutual-TLS gRPC server registered in the run's registry, and
    `ance-train status`'s path: read the registry, call Control.Status over mutual TLS."""
    for name, value in {**_grpc_env(pki, mutual=True), "ANCE_REDIS_TLS_CA": str(pki.ca),
                        "ANCE_REDIS_TLS_CERT": str(pki.client_cert),
                        "ANCE_REDIS_TLS_KEY": str(pki.client_key)}.items():
        monkeypatch.setenv(name, value)
    _use_acl_user(monkeypatch)
    client = bus_module.connect(f"rediss://127.0.0.1:{tls_redis}/0")
    bus_module.wait_for_redis(client, timeout_s=10)
    _exercise_bus(client)
    server = GrpcServer(ServiceState("indexer", RUN, "indexer-7")).start()  # TLS from the env
    try:
        bus = EventBus(client, RUN)
        bus.register("indexer", "indexer-7", server.address)
        address = bus.services()["indexer:indexer-7"]
        assert fetch_status(address).instance == "indexer-7"
        # The chart's probe with gRPC TLS (native grpc probes cannot speak TLS): it dials
        # loopback and checks the certificate's service name, with the service's environment.
        probe = [sys.executable, "-m", "ance_train.infra.health_probe", str(server.port)]
        answer = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert (answer.returncode, answer.stdout.strip()) == (0, "SERVING"), answer.stderr
        monkeypatch.setenv("ANCE_GRPC_TLS", "0")  # a plaintext client of the same code path
        with pytest.raises(grpc.RpcError):
            fetch_status(address)
        answer = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert answer.returncode == 1 and "UNAVAILABLE" in answer.stderr
    finally:
        server.stop(grace_s=0.1)
