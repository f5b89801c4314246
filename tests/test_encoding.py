"""encode_texts: order, padding-independence, batching variants (tiny random BERT, CPU)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel

from ance_train.config import default_model_path
from ance_train.modeling import encoding
from ance_train.modeling.encoding import (
    cpu_has_native_bf16,
    encode_ids,
    encode_texts,
    pad_token_id,
    plan_batches,
    prepare_model,
    resolve_precision,
    tokenize_texts,
)
from ance_train.modeling.model import BiEncoder, load_tokenizer

TEXTS = [
    "Dense retrieval with approximate nearest neighbour negatives.",
    "short",
    "",
    "A considerably longer document about cerebral white matter, diffusion tensor imaging, "
    "and the microstructural development of the newborn human brain assessed in vivo.",
    "Vitamin D deficiency and bone density.",
    "short",
    "Hard negatives mined from an asynchronously refreshed index improve training.",
]
MAX_LENGTH = 24  # below the longest text, so truncation is exercised


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def tiny_bi_encoder(tokenizer, similarity: str = "dot", pooling: str = "mean") -> BiEncoder:
    """A 2-layer, 32-wide randomly initialised BERT sharing the MiniLM vocabulary."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return BiEncoder(BertModel(config), pooling=pooling, similarity=similarity).eval()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_bi_encoder(tokenizer)


def one_by_one(model, tokenizer, texts) -> np.ndarray:
    """Each text encoded alone, unpadded: the reference for padding effects."""
    rows = []
    model.eval()
    for text in texts:
        enc = tokenizer(text, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
        with torch.inference_mode():
            rows.append(model(enc["input_ids"], enc["attention_mask"])[0].numpy())
    return np.stack(rows)


def test_shape_and_dtype(model, tokenizer):
    out = encode_texts(model, tokenizer, TEXTS, MAX_LENGTH, batch_size=4)
    assert out.shape == (len(TEXTS), model.dim)
    assert out.dtype == np.float32
    assert np.isfinite(out).all()


def test_empty_input(model, tokenizer):
    out = encode_texts(model, tokenizer, [], MAX_LENGTH)
    assert out.shape == (0, model.dim) and out.dtype == np.float32


def test_order_preserved(model, tokenizer):
    forward = encode_texts(model, tokenizer, TEXTS, MAX_LENGTH, batch_size=3)
    backward = encode_texts(model, tokenizer, TEXTS[::-1], MAX_LENGTH, batch_size=3)
    np.testing.assert_allclose(backward, forward[::-1], atol=1e-5)
    # Identical texts get identical rows.
    np.testing.assert_allclose(forward[1], forward[5], atol=1e-6)


def test_equals_encoding_each_text_alone(model, tokenizer):
    expected = one_by_one(model, tokenizer, TEXTS)
    out = encode_texts(model, tokenizer, TEXTS, MAX_LENGTH, batch_size=64)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_cls_pooling_unaffected_by_padding(tokenizer):
    cls_model = tiny_bi_encoder(tokenizer, pooling="cls")
    expected = one_by_one(cls_model, tokenizer, TEXTS)
    out = encode_texts(cls_model, tokenizer, TEXTS, MAX_LENGTH, batch_size=64)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_cosine_rows_have_unit_norm(tokenizer):
    cosine = tiny_bi_encoder(tokenizer, similarity="cosine")
    out = encode_texts(cosine, tokenizer, TEXTS, MAX_LENGTH)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize(
    ("batch_size", "max_tokens"), [(1, None), (2, None), (64, 30), (64, 1), (5, 50)]
)
def test_batching_variants_agree(model, tokenizer, batch_size, max_tokens):
    reference = encode_texts(model, tokenizer, TEXTS, MAX_LENGTH, batch_size=64)
    out = encode_texts(
        model, tokenizer, TEXTS, MAX_LENGTH, batch_size=batch_size, max_tokens_per_batch=max_tokens
    )
    np.testing.assert_allclose(out, reference, atol=1e-5)


def test_progress_and_mode_restored(model, tokenizer):
    seen: list[int] = []
    model.train()
    encode_texts(model, tokenizer, TEXTS, MAX_LENGTH, batch_size=3, progress=seen.append)
    assert sum(seen) == len(TEXTS) and len(seen) == 3
    assert model.training
    model.eval()


def test_plan_batches():
    lengths = [3, 10, 7, 10, 1, 5]
    batches = plan_batches(lengths, batch_size=2)
    assert batches == [[1, 3], [2, 5], [0, 4]]  # longest first, stable on ties
    capped = plan_batches(lengths, batch_size=64, max_tokens_per_batch=20)
    assert capped == [[1, 3], [2, 5], [0, 4]]
    assert all(lengths[b[0]] * len(b) <= 20 for b in capped)
    singletons = plan_batches(lengths, batch_size=64, max_tokens_per_batch=5)
    assert singletons == [[1], [3], [2], [5], [0], [4]]  # a text over the cap gets its own batch
    assert sorted(i for b in plan_batches(lengths, 4, 12) for i in b) == list(range(6))
    with pytest.raises(ValueError):
        plan_batches(lengths, batch_size=0)


# ------------------------------------------------------------------ background tokenisation


def test_background_tokenisation_gives_the_same_embeddings(model, tokenizer, monkeypatch):
    monkeypatch.setattr(encoding, "BACKGROUND_CHUNK", 3)  # several chunks for 7 texts
    inline = encode_texts(model, tokenizer, TEXTS, MAX_LENGTH, batch_size=2)
    seen: list[int] = []
    background = encode_texts(model, tokenizer, TEXTS, MAX_LENGTH, batch_size=2,
                              background=True, progress=seen.append)
    np.testing.assert_allclose(background, inline, atol=1e-5)
    assert sum(seen) == len(TEXTS)


def test_background_tokeniser_error_reaches_the_caller_and_the_thread_ends(model, tokenizer):
    class Broken:
        pad_token_id = 0

        def __call__(self, *args, **kwargs):
            raise RuntimeError("tokenizer exploded")

    before = threading.active_count()
    with pytest.raises(RuntimeError, match="tokenizer exploded"):
        encode_texts(model, Broken(), TEXTS, MAX_LENGTH, background=True)
    assert threading.active_count() == before


def test_background_producer_stops_when_the_consumer_fails(model, tokenizer, monkeypatch):
    monkeypatch.setattr(encoding, "BACKGROUND_CHUNK", 1)  # many small items to produce
    calls = 0

    def failing(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise ValueError("forward failed")
        return torch.zeros(len(args[0]), model.dim)

    before = threading.active_count()
    monkeypatch.setattr(model, "forward", failing)
    with pytest.raises(ValueError, match="forward failed"):
        encode_texts(model, tokenizer, TEXTS * 10, MAX_LENGTH, batch_size=1, background=True)
    assert threading.active_count() == before


# --------------------------------------------------------------------------- precision


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize(("precision", "min_cosine"), [("bf16", 0.999), ("int8", 0.98)])
def test_lossy_precisions_stay_close_to_fp32(tokenizer, precision, min_cosine):
    fp32 = tiny_bi_encoder(tokenizer)
    before = {k: v.clone() for k, v in fp32.state_dict().items()}
    reference = encode_texts(fp32, tokenizer, TEXTS, MAX_LENGTH)
    converted = prepare_model(fp32, precision, "cpu")
    assert converted is not fp32
    out = encode_texts(converted, tokenizer, TEXTS, MAX_LENGTH)
    assert out.dtype == np.float32 and out.shape == reference.shape
    assert cosines(out, reference).min() > min_cosine
    assert not np.allclose(out, reference, atol=1e-7)  # the conversion really happened
    # The original model is untouched (a trainer keeps optimising it in fp32).
    for name, value in fp32.state_dict().items():
        assert value.dtype == before[name].dtype and torch.equal(value, before[name]), name


def test_fp32_precision_is_the_model_itself(model):
    assert prepare_model(model, "fp32", "cpu") is model


def test_auto_precision_follows_the_hardware(monkeypatch):
    monkeypatch.setattr(encoding, "cpu_has_native_bf16", lambda: True)
    assert resolve_precision("auto", "cpu") == "bf16"
    monkeypatch.setattr(encoding, "cpu_has_native_bf16", lambda: False)
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("int8", "cpu") == "int8"
    with pytest.raises(ValueError, match="int8"):
        resolve_precision("int8", "cuda")
    with pytest.raises(ValueError, match="unknown precision"):
        prepare_model(tiny_bi_encoder(load_tokenizer(default_model_path())), "fp8", "cpu")


def test_cpu_bf16_detection_reads_the_cpu_flags():
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next(line for line in lines if line.startswith("flags")).split()
    assert cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


# ------------------------------------------------------------ reuse between refreshes (#31)


def test_pretokenised_ids_give_the_bits_of_background_encoding(tokenizer, monkeypatch):
    """The inferencer's cached token ids encode to exactly what tokenising again gives."""
    monkeypatch.setattr(encoding, "BACKGROUND_CHUNK", 3)  # several chunks for 7 texts
    model = tiny_bi_encoder(tokenizer)
    model.document_prompt = "passage: "
    again = encode_texts(model, tokenizer, TEXTS, MAX_LENGTH, batch_size=2, background=True,
                         kind="document", max_tokens_per_batch=40)
    ids = tokenize_texts(tokenizer, TEXTS, MAX_LENGTH, model.prompt("document"))
    seen: list[int] = []
    cached = encode_ids(model, [np.asarray(row, dtype=np.int32) for row in ids],
                        pad_token_id(tokenizer), batch_size=2, max_tokens_per_batch=40,
                        progress=seen.append)
    np.testing.assert_array_equal(cached, again)
    assert sum(seen) == len(TEXTS)
    assert encode_ids(model, [], 0).shape == (0, model.dim)


def _store_checkpoint(store, step: int, model: BiEncoder, tokenizer, root: Path) -> None:
    from ance_train.protocol import keys

    directory = root / f"ckpt-{step}"
    model.save(directory, tokenizer)
    (directory / "training_state.json").write_text("{}")  # never read by an inferencer
    store.put_dir(keys.checkpoint(step), directory)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resident_model_takes_new_weights_bit_for_bit(tokenizer, tmp_path, precision):
    """ModelCache(reuse=True) copies only a new checkpoint's weights into the resident
    (converted) model; the result is the model a full load gives, parameter for parameter,
    and encodes the same bits. A checkpoint that differs in anything else is loaded whole."""
    from ance_train.config import ModelConfig
    from ance_train.infra.store import LocalStore
    from ance_train.modeling.checkpoint_cache import ModelCache

    store = LocalStore("reuse", tmp_path / "store")
    config = ModelConfig(path=str(tmp_path), max_doc_length=MAX_LENGTH)
    first = tiny_bi_encoder(tokenizer, similarity="cosine")
    _store_checkpoint(store, 0, first, tokenizer, tmp_path)
    second = tiny_bi_encoder(tokenizer, similarity="cosine")
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    _store_checkpoint(store, 1, second, tokenizer, tmp_path)

    def cache(name: str, reuse: bool) -> ModelCache:
        return ModelCache(store, config, tmp_path / name, torch.device("cpu"),
                          prepare=lambda m: prepare_model(m, precision), reuse=reuse)

    resident = cache("resident", reuse=True)
    resident.get(0)
    assert resident.reloaded is True
    kept_model = resident.model
    model, _ = resident.get(1)
    assert resident.reloaded is False and model is kept_model
    assert not (tmp_path / "resident" / "1" / "training_state.json").exists()
    fresh, _ = cache("fresh", reuse=False).get(1)
    reference = dict(fresh.state_dict())
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name]), name
    np.testing.assert_array_equal(
        encode_texts(model, tokenizer, TEXTS, MAX_LENGTH, batch_size=2),
        encode_texts(fresh, tokenizer, TEXTS, MAX_LENGTH, batch_size=2))

    second.temperature = 0.5  # ance_model.json changes: not just weights
    _store_checkpoint(store, 2, second, tokenizer, tmp_path)
    model, _ = resident.get(2)
    assert resident.reloaded is True and model is not kept_model and model.temperature == 0.5
