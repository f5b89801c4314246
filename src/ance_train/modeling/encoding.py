"""Fast corpus / query encoding with a :class:`BiEncoder`.

The Inferencer re-encodes the whole corpus with every checkpoint, so this is on the
critical path of the ANCE refresh. What makes it fast:

* all texts are tokenised once, up front, in one fast-tokenizer call, without padding;
* texts are sorted by token length (longest first) and batched with neighbours of similar
  length; each batch is padded only to its own longest sequence (dynamic padding), and
  ``max_tokens_per_batch`` optionally caps ``rows x padded length`` so that batches of long
  texts get fewer rows;
* inference mode, eval mode, bf16 autocast on CUDA, and the encoder's own attention
  implementation (transformers picks SDPA by default);
* optionally (``background=True``) tokenisation and tensor building on a background thread,
  chunk by chunk, overlapping with the model's forward passes;
* the numeric precision of the weights (:func:`prepare_model`): ``fp32``, ``bf16`` (native on
  GPUs and on CPUs with AVX512-BF16 / AMX) or ``int8`` (dynamic quantisation of the Linear
  layers, CPU only). ``bf16`` and ``int8`` are lossy; docs/benchmarks/performance.md
  measures what they change in retrieval.

Rows come back in the order of ``texts``. Padding never changes an embedding: the padded
positions are masked out of attention and of the pooling.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ance_train.modeling.model import BiEncoder, TextKind, tokenize
from ance_train.modeling.precision import autocast_context

Precision = Literal["auto", "fp32", "bf16", "int8"]
# Texts tokenised per chunk when tokenising in the background: batches are planned within a
# chunk, so a chunk should hold many batches (length sorting) yet arrive early.
BACKGROUND_CHUNK = 256


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


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: Precision, device: torch.device | str) -> Precision:
    """``auto`` → bf16 where the hardware computes it natively (CUDA with bf16 support, CPUs
    with AVX512-BF16 / AMX), else fp32; an explicit choice is checked against the device."""
    device = torch.device(device)
    if precision == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
        return "bf16" if device.type == "cpu" and cpu_has_native_bf16() else "fp32"
    if precision == "int8" and device.type != "cpu":
        raise ValueError(f"precision int8 (dynamic quantisation) runs on the CPU only, "
                         f"not on {device.type}")
    return precision


def prepare_model(model: BiEncoder, precision: Precision,
                  device: torch.device | str = "cpu") -> BiEncoder:
    """The model to encode with at ``precision`` (resolved by :func:`resolve_precision`).

    fp32 returns ``model`` itself; bf16 and int8 return a converted copy in eval mode
    (``model`` is left as it is, so a trainer can keep optimising it).
    """
    resolved = resolve_precision(precision, device)
    if resolved == "fp32":
        return model
    converted = copy.deepcopy(model).eval()
    if resolved == "bf16":
        return converted.to(torch.bfloat16)
    if resolved == "int8":
        return torch.ao.quantization.quantize_dynamic(converted, {torch.nn.Linear},
                                                      dtype=torch.qint8)
    raise ValueError(f"unknown precision {precision!r}: expected auto, fp32, bf16 or int8")


Batch = tuple[list[int], torch.Tensor, torch.Tensor]  # row indices into texts, ids, mask


def padded_batches(
    tokenizer,
    texts: Sequence[str],
    max_length: int,
    batch_size: int,
    max_tokens_per_batch: int | None = None,
    chunk: int | None = None,
    prompt: str = "",
    token_ids: list | None = None,
) -> Iterator[Batch]:
    """Tokenise ``texts`` (in chunks of ``chunk`` texts, or all at once), ``prompt``
    prepended to each (:func:`~ance_train.modeling.model.tokenize`), and yield length-sorted
    batches, each right-padded to its own longest row. ``token_ids``, if given, is extended
    with each chunk's ids as it is tokenised."""
    pad_id = pad_token_id(tokenizer)
    step = chunk or max(len(texts), 1)
    for offset in range(0, len(texts), step):
        input_ids = tokenize_texts(tokenizer, texts[offset:offset + step], max_length, prompt)
        if token_ids is not None:
            token_ids.extend(input_ids)
        yield from batches_of_ids(input_ids, pad_id, batch_size, max_tokens_per_batch, offset)


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def tokenize_texts(tokenizer, texts: Sequence[str], max_length: int,
                   prompt: str = "") -> list[list[int]]:
    """The token ids of ``texts`` (``prompt`` prepended), truncated to ``max_length``, unpadded:
    what :func:`encode_ids` takes."""
    return tokenize(tokenizer, texts, prompt, truncation=True, max_length=max_length,
                    padding=False, return_attention_mask=False,
                    return_token_type_ids=False)["input_ids"]


def batches_of_ids(input_ids: Sequence[Sequence[int]], pad_id: int, batch_size: int,
                   max_tokens_per_batch: int | None = None, offset: int = 0) -> Iterator[Batch]:
    """Length-sorted batches of already tokenised texts, each right-padded to its longest
    row; row indices are offset by ``offset``."""
    lengths = [len(ids) for ids in input_ids]
    for batch in plan_batches(lengths, batch_size, max_tokens_per_batch):
        width = lengths[batch[0]]
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, index in enumerate(batch):  # right padding: [CLS] stays at position 0
            ids[row, : lengths[index]] = torch.as_tensor(input_ids[index])
            mask[row, : lengths[index]] = 1
        yield [offset + index for index in batch], ids, mask


def in_background(items: Iterator[Batch], depth: int = 4) -> Iterator[Batch]:
    """Run ``items`` on a background thread, ``depth`` items ahead of the consumer.

    An exception in the producer is re-raised in the consumer; a consumer that stops early
    stops the producer.
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(item: object) -> bool:
        """Hand ``item`` over unless the consumer has stopped; False once it has."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(end)
        except BaseException as error:  # handed to the consumer
            put(error)

    thread = threading.Thread(target=produce, name="tokenizer", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


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
    background: bool = False,
    kind: TextKind | None = None,
    token_ids: list | None = None,
) -> np.ndarray:
    """Embed ``texts``; returns float32 ``[len(texts), model.dim]`` in the order of ``texts``.

    ``model`` must already be on ``device`` (and converted by :func:`prepare_model` for a
    precision other than fp32). ``dtype`` is the autocast dtype (default: the ``auto`` policy of
    :func:`~ance_train.modeling.precision.autocast_dtype`, bf16 on CUDA where supported, none
    elsewhere; pass ``torch.float32`` to disable it). ``background`` tokenises chunks of
    :data:`BACKGROUND_CHUNK` texts on a background thread while the model runs. ``progress``
    is called with the number of texts finished after every batch. ``kind`` (``query`` or
    ``document``) prepends the model's prompt of that kind (``model.query_prompt`` /
    ``model.document_prompt``); None encodes the texts as they are. ``token_ids``, if given,
    receives the texts' token ids (what :func:`encode_ids` takes for the same bits), complete
    once the call returns. The model's train/eval mode is restored on return.
    """
    if not texts:
        return np.empty((0, model.dim), dtype=np.float32)
    batches = padded_batches(tokenizer, texts, max_length, batch_size, max_tokens_per_batch,
                             chunk=BACKGROUND_CHUNK if background else None,
                             prompt=model.prompt(kind), token_ids=token_ids)
    if background:
        batches = in_background(batches)
    return _encode_batches(model, batches, len(texts), device, dtype, progress)


def encode_ids(
    model: BiEncoder,
    input_ids: Sequence[Sequence[int]],
    pad_id: int,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    max_tokens_per_batch: int | None = None,
    dtype: torch.dtype | None = None,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """:func:`encode_texts` (``background=True``) of texts already tokenised by
    :func:`tokenize_texts` (prompt included): the same batches, so the same vectors, without
    tokenising again (the inferencer keeps a shard's ids between refreshes: the corpus never
    changes)."""
    if not input_ids:
        return np.empty((0, model.dim), dtype=np.float32)
    # Planned per chunk of BACKGROUND_CHUNK texts, as encode_texts(background=True) plans
    # them: the same batches, so the same bits.
    batches = (batch for offset in range(0, len(input_ids), BACKGROUND_CHUNK)
               for batch in batches_of_ids(input_ids[offset:offset + BACKGROUND_CHUNK], pad_id,
                                           batch_size, max_tokens_per_batch, offset))
    return _encode_batches(model, batches, len(input_ids), device, dtype, progress)


def _encode_batches(model: BiEncoder, batches: Iterator[Batch], count: int,
                    device: torch.device | str, dtype: torch.dtype | None,
                    progress: Callable[[int], None] | None) -> np.ndarray:
    device = torch.device(device)
    out = np.empty((count, model.dim), dtype=np.float32)
    autocast = autocast_context(dtype, device)
    pin = device.type == "cuda"
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast:
            for rows, ids, mask in batches:
                if pin:
                    ids, mask = ids.pin_memory(), mask.pin_memory()
                embeddings = model(
                    ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
                )
                out[rows] = embeddings.float().cpu().numpy()
                if progress is not None:
                    progress(len(rows))
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()  # stops a background producer if a forward pass failed
        model.train(was_training)
    return out
