"""The mixed-precision policy shared by training and encoding: which dtype ``torch.autocast``
runs the forward pass in, if any."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Literal

import torch

MixedPrecision = Literal["auto", "bf16", "fp16", "off"]
"""``training.mixed_precision`` of the run configuration."""

_MODES: dict[str, torch.dtype | None] = {
    "off": None,
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def autocast_dtype(mode: str | torch.dtype | None,
                   device: torch.device | str) -> torch.dtype | None:
    """The dtype to autocast to on ``device``, or None to run in full precision.

    ``mode`` is a configuration word or a dtype: ``"auto"`` (or None) is bf16 on a CUDA device
    that supports it and full precision elsewhere; ``"off"``, ``"fp32"`` and ``torch.float32``
    are full precision; ``"bf16"``, ``"fp16"`` or another dtype is that dtype, on any device.
    """
    device = torch.device(device)
    if mode is None or mode == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else None
    if isinstance(mode, torch.dtype):
        dtype: torch.dtype | None = mode
    elif mode in _MODES:
        dtype = _MODES[mode]
    else:
        raise ValueError(f"unknown mixed precision {mode!r}: expected auto, bf16, fp16 or off")
    return None if dtype in (None, torch.float32) else dtype


def autocast_context(mode: str | torch.dtype | None,
                     device: torch.device | str) -> AbstractContextManager:
    """``torch.autocast`` at :func:`autocast_dtype`, or a no-op context for full precision."""
    device = torch.device(device)
    dtype = autocast_dtype(mode, device)
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)
