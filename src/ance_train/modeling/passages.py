"""Documents cut into passages for MaxP (``data.passages.mode: max``): the one place that
decides where a passage begins and ends, used alike by the inferencers (which encode every
passage) and the trainer (which trains on the passage the indexer chose).

A document is tokenised once, without special tokens; its tokens are cut into windows of
``length`` minus the special tokens and the document prompt, starting every ``stride`` tokens
(moved back to the start of a word, :func:`_word_start`), at most ``max_passages`` of them
(ANCE §5 after Dai & Callan, arXiv:1905.09217: 512-token passages, at most four). A passage
is the *text* its window covers, a substring of the document found through the tokenizer's
character offsets, so every later step (the prompt, the special tokens, the truncation at
``length``) is the ordinary tokenisation of a text, and a document that fits in one passage
is encoded exactly as FirstP encodes it.

In the index, passage ``p`` of document ``d`` is row key ``d * max_passages + p``
(:func:`ance_train.protocol.embeddings.passage_keys`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ance_train.config import PassagesConfig


@dataclass(frozen=True)
class SplitDocuments:
    """Passages of a run of documents, in document order, then passage order."""

    texts: list[str]        # one per passage
    documents: np.ndarray   # [N] int64: the position of each passage's document in the input
    passages: np.ndarray    # [N] int16: its passage number within the document


class PassageSplitter:
    """Cuts document texts into passages with ``tokenizer`` (a fast tokenizer: the passage
    boundaries are its character offsets)."""

    def __init__(self, tokenizer, config: PassagesConfig, max_doc_length: int,
                 prompt: str = "") -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("data.passages.mode max needs a fast (Rust) tokenizer: passage "
                             "boundaries are read from its character offsets, which "
                             f"{type(tokenizer).__name__} does not give")
        self.tokenizer = tokenizer
        self.length = config.length or max_doc_length
        self.max_passages = config.max_passages
        reserved = tokenizer.num_special_tokens_to_add(pair=False)
        if prompt:
            reserved += len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        self.window = self.length - reserved
        if self.window < 1:
            raise ValueError(f"data.passages.length {self.length} leaves no room for text: "
                             f"the special tokens and the document prompt take {reserved}")
        self.stride = config.stride or self.window
        if self.stride > self.window:
            raise ValueError(f"data.passages.stride {self.stride} skips text: a passage holds "
                             f"{self.window} tokens of text")
        # Tokens of a document that can reach a passage; the rest is never tokenised.
        self._reach = (self.max_passages - 1) * self.stride + self.window

    def spans(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        """Character spans ``[start, end)`` of each text's passages (one span, the whole
        text, for a text that fits in one passage or has no token)."""
        encoded = self.tokenizer(list(texts), add_special_tokens=False, truncation=True,
                                 max_length=self._reach, return_offsets_mapping=True,
                                 return_attention_mask=False, return_token_type_ids=False)
        result = []
        for number, (text, offsets) in enumerate(zip(texts, encoded["offset_mapping"],
                                                     strict=True)):
            count = len(offsets)
            if count <= self.window:
                result.append([(0, len(text))])
                continue
            words = encoded.word_ids(number)
            spans: list[tuple[int, int]] = []
            start = 0
            while len(spans) < self.max_passages:
                stop = min(start + self.window, count)
                spans.append((offsets[start][0], offsets[stop - 1][1]))
                if stop == count:
                    break
                start = _word_start(words, start, start + self.stride)
            result.append(spans)
        return result

    def split(self, texts: Sequence[str]) -> SplitDocuments:
        """Every passage of ``texts``."""
        out: list[str] = []
        documents: list[int] = []
        numbers: list[int] = []
        for position, (text, spans) in enumerate(zip(texts, self.spans(texts), strict=True)):
            for number, (start, end) in enumerate(spans):
                out.append(text[start:end])
                documents.append(position)
                numbers.append(number)
        return SplitDocuments(out, np.asarray(documents, dtype=np.int64),
                              np.asarray(numbers, dtype=np.int16))

    def passage(self, texts: Sequence[str], numbers: Sequence[int]) -> list[str]:
        """Passage ``numbers[i]`` of ``texts[i]`` (a number past a text's last passage gives
        its last passage: the tokenizer of a checkpoint may cut a text differently)."""
        chosen = []
        for text, spans, number in zip(texts, self.spans(texts), numbers, strict=True):
            start, end = spans[min(int(number), len(spans) - 1)]
            chosen.append(text[start:end])
        return chosen


def _word_start(words: list, previous: int, start: int) -> int:
    """Token ``start`` moved back to the first token of its word, if that lies after the
    previous passage's start: a passage starting inside a word would tokenise the word's rest
    as a word of its own (no ``##`` continuation), into more tokens than its window, and lose
    its end to the truncation at ``length``. A word longer than the stride is cut."""
    first = start
    while first > previous + 1 and words[first - 1] == words[start]:
        first -= 1
    return first if words[first - 1] != words[start] else start
