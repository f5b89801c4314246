"""The one mixed-precision policy (src/ance_train/modeling/precision.py), shared by the trainer's
``training.mixed_precision`` and the encoder's ``dtype``."""

from __future__ import annotations

import pytest
import torch

from ance_train.modeling import encoding, precision
from ance_train.modeling.precision import autocast_context, autocast_dtype
from ance_train.trainer import trainer

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a cuda device object needs no GPU


@pytest.fixture
def cuda_bf16(monkeypatch: pytest.MonkeyPatch):
    def set_support(supported: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)

    return set_support


@pytest.mark.parametrize(("mode", "device", "expected"), [
    # the trainer's configuration words
    ("off", CPU, None), ("off", CUDA, None),
    ("auto", CPU, None), ("auto", CUDA, torch.bfloat16),
    ("bf16", CPU, torch.bfloat16), ("bf16", CUDA, torch.bfloat16),
    ("fp16", CPU, torch.float16), ("fp16", CUDA, torch.float16),
    # the encoder's dtype argument (None = auto)
    (None, CPU, None), (None, CUDA, torch.bfloat16),
    (torch.float32, CPU, None), (torch.float32, CUDA, None),
    (torch.bfloat16, CPU, torch.bfloat16), (torch.float16, CUDA, torch.float16),
    ("fp32", CUDA, None),
])
def test_policy_table(cuda_bf16, mode, device, expected) -> None:
    cuda_bf16(True)
    assert autocast_dtype(mode, device) is expected
    assert autocast_dtype(mode, device.type) is expected  # a device name works too


def test_auto_needs_bf16_support_on_cuda(cuda_bf16) -> None:
    cuda_bf16(False)
    assert autocast_dtype("auto", CUDA) is None
    assert autocast_dtype(None, CUDA) is None
    assert autocast_dtype("bf16", CUDA) is torch.bfloat16  # an explicit choice is kept


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown mixed precision 'int8'"):
        autocast_dtype("int8", CPU)


def test_context_autocasts_only_when_the_policy_says_so() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast_context("off", CPU):
        assert (a @ b).dtype == torch.float32
    with autocast_context("auto", CPU):
        assert (a @ b).dtype == torch.float32
    with autocast_context("bf16", CPU):
        assert (a @ b).dtype == torch.bfloat16
    with autocast_context(torch.bfloat16, "cpu"):
        assert (a @ b).dtype == torch.bfloat16


def test_trainer_and_encoder_use_the_one_policy() -> None:
    assert trainer.autocast_context is precision.autocast_context
    assert encoding.autocast_context is precision.autocast_context
    assert not hasattr(encoding, "_autocast_dtype")
