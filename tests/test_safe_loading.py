"""Untrusted bytes never run code and never leave the run: safetensors-only model loading, and
object-store keys confined to the run's prefix (local directory and S3 via moto)."""

from __future__ import annotations

import pickle
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig, BertModel

from ance_train.config import ModelConfig
from ance_train.infra.store import LocalStore, ObjectStore, S3Store, StorageError
from ance_train.modeling.model import BiEncoder, ModelLoadError


class _Payload:
    """A pickle that creates ``marker`` when unpickled: proof that a loader ran it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _config() -> BertConfig:
    return BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                      num_attention_heads=2, intermediate_size=32)


def _plant_pickle(directory: Path, marker: Path) -> None:
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))


def test_pickle_only_model_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "bin-only"
    _config().save_pretrained(directory)  # a legacy checkpoint: config + pickled weights
    marker = tmp_path / "pickle-ran"
    _plant_pickle(directory, marker)
    with pytest.raises(ModelLoadError) as info:
        BiEncoder.from_pretrained(directory, ModelConfig(path=str(directory)))
    message = str(info.value)
    assert str(directory) in message
    assert "pytorch_model.bin" in message and "safetensors" in message
    assert not marker.exists(), "the pickle was unpickled"


def test_safetensors_win_over_a_pickle_beside_them(tmp_path: Path) -> None:
    directory = tmp_path / "both"
    BertModel(_config()).save_pretrained(directory, safe_serialization=True)
    marker = tmp_path / "pickle-ran"
    _plant_pickle(directory, marker)
    model = BiEncoder.from_pretrained(directory, ModelConfig(path=str(directory)))
    stored = load_file(str(directory / "model.safetensors"))
    loaded = model.encoder.state_dict()
    assert stored and all(torch.equal(loaded[name], tensor) for name, tensor in stored.items()
                          if name in loaded)
    assert not marker.exists(), "the pickle was unpickled"


# --------------------------------------------------------------------------- store keys

ESCAPES = ["../{t}", "a/../../{t}", "/{t}", "/tmp/{t}", "a\\..\\..\\{t}", "..\\{t}",
           "a//{t}", "./{t}", "checkpoints/0/../../../other-run/{t}", "{t}/"]


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    run_id = f"confined-{uuid.uuid4().hex[:8]}"
    if request.param == "local":
        return LocalStore(run_id, tmp_path / "root" / "store")
    env = request.getfixturevalue("s3_env")
    return S3Store(run_id, env["ANCE_S3_ENDPOINT"], env["ANCE_S3_ACCESS_KEY"],
                   env["ANCE_S3_SECRET_KEY"], env["ANCE_S3_BUCKET"], retry_seconds=5)


def _every_name(store: ObjectStore, tmp_path: Path) -> list[str]:
    """Every object or file name the backend holds, runs and bucket included."""
    if isinstance(store, S3Store):
        return [o.object_name for o in store.client.list_objects(store.bucket, recursive=True)]
    return [str(p) for p in tmp_path.rglob("*")]


@pytest.mark.parametrize("template", ESCAPES)
def test_keys_escaping_the_run_are_rejected(store: ObjectStore, template: str,
                                            tmp_path: Path) -> None:
    token = f"escaped-{uuid.uuid4().hex[:8]}"
    key = template.format(t=token)
    source = tmp_path / "source"
    source.mkdir(exist_ok=True)
    (source / "file").write_bytes(b"payload")
    attempts = {
        "put_bytes": lambda: store.put_bytes(key, b"payload"),
        "put_json": lambda: store.put_json(key, {"a": 1}),
        "put_file": lambda: store.put_file(key, source / "file"),
        "put_dir": lambda: store.put_dir(key, source),
        "get_bytes": lambda: store.get_bytes(key),
        "get_file": lambda: store.get_file(key, tmp_path / "out"),
        "get_dir": lambda: store.get_dir(key, tmp_path / "out-dir"),
        "exists": lambda: store.exists(key),
        "delete": lambda: store.delete(key),
        "list": lambda: store.list(key),
    }
    for operation, attempt in attempts.items():
        if operation in ("list", "put_dir", "get_dir") and key.endswith("/"):
            continue  # a trailing slash is a valid way to write a directory-like prefix
        with pytest.raises(StorageError) as info:
            attempt()
        assert repr(key) in str(info.value), (operation, str(info.value))
    assert not [name for name in _every_name(store, tmp_path) if token in name]
