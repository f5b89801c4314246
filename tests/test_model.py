"""Tests of the bi-encoder and its checkpoints (src/ance_train/modeling/model.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ance_train.config import ModelConfig
from ance_train.modeling.model import (
    HEAD_FILE,
    META_FILE,
    BiEncoder,
    ModelLoadError,
    load_tokenizer,
)

TEXTS = [
    "a short query",
    "a considerably longer document about retrieval with many more tokens in it",
    "mid length text here",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return load_tokenizer(tiny_model)


def _load(path: Path, **overrides: object) -> BiEncoder:
    return BiEncoder.from_pretrained(path, ModelConfig(path=str(path), **overrides)).eval()


def _embed(model: BiEncoder, tokenizer, texts: list[str]) -> torch.Tensor:
    tokens = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        return model(tokens["input_ids"], tokens["attention_mask"])


def _assert_safetensors_only(directory: Path) -> None:
    files = [p for p in directory.rglob("*") if p.is_file()]
    assert (directory / "model.safetensors").is_file()
    forbidden = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".h5", ".msgpack"}
    assert not [p.name for p in files if p.suffix in forbidden]


def test_save_round_trip_gives_identical_embeddings(
    tiny_model: Path, tokenizer, tmp_path: Path
) -> None:
    model = _load(tiny_model)
    before = _embed(model, tokenizer, TEXTS)
    assert before.shape == (3, 32)
    model.save(tmp_path / "ckpt", tokenizer)
    _assert_safetensors_only(tmp_path / "ckpt")
    reloaded = _load(tmp_path / "ckpt")
    after = _embed(reloaded, load_tokenizer(tmp_path / "ckpt"), TEXTS)
    assert torch.equal(before, after)


def test_mean_pooling_by_hand_and_padding_is_ignored(tiny_model: Path, tokenizer) -> None:
    model = _load(tiny_model, pooling="mean")
    batch = _embed(model, tokenizer, TEXTS)  # the short texts are padded here
    for i, text in enumerate(TEXTS):
        alone = _embed(model, tokenizer, [text])  # no padding at all
        assert torch.allclose(batch[i], alone[0], atol=1e-5), text
        tokens = tokenizer([text], return_tensors="pt")
        with torch.no_grad():
            hidden = model.encoder(**tokens).last_hidden_state[0]
        assert torch.allclose(alone[0], hidden.mean(dim=0), atol=1e-5)


def test_cls_pooling_differs_from_mean_and_takes_first_token(tiny_model: Path,
                                                             tokenizer) -> None:
    mean = _embed(_load(tiny_model, pooling="mean"), tokenizer, TEXTS)
    cls_model = _load(tiny_model, pooling="cls")
    cls = _embed(cls_model, tokenizer, TEXTS)
    assert not torch.allclose(mean, cls, atol=1e-3)
    tokens = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = cls_model.encoder(**tokens).last_hidden_state
    assert torch.allclose(cls, hidden[:, 0], atol=1e-6)


def test_cosine_similarity_gives_unit_norm(tiny_model: Path, tokenizer) -> None:
    dot = _embed(_load(tiny_model, similarity="dot"), tokenizer, TEXTS)
    cosine = _embed(_load(tiny_model, similarity="cosine"), tokenizer, TEXTS)
    assert torch.allclose(cosine.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert not torch.allclose(dot.norm(dim=-1), torch.ones(3), atol=1e-2)
    assert torch.allclose(cosine, dot / dot.norm(dim=-1, keepdim=True), atol=1e-5)


def test_projection_head_is_saved_and_checkpoint_is_self_describing(
    tiny_model: Path, tokenizer, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = _load(tiny_model, pooling="cls", projection_dim=16, similarity="cosine",
                  temperature=0.05)
    assert model.dim == 16
    with torch.no_grad():  # make the head distinct from any fresh initialisation
        for parameter in model.projection.parameters():
            parameter.add_(torch.randn_like(parameter))
    before = _embed(model, tokenizer, TEXTS)
    assert before.shape == (3, 16)
    ckpt = tmp_path / "with-head"
    model.save(ckpt, tokenizer)
    _assert_safetensors_only(ckpt)

    head = load_file(str(ckpt / HEAD_FILE))
    assert head["0.weight"].shape == (16, 32)
    assert torch.equal(head["0.weight"], model.projection[0].weight.detach())
    meta = json.loads((ckpt / META_FILE).read_text())
    assert meta == {"pooling": "cls", "projection_dim": 16, "similarity": "cosine",
                    "temperature": 0.05, "query_prompt": "", "document_prompt": ""}

    # Loaded with the defaults (mean, no head, dot, T=1): the checkpoint's settings win.
    torch.manual_seed(123)
    reloaded = BiEncoder.from_pretrained(ckpt, ModelConfig()).eval()
    assert (reloaded.pooling, reloaded.similarity, reloaded.temperature) == (
        "cls", "cosine", 0.05)
    assert reloaded.projection is not None and reloaded.dim == 16
    after = _embed(reloaded, tokenizer, TEXTS)
    assert torch.equal(before, after)


def test_checkpoint_loads_with_transformers_automodel(
    tiny_model: Path, tokenizer, tmp_path: Path
) -> None:
    from transformers import AutoModel

    model = _load(tiny_model, projection_dim=16)
    model.save(tmp_path / "ckpt", tokenizer)
    auto = AutoModel.from_pretrained(tmp_path / "ckpt", local_files_only=True).eval()
    tokens = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = model.encoder(**tokens).last_hidden_state
        theirs = auto(**tokens).last_hidden_state
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(("pooling", "similarity"), [("mean", "dot"), ("cls", "cosine")])
def test_sentence_transformers_encode_equals_biencoder(
    tiny_model: Path, tokenizer, tmp_path: Path, pooling: str, similarity: str
) -> None:
    from sentence_transformers import SentenceTransformer

    model = _load(tiny_model, pooling=pooling, similarity=similarity)
    ckpt = tmp_path / "st"
    model.save(ckpt, tokenizer)
    st = SentenceTransformer(str(ckpt), device="cpu")
    theirs = st.encode(TEXTS, convert_to_tensor=True, batch_size=8)
    ours = _embed(model, tokenizer, TEXTS)
    assert theirs.shape == ours.shape
    assert torch.allclose(theirs.cpu(), ours, atol=1e-5)


def test_sentence_transformers_loads_checkpoint_with_head(
    tiny_model: Path, tokenizer, tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    model = _load(tiny_model, projection_dim=16)
    model.save(tmp_path / "head", tokenizer)
    st = SentenceTransformer(str(tmp_path / "head"), device="cpu")
    # The head is not a sentence-transformers module: ST gives the pooled encoder output.
    assert st.encode(TEXTS).shape == (3, 32)


def test_directory_without_config_json(tmp_path: Path) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "weights.txt").write_text("nothing")
    with pytest.raises(ModelLoadError) as info:
        BiEncoder.from_pretrained(empty, ModelConfig())
    assert str(empty) in str(info.value)
    missing = tmp_path / "does-not-exist"
    with pytest.raises(ModelLoadError) as info:
        BiEncoder.from_pretrained(missing, ModelConfig())
    assert str(missing) in str(info.value)


def test_encoder_decoder_is_rejected(tmp_path: Path) -> None:
    from transformers import T5Config, T5Model

    config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                      num_decoder_layers=1, num_heads=2)
    with_weights = tmp_path / "t5"
    T5Model(config).save_pretrained(with_weights, safe_serialization=True)
    with pytest.raises(ModelLoadError) as info:
        BiEncoder.from_pretrained(with_weights, ModelConfig())
    assert str(with_weights) in str(info.value)
    assert "t5" in str(info.value)

    config_only = tmp_path / "t5-config-only"
    config.save_pretrained(config_only)
    with pytest.raises(ModelLoadError) as info:
        BiEncoder.from_pretrained(config_only, ModelConfig())
    assert str(config_only) in str(info.value)


def test_unreadable_config_json(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError) as info:
        BiEncoder.from_pretrained(broken, ModelConfig())
    assert str(broken) in str(info.value)


def test_load_tokenizer_error_names_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)


def test_check_encoder_reads_the_files_without_torch(tiny_model: Path, tmp_path: Path) -> None:
    """The launcher's check (``ance_train.modeling.files``) accepts the tiny model, refuses a
    directory without tokenizer files, a config.json without model_type and a broken
    tokenizer.json, naming the directory — and imports neither torch nor transformers."""
    import shutil
    import subprocess
    import sys

    from ance_train.modeling.files import check_encoder

    check_encoder(tiny_model)
    probe = ("import sys; from ance_train.modeling.files import check_encoder; "
             f"check_encoder({str(tiny_model)!r}); "
             "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model / name, no_tokenizer / name)
    with pytest.raises(ModelLoadError, match="cannot load tokenizer") as info:
        check_encoder(no_tokenizer)
    assert str(no_tokenizer) in str(info.value)
    (no_tokenizer / "tokenizer.json").write_text("{ not a tokenizer")
    with pytest.raises(ModelLoadError, match="cannot load tokenizer"):
        check_encoder(no_tokenizer)
    untyped = tmp_path / "untyped"
    shutil.copytree(tiny_model, untyped)
    config = json.loads((untyped / "config.json").read_text())
    del config["model_type"]
    (untyped / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no model_type") as info:
        check_encoder(untyped)
    assert str(untyped) in str(info.value)
