"""model.query_prompt / model.document_prompt (prepended where text becomes tokens, on the
encode path and the train path alike, and written into the exported sentence-transformers
config) and pooling ``last_token`` for decoder embedders (left / right padding, batch / row).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2Model, LlamaConfig, LlamaModel

from ance_train.config import ModelConfig, default_model_path
from ance_train.modeling.encoding import encode_texts
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.runtime import ServiceOptions, connect_context
from ance_train.trainer.trainer import Trainer

from ance_train_dev.service_harness import Harness

TEXTS = ["what causes a fever?", "Vitamin D deficiency is linked to bone loss in adults.",
         "dense retrieval", "a much longer sentence about hard negatives, refreshed "
         "asynchronously while the trainer keeps optimising the encoder"]
PROMPTS = {"query_prompt": "query: ", "document_prompt": "passage: "}


def _models(path: Path, **config) -> tuple[BiEncoder, BiEncoder]:
    """The same weights with the prompts of ``config`` and without any."""
    return (BiEncoder.from_pretrained(path, ModelConfig(**config, **PROMPTS)).eval(),
            BiEncoder.from_pretrained(path, ModelConfig(**config)).eval())


# -- prompts ---------------------------------------------------------------------------------
def test_encoding_with_a_prompt_equals_prepending_it_by_hand(tiny_model: Path) -> None:
    prompted, plain = _models(tiny_model)
    tokenizer = load_tokenizer(tiny_model)
    for kind, prompt in (("query", "query: "), ("document", "passage: ")):
        by_hand = encode_texts(plain, tokenizer, [prompt + t for t in TEXTS], 64)
        np.testing.assert_array_equal(
            encode_texts(prompted, tokenizer, TEXTS, 64, kind=kind), by_hand)
        np.testing.assert_array_equal(  # the background tokeniser prepends it too
            encode_texts(prompted, tokenizer, TEXTS, 64, kind=kind, background=True), by_hand)
    raw = encode_texts(plain, tokenizer, TEXTS, 64)
    np.testing.assert_array_equal(encode_texts(prompted, tokenizer, TEXTS, 64), raw)  # no kind
    assert not np.allclose(encode_texts(prompted, tokenizer, TEXTS, 64, kind="query"), raw)


@pytest.fixture
def prompted_trainer(tmp_path: Path, redis_server, tiny_model: Path,
                     scifact_subset: Path) -> Iterator[Trainer]:
    harness = Harness.prepare(
        tmp_path, redis_server.url, run_id="prompts", data={"path": str(scifact_subset)},
        model={"path": str(tiny_model), "max_query_length": 24, "max_doc_length": 48,
               **PROMPTS},
        training={"steps": 3, "batch_size": 4, "torch_threads": 1, "mixed_precision": "off"},
        negatives={"pool": "random", "per_query": 2, "warmup": "none"})
    trainer = Trainer(connect_context(ServiceOptions(
        role="trainer", config_path=str(harness.config_path), redis_url=harness.redis_url,
        work_dir=str(tmp_path / "work"), instance="trainer", store_dir=str(tmp_path / "store"))))
    yield trainer
    trainer.preparer.close()
    trainer.ctx.stop.set()
    if trainer.feed._thread.is_alive():
        trainer.feed._thread.join(timeout=10)


def test_training_batches_carry_the_prompts_as_prepending_by_hand(
        prompted_trainer: Trainer, tiny_model: Path) -> None:
    """The trainer's batch of step 1 (its preparer, as the loop uses it) tokenises queries
    and documents with their prompts: the same ids as prepending by hand, hence the same
    embeddings; and the same vectors as the inferencer's encode path."""
    trainer = prompted_trainer
    inputs = trainer.preparer.prepare(trainer._plan(1))
    queries = inputs.shard.query_texts + inputs.shard.dual_query_texts
    docs = trainer.ctx.corpus.texts(inputs.shard.doc_indices)
    tokenizer = load_tokenizer(tiny_model)
    hand_q = tokenizer(["query: " + q for q in queries], padding=True, truncation=True,
                       max_length=24, return_tensors="pt")
    hand_d = tokenizer(["passage: " + d for d in docs], padding=True, truncation=True,
                       max_length=48, return_tensors="pt")
    assert torch.equal(inputs.query_ids, hand_q["input_ids"])
    assert torch.equal(inputs.doc_ids, hand_d["input_ids"])
    _, plain = _models(tiny_model, max_query_length=24, max_doc_length=48)
    model = trainer.model.eval()
    with torch.no_grad():
        trained_q = model(inputs.query_ids, inputs.query_mask).numpy()
        trained_d = model(inputs.doc_ids, inputs.doc_mask).numpy()
        np.testing.assert_array_equal(
            trained_q, plain(hand_q["input_ids"], hand_q["attention_mask"]).numpy())
        np.testing.assert_array_equal(
            trained_d, plain(hand_d["input_ids"], hand_d["attention_mask"]).numpy())
    np.testing.assert_allclose(encode_texts(model, tokenizer, queries, 24, kind="query"),
                               trained_q, atol=1e-5)
    np.testing.assert_allclose(encode_texts(model, tokenizer, docs, 48, kind="document"),
                               trained_d, atol=1e-5)


def test_the_export_carries_the_prompts_to_sentence_transformers(
        tmp_path: Path, tiny_model: Path) -> None:
    from sentence_transformers import SentenceTransformer

    prompted, _ = _models(tiny_model, similarity="cosine")
    tokenizer = load_tokenizer(tiny_model)
    prompted.save(tmp_path / "model", tokenizer)
    config = json.loads((tmp_path / "model" / "config_sentence_transformers.json").read_text())
    assert config["prompts"] == {"query": "query: ", "document": "passage: "}
    assert config["default_prompt_name"] == "document"
    assert config["similarity_fn_name"] == "cosine"
    st = SentenceTransformer(str(tmp_path / "model"), device="cpu")
    ours_q = encode_texts(prompted, tokenizer, TEXTS, 256, kind="query")
    ours_d = encode_texts(prompted, tokenizer, TEXTS, 256, kind="document")
    np.testing.assert_allclose(st.encode(TEXTS, prompt_name="query"), ours_q, atol=1e-5)
    np.testing.assert_allclose(st.encode_query(TEXTS), ours_q, atol=1e-5)
    np.testing.assert_allclose(st.encode_document(TEXTS), ours_d, atol=1e-5)
    np.testing.assert_allclose(st.encode(TEXTS), ours_d, atol=1e-5)  # default: document
    # A model without prompts keeps plain encode() unprompted.
    _, plain = _models(tiny_model)
    plain.save(tmp_path / "plain", tokenizer)
    config = json.loads((tmp_path / "plain" / "config_sentence_transformers.json").read_text())
    assert config["prompts"] == {"query": "", "document": ""}
    assert config["default_prompt_name"] is None


# -- last-token pooling ----------------------------------------------------------------------
def _decoder(directory: Path, kind: str, pad: bool = True) -> Path:
    """A tiny random decoder with the MiniLM WordPiece tokenizer, made to tokenise as decoder
    tokenizers do: no token type ids (GPT-2 would add their embeddings) and, with ``pad``
    False, no pad token."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True,
                                              model_input_names=["input_ids", "attention_mask"])
    if kind == "gpt2":
        model = GPT2Model(GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2,
                                     n_head=2, n_positions=128, bos_token_id=101,
                                     eos_token_id=102))
    else:
        model = LlamaModel(LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32,
                                       intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1,
                                       max_position_embeddings=128))
    model.save_pretrained(directory, safe_serialization=True)
    if not pad:
        tokenizer.eos_token = "[SEP]"
        tokenizer.pad_token = None
    tokenizer.save_pretrained(directory)
    return directory


def _last_real_hidden(model: BiEncoder, ids: list[int]) -> torch.Tensor:
    """The encoder's hidden state of a row's last token, the row encoded alone unpadded."""
    with torch.no_grad():
        row = torch.tensor([ids])
        return model.encoder(input_ids=row, attention_mask=torch.ones_like(row)
                             ).last_hidden_state[0, -1]


def _padded(rows: list[list[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[r, span] = torch.tensor(row)
        mask[r, span] = 1
    return ids, mask


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_last_token_pooling_is_the_last_real_token_with_any_padding(
        tmp_path: Path, kind: str) -> None:
    path = _decoder(tmp_path / kind, kind)
    model = BiEncoder.from_pretrained(path, ModelConfig(pooling="last_token")).eval()
    tokenizer = load_tokenizer(path)
    rows = tokenizer(TEXTS)["input_ids"]
    expected = torch.stack([_last_real_hidden(model, row) for row in rows])
    with torch.no_grad():
        for side in ("right", "left"):
            ids, mask = _padded(rows, tokenizer.pad_token_id, side)
            torch.testing.assert_close(model(ids, mask), expected, atol=1e-5, rtol=1e-5,
                                       msg=f"{side} padding")
    batch = encode_texts(model, tokenizer, TEXTS, 128, batch_size=len(TEXTS))
    single = np.concatenate([encode_texts(model, tokenizer, [t], 128) for t in TEXTS])
    np.testing.assert_allclose(batch, single, atol=1e-5)
    np.testing.assert_allclose(batch, expected.numpy(), atol=1e-5)
    # The tokenizer's own left padding (what a decoder embedder's tokenizer often sets).
    left = load_tokenizer(path)
    left.padding_side = "left"
    tokens = left(TEXTS, padding=True, return_tensors="pt")
    assert (tokens["attention_mask"][:, 0] == 0).any()  # really left-padded
    with torch.no_grad():
        torch.testing.assert_close(model(tokens["input_ids"], tokens["attention_mask"]),
                                   expected, atol=1e-5, rtol=1e-5)


def test_a_decoder_tokenizer_without_pad_token_pads_with_eos_and_exports(
        tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    path = _decoder(tmp_path / "gpt2", "gpt2", pad=False)
    tokenizer = load_tokenizer(path)
    assert tokenizer.pad_token == tokenizer.eos_token == "[SEP]"
    model = BiEncoder.from_pretrained(path, ModelConfig(pooling="last_token")).eval()
    ours = encode_texts(model, tokenizer, TEXTS, 128)
    model.save(tmp_path / "export", tokenizer)
    pooling = json.loads((tmp_path / "export" / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_lasttoken"] and not pooling["pooling_mode_mean_tokens"]
    st = SentenceTransformer(str(tmp_path / "export"), device="cpu")
    np.testing.assert_allclose(st.encode(TEXTS), ours, atol=1e-5)
