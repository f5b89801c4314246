"""Random access to the corpus without loading it: :class:`Corpus` seeks to a document through
the byte offset of its line (``doc_offsets.npy``, a memory map). The work items a corpus is
cut into are :func:`ance_train.protocol.work.shard_ranges`.

A corpus in a bucket (``data.path: s3://…``) is read by byte range, never downloaded: a run
of documents (an inferencer's shard, a BM25 chunk) is one ranged GET streamed line by line,
and the documents of a batch are fetched as few ranged GETs (neighbours within
:data:`MERGE_GAP` bytes share one), concurrently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import numpy as np

from ance_train.config import DataConfig, S3Url
from ance_train.data import source
from ance_train.data.formats import (
    DatasetFiles,
    LineError,
    doc_text,
    is_blank,
    parse_doc,
    text_kind,
)
from ance_train.data.problems import DataError
from ance_train.protocol.keys import DOC_OFFSETS_FILE

MERGE_GAP = 64 * 1024
"""Documents of an ``s3://`` corpus closer than this many bytes are read in one ranged GET."""
MAX_SPAN = 8 * 1024 * 1024
"""A merged ranged GET stops growing past this many bytes."""
READ_THREADS = 16
"""Ranged GETs of one :meth:`Corpus.texts` call in flight at once (the S3 client pools 16
connections)."""


class Corpus:
    """Random access to the documents of a validated corpus file.

    Holds an open binary file handle (a local file; an object in a bucket is read by byte
    range) and a read-only memory map of the offsets, so it is cheap to open in every process
    and its memory does not grow with the corpus. Pickling drops the handles; they are
    reopened on first use.
    """

    def __init__(self, files: DatasetFiles, offsets_path: Path, fmt: str) -> None:
        self.path: Path | S3Url = (files.corpus if isinstance(files.corpus, S3Url)
                                   else Path(files.corpus))
        self.offsets_path = Path(offsets_path)
        self.fmt = fmt
        self.kind = text_kind(self.path, fmt)
        self._offsets: np.ndarray | None = None
        self._handle: IO[bytes] | None = None
        self._size = 0
        self._open()

    @property
    def remote(self) -> bool:
        """Whether the corpus is an object in a bucket (read by byte range)."""
        return isinstance(self.path, S3Url)

    def _open(self) -> None:
        try:
            offsets = np.load(self.offsets_path, mmap_mode="r")
        except (OSError, ValueError) as error:
            raise DataError(f"cannot read document offsets {self.offsets_path}: {error}") from None
        if offsets.ndim != 1 or offsets.dtype != np.int64:
            raise DataError(f"{self.offsets_path}: expected a 1-d int64 array of offsets")
        size = source.file_size(self.path)
        if len(offsets) and int(offsets[-1]) >= size:
            raise DataError(
                f"{self.offsets_path} does not match {self.path} (the corpus file changed "
                "since validation; validate the dataset again)"
            )
        self._offsets = offsets
        self._size = size
        if isinstance(self.path, Path):
            self._handle = open(self.path, "rb")  # noqa: SIM115 - closed in close()

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            self._open()
        assert self._offsets is not None
        return self._offsets

    @property
    def _file(self) -> IO[bytes]:
        if self._handle is None:
            self._open()
        assert self._handle is not None
        return self._handle

    def __len__(self) -> int:
        return len(self.offsets)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_offsets"] = None
        state["_handle"] = None
        return state

    def close(self) -> None:
        """Close the file handle and drop the memory map."""
        if self._handle is not None:
            self._handle.close()
        self._handle = None
        self._offsets = None

    def __enter__(self) -> Corpus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, i: int) -> int:
        n = len(self)
        index = int(i)
        if not 0 <= index < n:
            raise IndexError(f"document index {i} out of range (corpus has {n} documents)")
        return index

    def _parse_at(self, index: int, raw: bytes) -> tuple[str, str, str]:
        try:
            return parse_doc(raw, self.kind)
        except LineError as error:
            raise DataError(
                f"{self.path} (document {index}): {error}; the corpus file changed since validation"
            ) from None

    def _doc_at(self, index: int) -> tuple[str, str, str]:
        if self.remote:
            return self._parse_at(index, self._remote_lines([index])[index])
        # A positional read (pread), not seek + readline: the Search server's worker threads
        # name hits concurrently through one handle, and a shared file position races.
        start, end = self._span(index)
        raw = os.pread(self._file.fileno(), end - start, start)
        newline = raw.find(b"\n")
        return self._parse_at(index, raw if newline < 0 else raw[: newline + 1])

    def _span(self, index: int) -> tuple[int, int]:
        """Bytes ``[start, end)`` from document ``index``'s line to the next document's."""
        offsets = self.offsets
        end = int(offsets[index + 1]) if index + 1 < len(offsets) else self._size
        return int(offsets[index]), end

    def _remote_lines(self, indices: Sequence[int]) -> dict[int, bytes]:
        """The raw lines of ``indices`` of a corpus in a bucket, in as few ranged GETs as
        neighbouring documents allow (run concurrently)."""
        assert isinstance(self.path, S3Url)
        url = self.path
        runs: list[tuple[int, int, list[int]]] = []  # (start, end, documents)
        for index in sorted(set(indices)):
            start, end = self._span(index)
            if runs and start - runs[-1][1] <= MERGE_GAP and end - runs[-1][0] <= MAX_SPAN:
                runs[-1] = (runs[-1][0], max(end, runs[-1][1]), [*runs[-1][2], index])
            else:
                runs.append((start, end, [index]))

        def fetch(run: tuple[int, int, list[int]]) -> dict[int, bytes]:
            begin, end, members = run
            data = source.read_range(url, begin, end - begin)
            lines = {}
            for index in members:
                start, stop = self._span(index)
                chunk = data[start - begin : stop - begin]
                newline = chunk.find(b"\n")
                lines[index] = chunk if newline < 0 else chunk[: newline + 1]
            return lines

        result: dict[int, bytes] = {}
        if len(runs) == 1:
            result.update(fetch(runs[0]))
            return result
        with ThreadPoolExecutor(min(READ_THREADS, len(runs))) as pool:
            for lines in pool.map(fetch, runs):
                result.update(lines)
        return result

    def _docs(self, indices: Sequence[int]) -> list[tuple[str, str, str]]:
        """(doc id, title, text) of ``indices`` (checked), in the given order; read in file
        order to limit seeking, or by merged ranged GETs for a corpus in a bucket."""
        checked = [self._check(i) for i in indices]
        if self.remote:
            raws = self._remote_lines(checked)
            return [self._parse_at(index, raws[index]) for index in checked]
        result: list[tuple[str, str, str]] = [("", "", "")] * len(checked)
        for position in sorted(range(len(checked)), key=checked.__getitem__):
            result[position] = self._doc_at(checked[position])
        return result

    def records(self, indices: Sequence[int]) -> list[tuple[str, str, str]]:
        """(doc id, title, text) of ``indices``, in the given order (``export-negatives``)."""
        return self._docs(indices)

    def doc_id(self, i: int) -> str:
        """The id of document ``i`` (its position in the corpus file)."""
        return self._doc_at(self._check(i))[0]

    def doc_ids(self, indices: Sequence[int]) -> list[str]:
        """The ids of ``indices``, in the given order."""
        return [doc_id for doc_id, _, _ in self._docs(indices)]

    def text(self, i: int) -> str:
        """The text to encode for document ``i`` (see :func:`doc_text`)."""
        _, title, text = self._doc_at(self._check(i))
        return doc_text(title, text)

    def texts(self, indices: Sequence[int]) -> list[str]:
        """Texts of ``indices``, in the given order (read in file order to limit seeking)."""
        return [doc_text(title, text) for _, title, text in self._docs(indices)]

    def iter_range(self, start: int, stop: int) -> Iterator[tuple[str, str]]:
        """(doc id, text) of documents ``start`` to ``stop - 1``, read sequentially."""
        n = len(self)
        stop = min(stop, n)
        if start < 0 or start > n:
            raise IndexError(f"start {start} out of range (corpus has {n} documents)")
        if start >= stop:
            return
        if self.remote:
            yield from self._iter_remote(start, stop)
            return
        position = int(self.offsets[start])
        index = start
        while index < stop:
            # Seek every time: the handle is shared with text()/texts() between yields.
            handle = self._file
            handle.seek(position)
            raw = handle.readline()
            position += len(raw)
            if not raw:
                raise DataError(f"{self.path}: ended before document {index}; validate again")
            if is_blank(raw):
                continue
            yield self._parsed(raw, index)
            index += 1


    def _parsed(self, raw: bytes, index: int) -> tuple[str, str]:
        """(doc id, text) of document ``index``'s line."""
        try:
            doc_id, title, text = parse_doc(raw, self.kind)
        except LineError as error:
            raise DataError(f"{self.path} (document {index}): {error}") from None
        return doc_id, doc_text(title, text)

    def _iter_remote(self, start: int, stop: int) -> Iterator[tuple[str, str]]:
        """:meth:`iter_range` of a corpus in a bucket: one ranged GET, streamed."""
        assert isinstance(self.path, S3Url)
        begin = int(self.offsets[start])
        end = self._span(stop - 1)[1]
        index = start
        with source.reader(self.path).open(self.path.key, begin, end - begin) as stream:
            for raw in stream:
                if index >= stop:
                    break
                if is_blank(raw):
                    continue
                yield self._parsed(raw, index)
                index += 1
        if index < stop:
            raise DataError(f"{self.path}: ended before document {index}; validate again")


def open_corpus(cfg: DataConfig, cache_dir: str | Path) -> Corpus:
    """A :class:`Corpus` over the validated dataset of ``cfg`` (offsets from ``cache_dir``)."""
    return Corpus(DatasetFiles.resolve(cfg), Path(cache_dir) / DOC_OFFSETS_FILE, cfg.format)
