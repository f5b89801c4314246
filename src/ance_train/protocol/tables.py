"""The identity of a negatives table: which kind it is and which checkpoint mined it.

Before this type, checkpoint steps doubled as identities (−1 meant BM25, ``"<k>-dual"`` a
DANCE table). A :class:`TableId` says it explicitly and builds its own object key.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, model_validator


class TableKind(StrEnum):
    BM25 = "bm25"  # BM25 top-k minus positives, mined once at start (the warm-up negatives)
    ANN = "ann"  # mined from the ANN index of checkpoint ``step`` (ANCE, SimANS, ANCE-Tele)
    DUAL = "dual"  # DANCE: negative queries per positive document, from checkpoint ``step``


class TableId(BaseModel):
    """``step`` is the checkpoint whose index mined the table; None for BM25 only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: TableKind
    step: int | None = None

    @model_validator(mode="after")
    def _step_matches_kind(self) -> TableId:
        if self.kind is TableKind.BM25 and self.step is not None:
            raise ValueError("a BM25 table is mined before any checkpoint: step must be null")
        if self.kind is not TableKind.BM25 and (self.step is None or self.step < 0):
            raise ValueError(f"a {self.kind} table needs the step (>= 0) of its checkpoint")
        return self

    @classmethod
    def bm25(cls) -> TableId:
        return cls(kind=TableKind.BM25)

    @classmethod
    def ann(cls, step: int) -> TableId:
        return cls(kind=TableKind.ANN, step=step)

    @classmethod
    def dual(cls, step: int) -> TableId:
        return cls(kind=TableKind.DUAL, step=step)

    @property
    def name(self) -> str:
        """``bm25``, ``<k>`` or ``<k>-dual``: the table's file name without extension."""
        if self.kind is TableKind.BM25:
            return "bm25"
        return f"{self.step}" if self.kind is TableKind.ANN else f"{self.step}-dual"

    @property
    def reported_step(self) -> int:
        """The step by which summaries, metrics and the AnceRun report the table in use: its
        checkpoint, and −1 for BM25 (``ance_trainer_negatives_step``, ``summary.json``)."""
        return -1 if self.step is None else self.step

    @property
    def key(self) -> str:
        from ance_train.protocol.keys import negatives_table

        return negatives_table(self)

    def __str__(self) -> str:
        return self.name
