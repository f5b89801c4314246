"""Bad input that the other test files do not cover: Search requests over real gRPC, an
oversized gRPC message, a model directory that is not an encoder, and ``run --overwrite``
with a bad configuration or model leaving the previous run untouched.

(Malformed JSONL/TSV, non-UTF-8 bytes, empty documents, duplicate ids, unknown qrels ids and
an empty training set are in test_data.py; unknown and impossible config fields in
test_config.py; a bad dataset with ``--overwrite`` in test_launcher.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from ance_train.config import DataConfig
from ance_train.data.corpus import open_corpus
from ance_train.data.validation import validate_dataset
from ance_train.index.ann import AnnIndex
from ance_train.indexer.search_service import MAX_K, MAX_QUERIES, SearchService, ServedIndex
from ance_train.infra.rpc import MAX_MESSAGE_BYTES, GrpcServer, ServiceState, search

from ance_train_dev.helpers import write_config

DIM = 8


@pytest.fixture
def indexer_address(tmp_path: Path, scifact_subset: Path):
    """A gRPC server with Retrieval.Search over an index of 50 random 8-d documents."""
    cfg = DataConfig(path=str(scifact_subset))
    validate_dataset(cfg, tmp_path / "cache")
    index = AnnIndex(DIM)
    index.add(np.arange(50), np.random.default_rng(0).normal(size=(50, DIM)).astype(np.float32))
    index.finalize()
    service = SearchService(open_corpus(cfg, tmp_path / "cache"), models=None)
    service.serve(ServedIndex(3, index))
    server = GrpcServer(ServiceState("indexer", "bad-input", "indexer"),
                        add_servicers=service.add_to_server).start()
    try:
        yield server.address
    finally:
        server.stop(grace_s=0.1)


@pytest.mark.parametrize(("request_args", "message"), [
    ({"embeddings": [[1.0] * (DIM + 1)], "k": 3}, f"embeddings must have dimension {DIM}, got [9]"),
    ({"embeddings": [[1.0] * DIM, [1.0] * 2], "k": 3},
     f"embeddings must have dimension {DIM}, got [2, 8]"),
    ({"embeddings": [[1.0] * DIM], "k": 0}, f"k must be in [1, {MAX_K}], got 0"),
    ({"embeddings": [[1.0] * DIM], "k": MAX_K + 1}, f"k must be in [1, {MAX_K}], got {MAX_K + 1}"),
    ({"queries": ["x"], "embeddings": [[1.0] * DIM], "k": 3},
     "give either queries (texts) or embeddings, not both or neither"),
    ({"embeddings": [[1.0] * DIM] * (MAX_QUERIES + 1), "k": 3},
     f"at most {MAX_QUERIES} queries per request, got {MAX_QUERIES + 1}"),
])
def test_bad_search_request_is_invalid_argument(indexer_address: str, request_args: dict,
                                                message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        search(indexer_address, **request_args)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == message
    reply = search(indexer_address, embeddings=[[1.0] * DIM], k=5)  # still serving
    assert reply.index_step == 3 and len(reply.results[0].hits) == 5


def test_oversized_message_is_refused_and_server_keeps_serving(indexer_address: str) -> None:
    oversized = b"\x00" * (MAX_MESSAGE_BYTES + 1024)
    # A client without the size limit, so that the message really reaches the server.
    with grpc.insecure_channel(indexer_address,
                               options=[("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_unary("/ance.v1.Retrieval/Search",
                                   request_serializer=lambda raw: raw,
                                   response_deserializer=lambda raw: raw)
        with pytest.raises(grpc.RpcError) as info:
            call(oversized, timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (f"Received message larger than max ({len(oversized)} vs. {MAX_MESSAGE_BYTES})"
            in info.value.details())
    reply = search(indexer_address, embeddings=[[0.5] * DIM], k=2)
    assert [len(hits.hits) for hits in reply.results] == [2]


def _ance(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400"}  # rich must not wrap the message being checked
    return subprocess.run([sys.executable, "-m", "ance_train.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def _not_an_encoder(root: Path) -> Path:
    directory = root / "not-a-model"
    directory.mkdir()
    (directory / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    return directory


@pytest.mark.parametrize("fault", ["impossible config value", "model is not an encoder"])
def test_overwrite_with_bad_input_keeps_the_previous_run(tmp_path: Path, scifact_subset: Path,
                                                         tiny_model: Path, fault: str) -> None:
    previous = tmp_path / "runs" / "keep"
    (previous / "store").mkdir(parents=True)
    (previous / "store" / "results.json").write_text('{"ndcg@10": 0.7}')
    model, training = str(tiny_model), {"steps": 5, "refresh_every": 5}
    if fault == "impossible config value":
        training["steps"] = 0
    else:
        model = str(_not_an_encoder(tmp_path))
    config = write_config(tmp_path / "run.yaml", run_id="keep", output_dir=str(tmp_path / "runs"),
                          data={"path": str(scifact_subset)}, model={"path": model},
                          training=training)

    result = _ance("run", "--config", str(config), "--overwrite")

    if fault == "impossible config value":
        assert result.returncode == 2
        assert (f"invalid configuration in {config}:\n  training.steps: Input should be greater "
                "than or equal to 1") in result.stderr
    else:
        assert result.returncode == 1
        assert (f"error: model directory {model}: no config.json (not a Hugging Face model)"
                in result.stderr)
    # Nothing was started or written: the earlier run is exactly as it was.
    assert sorted(p.relative_to(previous).as_posix() for p in previous.rglob("*")) == [
        "store", "store/results.json"]
    assert (previous / "store" / "results.json").read_text() == '{"ndcg@10": 0.7}'
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["keep"]


def test_validate_names_a_model_directory_that_is_not_an_encoder(tmp_path: Path,
                                                                 scifact_subset: Path) -> None:
    from transformers import T5Config, T5Model

    t5 = tmp_path / "t5"
    T5Model(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
            ).save_pretrained(t5, safe_serialization=True)
    config = write_config(tmp_path / "run.yaml", data={"path": str(scifact_subset)},
                          model={"path": str(t5)})
    result = _ance("validate", "--config", str(config))
    assert result.returncode == 1
    assert f"error: model directory {t5}: t5 is not a text encoder" in result.stderr
    assert "ok:" not in result.stdout
