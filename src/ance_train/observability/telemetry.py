"""What each role reports about its progress: Prometheus metrics and AnceRun status / Events.

The services call these at the points where something happens; the metrics are cheap to set
and the reporter only queues, so nothing here slows a training step or a refresh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ance_train.observability import metrics
from ance_train.observability.kube import RunReporter

# The split whose metrics the AnceRun shows: the held-out part of train ("dev", never tuned on
# by design); a run configured without it shows its first evaluated split instead.
PREFERRED_EVAL_SPLIT = "dev"


class TrainerTelemetry:
    def __init__(self, reporter: RunReporter, total_steps: int, world_size: int = 1) -> None:
        self.reporter = reporter
        self.total_steps = total_steps
        self.world_size = world_size  # data-parallel ranks (rank 0 alone reports)

    def started(self) -> None:
        self.reporter.update(urgent=True, phase="Pending", totalSteps=self.total_steps,
                             worldSize=self.world_size,
                             message="starting: first checkpoint and negatives")

    def step(self, step: int, loss: float, negatives_step: int | None, gap: int | None) -> None:
        metrics.TRAINER_STEP.set(step)
        metrics.TRAINER_LOSS.set(loss)
        fields: dict[str, Any] = {"phase": "Training", "message": "training", "step": step,
                                     "totalSteps": self.total_steps, "loss": round(loss, 6)}
        if negatives_step is not None:
            metrics.TRAINER_NEGATIVES_STEP.set(negatives_step)
            fields["negativesStep"] = negatives_step
        if gap is not None:
            metrics.TRAINER_ASYNC_GAP.set(gap)
            fields["asyncGap"] = gap
        self.reporter.update(**fields)

    def checkpoint_published(self, step: int) -> None:
        metrics.CHECKPOINTS_PUBLISHED.inc()
        self.reporter.update(urgent=True, latestCheckpoint=step)
        self.reporter.event("CheckpointPublished", f"checkpoint {step} is in the object store")

    def finished(self, step: int) -> None:
        message = f"trained {step} of {self.total_steps} steps"
        self.reporter.update(urgent=True, phase="Succeeded", step=step, message=message)
        self.reporter.event("RunSucceeded", message)


class InferencerTelemetry:
    def shard_encoded(self, texts: int, seconds: float) -> None:
        metrics.SHARDS_ENCODED.inc()
        metrics.DOCS_ENCODED.inc(texts)
        metrics.DOCS_PER_SECOND.set(texts / max(seconds, 1e-9))


class IndexerTelemetry:
    def __init__(self, reporter: RunReporter) -> None:
        self.reporter = reporter

    def refreshed(self, step: int, refresh_seconds: float | None,
                  evaluation: Mapping[str, Mapping[str, float]]) -> None:
        """Index of ``step`` built, negatives ready and evaluated."""
        metrics.INDEX_STEP.set(step)
        fields: dict[str, Any] = {"indexStep": step}
        if refresh_seconds is not None:
            metrics.REFRESH_LATENCY.observe(refresh_seconds)
            fields["refreshPeriodSeconds"] = round(refresh_seconds, 3)
        for name, values in evaluation.items():
            for measure, value in values.items():
                metrics.EVAL_METRIC.labels(name, measure).set(value)
        split = PREFERRED_EVAL_SPLIT if PREFERRED_EVAL_SPLIT in evaluation else next(
            iter(evaluation), None)
        if split is not None:
            values = evaluation[split]
            fields.update(evalStep=step, ndcgAt10=values.get("ndcg@10"),
                          mrrAt10=values.get("mrr@10"))
        self.reporter.update(urgent=True, **fields)
        self.reporter.event("IndexRefreshed", f"index of checkpoint {step} built, negatives ready"
                            + (f" {refresh_seconds:.1f}s after the checkpoint was published"
                               if refresh_seconds is not None else ""))
        if split is not None:
            self.reporter.event("EvaluationDone", f"checkpoint {step} on {split}: nDCG@10 "
                                f"{values.get('ndcg@10', float('nan')):.4f}, MRR@10 "
                                f"{values.get('mrr@10', float('nan')):.4f}")
