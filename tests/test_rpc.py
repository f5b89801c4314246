"""Tests of the gRPC plumbing over loopback (infra/rpc.py) and of the generated proto code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from ance_train.infra.proto import ance_pb2
from ance_train.infra.rpc import GrpcServer, ServiceState, check_health, fetch_status

REPO = Path(__file__).resolve().parents[1]
PROTO_PACKAGE = REPO / "src" / "ance_train" / "infra" / "proto"


@pytest.fixture
def server():
    state = ServiceState(role="indexer", run_id="rpc-run", instance="indexer-0")
    srv = GrpcServer(state, port=0).start()
    try:
        yield srv, state
    finally:
        srv.stop(grace_s=0.1)


def test_health_is_serving(server) -> None:
    srv, _ = server
    assert srv.port > 0
    assert srv.address == f"127.0.0.1:{srv.port}"
    assert check_health(srv.address) is True
    srv.set_serving(False)
    assert check_health(srv.address) is False
    srv.set_serving(True)
    assert check_health(srv.address) is True


def test_fetch_status_reports_state_updates(server) -> None:
    srv, state = server
    reply = fetch_status(srv.address)
    assert isinstance(reply, ance_pb2.StatusReply)
    assert (reply.role, reply.run_id, reply.instance) == ("indexer", "rpc-run", "indexer-0")
    assert (reply.step, reply.checkpoint_step, reply.index_step) == (0, -1, -1)
    assert reply.state == "starting"
    assert dict(reply.metrics) == {}

    state.update(step=42, checkpoint_step=40, index_step=30, phase="mining", done=3, total=8,
                 state="running", message="busy",
                 metrics={"ndcg@10": 0.5, "docs/s": 1250, "skipped": None})
    state.update(metrics={"loss": 0.25})
    reply = fetch_status(srv.address)
    assert (reply.step, reply.checkpoint_step, reply.index_step) == (42, 40, 30)
    assert (reply.progress.phase, reply.progress.done, reply.progress.total) == ("mining", 3, 8)
    assert (reply.state, reply.message) == ("running", "busy")
    # Metrics merge across updates; None values are dropped.
    assert dict(reply.metrics) == {"ndcg@10": 0.5, "docs/s": 1250.0, "loss": 0.25}


def test_extra_servicers_can_be_added() -> None:
    added = []
    state = ServiceState(role="trainer", run_id="r", instance="t")
    srv = GrpcServer(state, add_servicers=added.append).start()
    try:
        assert added == [srv.server]
        assert fetch_status(srv.address).role == "trainer"
    finally:
        srv.stop(grace_s=0.1)


def test_after_stop_health_and_status_fail() -> None:
    state = ServiceState(role="inferencer", run_id="r", instance="inf-1")
    srv = GrpcServer(state).start()
    address = srv.address
    assert check_health(address)
    srv.stop(grace_s=0.1)
    with pytest.raises(grpc.RpcError) as info:
        check_health(address, timeout_s=1.0)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    with pytest.raises(grpc.RpcError):
        fetch_status(address, timeout_s=1.0)


def test_generated_code_matches_gen_proto_output(tmp_path: Path) -> None:
    """scripts/gen_proto.sh into a scratch directory reproduces the committed files byte for byte.

    The generated files embed the protobuf / grpcio-tools versions that produced them, so a
    mismatch usually means they were generated with other tool versions than installed.
    """
    out = tmp_path / "gen"
    out.mkdir()
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    bash = shutil.which("bash")
    assert bash is not None
    result = subprocess.run([bash, str(REPO / "scripts" / "gen_proto.sh"), str(out)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not (out / "ance").exists()
    for name in ("ance_pb2.py", "ance_pb2_grpc.py"):
        generated = (out / name).read_bytes()
        committed = (PROTO_PACKAGE / name).read_bytes()
        assert generated == committed, f"{name} differs from scripts/gen_proto.sh output"
    grpc_code = (out / "ance_pb2_grpc.py").read_text()
    assert "from . import ance_pb2 as" in grpc_code
    assert "from ance.v1 import" not in grpc_code
