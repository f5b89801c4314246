"""Every object-store key and Redis key of a run, each built by one function.

Object keys are relative to the run (the store prefixes ``<run_id>/``); Redis keys carry the
run id themselves (``ance:<run_id>:...``). Nothing else in the code spells a key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ance_train.protocol.tables import TableId
    from ance_train.protocol.work import ShardKind

# -- object store ---------------------------------------------------------------------------
# The validated dataset index, published once by the launcher / `ance-train prepare`: the
# same two file names in the store (under ``data/``) and in each service's local cache.
DATASET_INDEX_FILE = "dataset.json"
DOC_OFFSETS_FILE = "doc_offsets.npy"
DATASET_INDEX = f"data/{DATASET_INDEX_FILE}"
DOC_OFFSETS = f"data/{DOC_OFFSETS_FILE}"
# The trainer's record of the run (losses, async gaps, swaps), written at the end.
TRAINER_SUMMARY = "trainer/summary.json"
# The starting weights θ0 of a run with training.wise_ft_alpha < 1 (trainer/interpolation.py),
# stored once when it starts: every published checkpoint is a blend of θ0 and the trained θ.
START_WEIGHTS = "trainer/start_weights.safetensors"
# The run configuration as the trainer read it (what `ance-train export` puts in the card).
RUN_CONFIG = "config.yaml"
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
# The base model when ``model.path`` is a Hugging Face Hub id or an ``s3://`` directory:
# resolved once by `ance-train prepare` (or the embedded launcher) and copied here, a model
# directory + MANIFEST.json, so that every role trains / encodes / exports the same snapshot
# (modeling/source.py); BASE_MODEL_SOURCE records where it came from (path, revision, the
# Hub commit it resolved to), written after the directory is complete.
BASE_MODEL = "model/base"
BASE_MODEL_SOURCE = "model/source.json"


def checkpoint(step: int) -> str:
    """The prefix of checkpoint ``step``: a Hugging Face model directory, the training state
    and two manifests (below)."""
    return f"{CHECKPOINTS}/{int(step)}"


# The trainer's resumable state in a checkpoint directory, beside the model's files (what
# ``ance-train export`` leaves out of an exported model, and an inferencer never loads).
TRAINING_STATE_JSON = "training_state.json"
TRAINING_STATE_TENSORS = "training_state.safetensors"
TRAINING_STATE_FILES = (TRAINING_STATE_JSON, TRAINING_STATE_TENSORS)

# A checkpoint's two manifests, in the store's format (``{"version": 1, "files": {rel:
# {"sha256", "size"}}}``, infra/store). WEIGHTS.json lists the model's files (every file
# but the training state) and is written once they are stored, before the checkpoint is
# announced: what inferencers, the indexer's Search and `ance-train export` read.
# MANIFEST.json lists every file, the training state too, and is written last, after the
# announcement: only then is the checkpoint complete, one a restarted trainer may resume
# from (the order: trainer/checkpoints.py; what is stored: protocol/checkpoints.py).
CHECKPOINT_WEIGHTS_MANIFEST = "WEIGHTS.json"
CHECKPOINT_MANIFEST = "MANIFEST.json"


def checkpoint_weights_manifest(step: int) -> str:
    return f"{checkpoint(step)}/{CHECKPOINT_WEIGHTS_MANIFEST}"


def checkpoint_manifest(step: int) -> str:
    return f"{checkpoint(step)}/{CHECKPOINT_MANIFEST}"


def is_training_state(rel: str) -> bool:
    """Whether ``rel``, a path inside a checkpoint directory, is part of the training state
    (not listed by WEIGHTS.json)."""
    return rel in TRAINING_STATE_FILES


def checkpoint_step(key: str) -> int | None:
    """The step of a key under ``checkpoints/<step>/``, or None for any other key."""
    parts = key.split("/")
    if len(parts) >= 2 and parts[0] == CHECKPOINTS and parts[1].isdigit():
        return int(parts[1])
    return None


EMBEDDINGS = "embeddings"
NEGATIVES = "negatives"
# The families of per-refresh objects. Every object that belongs to the refresh of checkpoint
# ``k`` (its embedding shards, negatives tables, index partitions or partial lists...) has a
# key ``<family>/<k>`` followed by ``/``, ``.`` or ``-`` under one of these families, so that
# :func:`refresh_step` finds its refresh and the store's retention
# (:mod:`ance_train.protocol.retention`, ``store.keep_refreshes``) covers it by construction.
# A new per-refresh object goes under one of them, or under a new family added here.
PARTIALS = "partials"  # index partitions' top-K lists (index.partitions > 1)
REFRESH_FAMILIES: tuple[str, ...] = (EMBEDDINGS, NEGATIVES, PARTIALS)


def refresh_step(key: str) -> int | None:
    """The refresh (checkpoint step) a per-refresh object belongs to, or None for any other
    key (``negatives/bm25.npz``, checkpoints, eval reports, the dataset index...)."""
    family, _, rest = key.partition("/")
    if family not in REFRESH_FAMILIES:
        return None
    digits = len(rest) - len(rest.lstrip("0123456789"))
    if digits == 0 or (digits < len(rest) and rest[digits] not in "/.-"):
        return None
    return int(rest[:digits])


def embeddings(step: int) -> str:
    """The prefix of every embedding shard of checkpoint ``step``."""
    return f"{EMBEDDINGS}/{int(step)}"


def embedding_shard(step: int, kind: ShardKind | str, shard: int) -> str:
    return f"{embeddings(step)}/{kind}-{int(shard):05d}.npz"


def negatives_table(table: TableId) -> str:
    """``negatives/bm25.npz``, ``negatives/<k>.npz`` (ANN) or ``negatives/<k>-dual.npz``."""
    return f"{NEGATIVES}/{table.name}.npz"


def partial_results(step: int, partition: int, partitions: int) -> str:
    """Index partition ``partition``'s local top-K lists of every query of checkpoint ``step``
    (``index.partitions`` > 1); the number of partitions is in the key, so lists cut for
    another partitioning are never merged with these."""
    return f"{PARTIALS}/{int(step)}/partition-{int(partition)}-of-{int(partitions)}.npz"


EVAL_REPORTS = "eval"


def eval_report(step: int) -> str:
    return f"{EVAL_REPORTS}/{int(step)}.json"


def eval_report_step(key: str) -> int | None:
    """The step of an ``eval/<step>.json`` key, or None for any other key."""
    parts = key.split("/")
    if len(parts) == 2 and parts[0] == EVAL_REPORTS and parts[1].endswith(".json"):
        stem = parts[1][: -len(".json")]
        return int(stem) if stem.isdigit() else None
    return None


def tensorboard_file(role: str, name: str) -> str:
    """A TensorBoard event file of ``role`` (``tensorboard/<role>/<file>``), so that
    ``tensorboard --logdir s3://<bucket>/<run_id>/tensorboard`` shows every role."""
    return f"{TENSORBOARD}/{role}/{name}"


# -- Redis ----------------------------------------------------------------------------------
def redis_key(run_id: str, name: str) -> str:
    """A key in the run's Redis namespace; ``name`` is one of the names below or a stream."""
    return f"ance:{run_id}:{name}"


LATEST_CHECKPOINT = "latest_checkpoint"  # newest published checkpoint step
REFRESH_UNDER_WAY = "refresh_under_way"  # highest checkpoint step any inferencer started
WORK_STREAM = "work"  # the shard work queue
DEAD_LETTER_STREAM = "dead-letter"  # entries that failed validation, kept for inspection


def service_registration(role: str, instance: str) -> str:
    return f"service:{role}:{instance}"


def index_partition_address(partition: int) -> str:
    """The gRPC address of index partition ``partition`` (refreshed with a TTL by the
    partition itself), where ``Retrieval.Search`` fans out to."""
    return f"index_partition:{int(partition)}"
