"""Tests of the contrastive NLL loss (src/ance_train/trainer/loss.py) and the temperature."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ance_train.config import ModelConfig
from ance_train.modeling.model import BiEncoder, load_tokenizer
from ance_train.trainer.loss import contrastive_nll

SCORES = [[2.0, 1.0, 0.5, -0.25], [0.3, 1.5, -1.0, 0.75]]
ALLOWED = [[True, True, False, True], [True, True, True, False]]


def _hand_nll(scores: list[list[float]], positives: list[int], allowed: list[list[bool]]) -> float:
    """Mean of -log(exp(s_pos) / sum over allowed columns of exp(s)), written out with math."""
    total = 0.0
    for row, pos, mask in zip(scores, positives, allowed, strict=True):
        denominator = sum(math.exp(s) for s, keep in zip(row, mask, strict=True) if keep)
        total += -math.log(math.exp(row[pos]) / denominator)
    return total / len(scores)


def test_equals_hand_computation() -> None:
    scores = torch.tensor(SCORES)
    loss = contrastive_nll(scores, torch.tensor([0, 1]), torch.tensor(ALLOWED))
    # Row 0: -log(e^2 / (e^2 + e^1 + e^-0.25)); row 1: -log(e^1.5 / (e^0.3 + e^1.5 + e^-1)).
    row0 = -math.log(math.exp(2.0) / (math.exp(2.0) + math.exp(1.0) + math.exp(-0.25)))
    row1 = -math.log(math.exp(1.5) / (math.exp(0.3) + math.exp(1.5) + math.exp(-1.0)))
    assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(_hand_nll(SCORES, [0, 1], ALLOWED), rel=1e-6)


def test_all_allowed_equals_plain_cross_entropy_by_hand() -> None:
    allowed = [[True] * 4, [True] * 4]
    loss = contrastive_nll(torch.tensor(SCORES), torch.tensor([2, 3]), torch.tensor(allowed))
    assert loss.item() == pytest.approx(_hand_nll(SCORES, [2, 3], allowed), rel=1e-6)


def test_masked_columns_have_no_influence() -> None:
    positives = torch.tensor([0, 1])
    allowed = torch.tensor(ALLOWED)
    base = contrastive_nll(torch.tensor(SCORES), positives, allowed).item()
    changed = torch.tensor(SCORES)
    changed[0, 2] = 1000.0   # masked for query 0
    changed[1, 3] = -1000.0  # masked for query 1
    assert contrastive_nll(changed, positives, allowed).item() == pytest.approx(base, rel=1e-7)
    # ...while changing an allowed column does change the loss.
    changed[0, 1] = 5.0
    assert contrastive_nll(changed, positives, allowed).item() != pytest.approx(base, rel=1e-3)


def test_gradient_flows_only_to_allowed_columns() -> None:
    scores = torch.tensor(SCORES, requires_grad=True)
    allowed = torch.tensor(ALLOWED)
    contrastive_nll(scores, torch.tensor([0, 1]), allowed).backward()
    grad = scores.grad
    assert grad is not None
    assert torch.all(grad[~allowed] == 0)
    assert torch.all(grad[allowed] != 0)
    # d/ds_j of the mean NLL = (softmax_j - [j == pos]) / B over the allowed columns.
    row0 = [math.exp(2.0), math.exp(1.0), math.exp(-0.25)]
    z = sum(row0)
    expected = [(row0[0] / z - 1) / 2, row0[1] / z / 2, row0[2] / z / 2]
    got = [grad[0, 0].item(), grad[0, 1].item(), grad[0, 3].item()]
    assert got == pytest.approx(expected, rel=1e-5)


def test_raises_if_positive_column_is_masked() -> None:
    allowed = torch.tensor(ALLOWED)
    with pytest.raises(ValueError, match="positive"):
        contrastive_nll(torch.tensor(SCORES), torch.tensor([0, 3]), allowed)  # [1, 3] masked
    with pytest.raises(ValueError, match="positive"):
        contrastive_nll(torch.tensor(SCORES), torch.tensor([2, 1]), allowed)  # [0, 2] masked


def test_score_divides_by_temperature(tiny_model: Path) -> None:
    model = BiEncoder.from_pretrained(tiny_model, ModelConfig(path=str(tiny_model),
                                                              temperature=0.05))
    assert model.temperature == 0.05
    queries = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    docs = torch.tensor([[3.0, 0.0], [1.0, 1.0], [-2.0, 4.0]])
    scores = model.score(queries, docs)
    # Row 0: (3, 3, 6) / 0.05; row 1: (1.5, -0.5, -5) / 0.05.
    expected = torch.tensor([[60.0, 60.0, 120.0], [30.0, -10.0, -100.0]])
    assert torch.allclose(scores, expected, atol=1e-4)


def test_loss_on_temperature_scaled_model_scores(tiny_model: Path) -> None:
    """End to end: real embeddings, score / temperature, loss equals the hand formula."""
    tokenizer = load_tokenizer(tiny_model)
    temperature = 0.5
    model = BiEncoder.from_pretrained(
        tiny_model, ModelConfig(path=str(tiny_model), temperature=temperature)
    ).eval()
    q_tok = tokenizer(["first query", "second query words"], padding=True, return_tensors="pt")
    d_tok = tokenizer(["doc one", "another doc", "third"], padding=True, return_tensors="pt")
    with torch.no_grad():
        q = model(q_tok["input_ids"], q_tok["attention_mask"])
        d = model(d_tok["input_ids"], d_tok["attention_mask"])
        loss = contrastive_nll(model.score(q, d), torch.tensor([0, 1]),
                               torch.ones(2, 3, dtype=torch.bool))
    raw = [[float(q[i] @ d[j]) / temperature for j in range(3)] for i in range(2)]
    assert loss.item() == pytest.approx(_hand_nll(raw, [0, 1], [[True] * 3] * 2), rel=1e-4)
