"""A resident model takes a checkpoint's weights straight from the store, verified as read.

``ObjectStore.open_verified`` streams an object into the caller's buffers, hashing each chunk
as it lands (the local store) or after downloading it whole (the default); ``weight_swap``
reads a safetensors object into a module's own tensors with it; ``ModelCache`` (reuse) swaps
weights that way, bit for bit what a full load gives, and drops its resident model when the
weights fail their checksum (issue 31).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file
from torch import nn
from transformers import BertConfig, BertModel

from ance_train.config import ModelConfig, default_model_path
from ance_train.infra.store import CorruptObject, LocalStore, ObjectStore
from ance_train.modeling.checkpoint_cache import ENCODER_WEIGHTS, ModelCache
from ance_train.modeling.encoding import prepare_model
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.modeling.weight_swap import plan_read, read_into
from ance_train.protocol import keys


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def _object_path(store: LocalStore, key: str) -> Path:
    return store.root / store.run_id / key


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))  # in place, same size; the recorded sha256 stays


@pytest.mark.parametrize("streamed", [True, False], ids=["local", "downloaded-whole"])
def test_a_verified_read_checks_the_bytes_the_caller_holds(tmp_path, streamed) -> None:
    store = LocalStore("verified", tmp_path / "store")
    data = bytes(range(256)) * 5000  # several chunks
    store.put_bytes("blob", data)
    open_verified = store.open_verified if streamed else (
        lambda key: ObjectStore.open_verified(store, key))
    buffer = bytearray(len(data))
    with open_verified("blob") as reader:
        assert reader.size == len(data)
        reader.readinto(memoryview(buffer))
        reader.verify()
    assert buffer == data
    with open_verified("blob") as reader, pytest.raises(CorruptObject, match="blob"):
        reader.readinto(memoryview(bytearray(10)))
        reader.verify()  # not read whole
    with open_verified("blob") as reader, pytest.raises(CorruptObject, match="ends after"):
        reader.readinto(memoryview(bytearray(len(data) + 1)))
    _flip_last_byte(_object_path(store, "blob"))
    with pytest.raises(CorruptObject, match="sha256"), open_verified("blob") as reader:
        reader.readinto(memoryview(bytearray(len(data))))
        reader.verify()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_safetensors_object_lands_in_the_module_as_load_state_dict_puts_it(
        tmp_path, dtype) -> None:
    store = LocalStore("swap", tmp_path / "store")
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    store.put_bytes("w", save({k: v.contiguous() for k, v in source.state_dict().items()}))
    resident = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)).to(dtype)
    reference = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)).to(dtype)
    reference.load_state_dict(source.state_dict())
    with store.open_verified("w") as reader:
        plan = plan_read(reader, resident)
        assert plan is not None
        read_into(reader, plan)
    for name, tensor in resident.state_dict().items():
        expected = reference.state_dict()[name]
        assert tensor.dtype == dtype and torch.equal(tensor, expected), name

    before = {k: v.clone() for k, v in resident.state_dict().items()}
    for other in (nn.Sequential(nn.Linear(4, 2), nn.LayerNorm(2)),  # other shapes
                  nn.Sequential(nn.Linear(4, 3))):                   # other names
        save_file({k: v.contiguous() for k, v in other.state_dict().items()},
                  str(tmp_path / "other"))
        store.put_file("other", tmp_path / "other")
        with store.open_verified("other") as reader:
            assert plan_read(reader, resident) is None
    assert all(torch.equal(before[k], v) for k, v in resident.state_dict().items())


def _checkpoint(store: LocalStore, step: int, model: BiEncoder, tokenizer, root: Path) -> None:
    directory = root / f"ckpt-{step}"
    model.save(directory, tokenizer)
    prefix = keys.checkpoint(step)
    files = store.put_files(prefix, directory, store.dir_files(directory), share=True)
    store.put_manifest(prefix, files, keys.CHECKPOINT_WEIGHTS_MANIFEST)


def _tiny(tokenizer, seed: int) -> BiEncoder:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    return BiEncoder(BertModel(config), projection_dim=16).eval()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_swapped_weights_with_a_head_are_a_full_load_and_corrupt_ones_drop_the_model(
        tokenizer, tmp_path, precision) -> None:
    store = LocalStore("cache", tmp_path / "store")
    for step in range(3):
        _checkpoint(store, step, _tiny(tokenizer, step), tokenizer, tmp_path)
    config = ModelConfig(path=str(tmp_path))

    def cache(name: str, reuse: bool) -> ModelCache:
        return ModelCache(store, config, tmp_path / name, torch.device("cpu"),
                          prepare=lambda m: prepare_model(m, precision), reuse=reuse)

    resident = cache("resident", reuse=True)
    resident.get(0)
    model, _ = resident.get(1)
    assert resident.reloaded is False and model.projection is not None
    fresh, _ = cache("fresh", reuse=False).get(1)
    reference = fresh.state_dict()
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name])

    _flip_last_byte(_object_path(store, f"{keys.checkpoint(2)}/{ENCODER_WEIGHTS}"))
    with pytest.raises(CorruptObject, match="sha256"):
        resident.get(2)  # read into the resident model, then found corrupt: it is dropped
    assert resident.model is None and resident.step is None
    model, _ = resident.get(1)  # loaded whole again
    assert resident.reloaded is True
    assert all(torch.equal(t, reference[n]) for n, t in model.state_dict().items())
