"""bench/interpolation.py's weight interpolation (WiSE-FT, arXiv 2109.01903): the arithmetic on
plain tensors, then on a real (tiny, random) BERT, whose encodings at α = 0 and α = 1 must be the
two models' own. The full scan over a run's checkpoints is a benchmark (bench/), not a test."""

from __future__ import annotations

import pytest
import torch

from ance_train.config import ModelConfig
from ance_train.modeling.encoding import encode_texts
from ance_train.modeling.model import BiEncoder, load_tokenizer

from ance_train_dev.interpolation import interpolate, summarise
from ance_train_dev.synthetic import make_tiny_bert


def test_interpolate_moves_floats_and_keeps_integer_buffers() -> None:
    base = {"w": torch.zeros(3), "ids": torch.arange(3)}
    tuned = {"w": torch.tensor([2.0, 4.0, -2.0]), "ids": torch.arange(3) + 10}
    assert torch.equal(interpolate(base, tuned, 0.0)["w"], base["w"])
    assert torch.equal(interpolate(base, tuned, 1.0)["w"], tuned["w"])
    assert torch.allclose(interpolate(base, tuned, 0.25)["w"], torch.tensor([0.5, 1.0, -0.5]))
    assert torch.equal(interpolate(base, tuned, 0.5)["ids"], tuned["ids"])  # not averaged


def test_interpolate_refuses_models_of_different_shapes() -> None:
    with pytest.raises(ValueError, match="tensors differ"):
        interpolate({"a": torch.zeros(1)}, {"b": torch.zeros(1)}, 0.5)


def test_endpoints_encode_as_the_two_models(tmp_path) -> None:
    path = make_tiny_bert(tmp_path / "model")
    config = ModelConfig(path=str(path), pooling="mean", similarity="cosine")
    tokenizer = load_tokenizer(path)
    base, tuned = (BiEncoder.from_pretrained(path, config).eval() for _ in range(2))
    with torch.no_grad():
        for parameter in tuned.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    texts = ["a short text", "another somewhat longer text about proteins"]

    def encode(model: BiEncoder) -> torch.Tensor:
        return torch.from_numpy(encode_texts(model, tokenizer, texts, 16, dtype=torch.float32))

    base_vectors, tuned_vectors = encode(base), encode(tuned)
    assert not torch.allclose(base_vectors, tuned_vectors, atol=1e-3)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    tuned_state = {k: v.clone() for k, v in tuned.state_dict().items()}
    mixed = BiEncoder.from_pretrained(path, config).eval()
    for alpha, expected in ((0.0, base_vectors), (1.0, tuned_vectors)):
        mixed.load_state_dict(interpolate(base_state, tuned_state, alpha))
        assert torch.allclose(encode(mixed), expected, atol=1e-5)
    mixed.load_state_dict(interpolate(base_state, tuned_state, 0.5))
    halfway = encode(mixed)
    assert not torch.allclose(halfway, base_vectors, atol=1e-3)
    assert not torch.allclose(halfway, tuned_vectors, atol=1e-3)


def test_summary_averages_runs_per_step_and_alpha() -> None:
    rows = [{"run": r, "step": 30, "alpha": 0.5, "dev": d, "test": t}
            for r, d, t in (("a", 0.4, 0.6), ("b", 0.6, 0.8))]
    rows.append({"run": "a", "step": 30, "alpha": 1.0, "dev": 0.1, "test": 0.2})
    summary = summarise(rows)
    assert [(s["step"], s["alpha"], s["runs"]) for s in summary] == [(30, 0.5, 2), (30, 1.0, 1)]
    assert summary[0]["dev"] == pytest.approx(0.5) and summary[0]["test"] == pytest.approx(0.7)
