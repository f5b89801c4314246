"""Fast corpus / query encoding with a :class:`BiEncoder`.

The Inferencer re-encodes the whole corpus with every checkpoint, so this is on the
critical path of the ANCE refresh. What makes it fast:

* all texts are tokenised once, up front, in one fast-tokenizer call, without padding;
* texts are sorted by token length (longest first) and batched with neighbours of similar
  length; each batch is padded only to its own longest sequence (dynamic padding), and
  ``max_tokens_per_batch`` optionally caps ``rows x padded length`` so that batches of long
  texts get fewer rows;
* inference mode, eval mode, bf16 autocast on CUDA, and the encoder's own attention
  implementation (transformers picks SDPA by default).

Rows come back in the order of ``texts``. Padding never changes an embedding: the padded
positions are masked out of attention and of the pooling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import numpy as np
import torch

from .model import BiEncoder


def plan_batches(
    lengths: Sequence[int], batch_size: int, max_tokens_per_batch: int | None = None
) -> list[list[int]]:
    """Group indices of ``lengths`` into batches of similar length, longest first.

    A batch holds at most ``batch_size`` rows and, when ``max_tokens_per_batch`` is set, at
    most that many padded tokens (a single text longer than the cap still gets its own batch).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_tokens_per_batch is not None and max_tokens_per_batch < 1:
        raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens_per_batch}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep order
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        if current:
            # Descending order: the first row of a batch is its longest.
            padded = lengths[current[0]] * (len(current) + 1)
            full = len(current) >= batch_size
            if full or (max_tokens_per_batch is not None and padded > max_tokens_per_batch):
                batches.append(current)
                current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def _autocast_dtype(device: torch.device, dtype: torch.dtype | None) -> torch.dtype | None:
    """The autocast dtype: ``dtype`` if given, else bf16 on CUDA where supported; fp32 = none."""
    if dtype is None and device.type == "cuda" and torch.cuda.is_bf16_supported():
        dtype = torch.bfloat16
    return None if dtype in (None, torch.float32) else dtype


def encode_texts(
    model: BiEncoder,
    tokenizer,
    texts: Sequence[str],
    max_length: int,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    max_tokens_per_batch: int | None = None,
    dtype: torch.dtype | None = None,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Embed ``texts``; returns float32 ``[len(texts), model.dim]`` in the order of ``texts``.

    ``model`` must already be on ``device``. ``dtype`` is the autocast dtype (default: bf16
    on CUDA, none elsewhere; pass ``torch.float32`` to disable it). ``progress`` is called
    with the number of texts finished after every batch. The model's train/eval mode is
    restored on return.
    """
    device = torch.device(device)
    out = np.empty((len(texts), model.dim), dtype=np.float32)
    if not texts:
        return out
    input_ids = tokenizer(
        list(texts),
        truncation=True,
        max_length=max_length,
        padding=False,
        return_attention_mask=False,
        return_token_type_ids=False,
    )["input_ids"]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    autocast_dtype = _autocast_dtype(device, dtype)
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    )
    pin = device.type == "cuda"
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast:
            lengths = [len(ids) for ids in input_ids]
            for batch in plan_batches(lengths, batch_size, max_tokens_per_batch):
                width = lengths[batch[0]]
                ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, index in enumerate(batch):  # right padding: [CLS] stays at position 0
                    ids[row, : lengths[index]] = torch.tensor(input_ids[index])
                    mask[row, : lengths[index]] = 1
                if pin:
                    ids, mask = ids.pin_memory(), mask.pin_memory()
                embeddings = model(
                    ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
                )
                out[batch] = embeddings.float().cpu().numpy()
                if progress is not None:
                    progress(len(batch))
    finally:
        model.train(was_training)
    return out
