"""ance-train from Python (a notebook): an embedded run on this machine, the same code path as
``ance-train run``, with each refresh's evaluation handed to the caller as it arrives.

    from ance_train import Run

    with Run("configs/quickstart.yaml", overwrite=True) as run:
        for refresh in run.refreshes():
            print(refresh.step, refresh.metrics["dev"]["ndcg@10"])
        model_dir = run.export("best")   # a sentence-transformers model directory
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ance_train.config import RunConfig, load_config, parse_config
from ance_train.launcher.embedded import EmbeddedRun, RunResult, write_summary
from ance_train.modeling.export import export_checkpoint
from ance_train.protocol import keys


@dataclass(frozen=True)
class Refresh:
    """One refresh's evaluation: the checkpoint, its metrics per split (``dev``, ``test``),
    the indexer's stage timings and the time since the run started."""

    step: int
    metrics: dict[str, dict[str, float]]
    timings: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0


class Run:
    """An embedded run. ``config`` is a :class:`RunConfig`, a mapping with the fields of the
    YAML file (relative paths are taken from the working directory), or a YAML file's path
    (relative paths from its directory). The services start on :meth:`start` (or ``with``)
    and stop when :meth:`refreshes` is exhausted, on :meth:`stop`, or when the ``with`` block
    ends; a failing service raises :class:`~ance_train.launcher.embedded.RunAborted`."""

    def __init__(self, config: RunConfig | Mapping[str, Any] | str | Path, *,
                 overwrite: bool = False, max_minutes: float | None = None) -> None:
        if isinstance(config, RunConfig):
            self.config, source = config, Path("<RunConfig>")
        elif isinstance(config, Mapping):
            self.config, source = parse_config(dict(config), "<dict>"), Path("<dict>")
        else:
            self.config, source = load_config(config), Path(config)
        self._run = EmbeddedRun(self.config, source, overwrite=overwrite,
                                max_minutes=max_minutes)
        self.evaluations: list[Refresh] = []
        self.trainer_summary: dict = {}
        self._started = self._finished = False

    @property
    def run_dir(self) -> Path:
        """``<output_dir>/<run_id>``: logs, TensorBoard files, the local store, summary.json."""
        return self._run.run_dir

    def start(self) -> Run:
        """Validate the config, model and dataset, then start every service."""
        if not self._started:
            self._started = True
            self._run.prepare()
            self._run.start_services()
        return self

    def refreshes(self) -> Iterator[Refresh]:
        """Each refresh's evaluation as it arrives, zero-shot first, until the final
        checkpoint is evaluated; then the services stop and ``summary.json`` is written."""
        self.start()
        if self._finished:
            yield from self.evaluations
            return
        try:
            for entry in self._run.refreshes():
                refresh = Refresh(**entry)
                self.evaluations.append(refresh)
                yield refresh
            self.trainer_summary = self._run.store.get_json(keys.TRAINER_SUMMARY)
            self._finished = True
        finally:
            self.stop()
        result = RunResult([vars(r) for r in self.evaluations], self.trainer_summary,
                           self.evaluations[-1].elapsed_s if self.evaluations else 0.0,
                           self._run.store.usage(), self._run.supervisor.records())
        write_summary(self.run_dir, result)

    def wait(self) -> list[Refresh]:
        """Run to the end; every refresh's evaluation."""
        for _ in self.refreshes():
            pass
        return self.evaluations

    def export(self, checkpoint: str = "best", out: str | Path | None = None) -> Path:
        """Write checkpoint ``best`` (highest dev nDCG@10), ``last`` or a step as a
        sentence-transformers model directory with a model card (``ance-train export``);
        returns the directory (default ``<run_dir>/export/<checkpoint>``)."""
        target = Path(out) if out is not None else self.run_dir / "export" / checkpoint
        _, path = export_checkpoint(self._run.store, checkpoint, target, self.config,
                                    overwrite=True)
        return path

    def stop(self) -> None:
        """Stop every service (idempotent)."""
        if self._started:
            self._run.stop()

    def __enter__(self) -> Run:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
