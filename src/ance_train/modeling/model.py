"""The bi-encoder: one Hugging Face encoder shared by queries and documents (ANCE §4).

Relevance is ``sim(q, d) / temperature`` where ``sim`` is the dot product, or the cosine
when embeddings are L2-normalised (DANCE). ANCE's appendix A.1 head — a projection on the
pooled vector followed by LayerNorm — is optional.

Checkpoints are plain Hugging Face directories (``model.safetensors`` + config + tokenizer)
with the sentence-transformers module files beside them, so both libraries load them.
The optional head is stored in ``ance_head.safetensors``; ``ance_model.json`` records
pooling / similarity / head / prompts so a checkpoint is self-describing.

Text becomes tokens in one place, :func:`tokenize`: the query or document prompt
(``model.query_prompt`` / ``model.document_prompt``) is prepended to every text there — as
sentence-transformers does for ``encode(..., prompt_name=...)`` — for training batches,
corpus / query encoding, search and evaluation alike.

Pooling ``last_token`` (decoder embedders) takes the hidden state of each row's last real
token (the last position whose attention mask is 1), so left and right padding give the same
vectors; position ids are counted over the real tokens only, so a left-padded row is encoded
exactly like the same row unpadded.

Weights are only ever read from safetensors files: a directory that holds only pickle-based
weights (``pytorch_model.bin``) is refused, because unpickling can run arbitrary code.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from ance_train.config import ModelConfig

# The checks of a model directory that need neither torch nor transformers (the launcher's).
from ance_train.modeling.files import (  # noqa: F401 - re-exported
    SAFETENSORS_WEIGHTS,
    ModelLoadError,
    check_encoder,
)
from ance_train.modeling.files import require_safetensors as _require_safetensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel

HEAD_FILE = "ance_head.safetensors"
META_FILE = "ance_model.json"
ST_CONFIG_FILE = "config_sentence_transformers.json"
TextKind = Literal["query", "document"]


class BiEncoder(nn.Module):
    """Shared-weight query/document encoder with pooling and an optional projection head."""

    def __init__(
        self,
        encoder: PreTrainedModel,
        pooling: str = "mean",
        projection_dim: int | None = None,
        similarity: str = "dot",
        temperature: float = 1.0,
        query_prompt: str = "",
        document_prompt: str = "",
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.pooling = pooling
        self.similarity = similarity
        self.temperature = temperature
        self.query_prompt = query_prompt
        self.document_prompt = document_prompt
        # last_token pooling counts positions over the real tokens (left padding), where the
        # encoder takes position ids.
        self._position_ids = (pooling == "last_token" and "position_ids" in
                              inspect.signature(encoder.forward).parameters)
        hidden = int(encoder.config.hidden_size)
        self.projection: nn.Module | None = None
        if projection_dim is not None:
            self.projection = nn.Sequential(
                nn.Linear(hidden, projection_dim), nn.LayerNorm(projection_dim)
            )
        self.dim = projection_dim or hidden

    @classmethod
    def from_pretrained(cls, path: str | Path, config: ModelConfig) -> BiEncoder:
        """Load an encoder directory; the checkpoint's ``ance_model.json`` wins over ``config``."""
        path = Path(path)
        hf_config = _encoder_config(path)
        meta = _read_meta(path)
        pooling = meta.get("pooling", config.pooling)
        projection_dim = meta.get("projection_dim", config.projection_dim)
        similarity = meta.get("similarity", config.similarity)
        temperature = meta.get("temperature", config.temperature)
        query_prompt = meta.get("query_prompt", config.query_prompt)
        document_prompt = meta.get("document_prompt", config.document_prompt)
        try:
            encoder = AutoModel.from_pretrained(path, config=hf_config, local_files_only=True,
                                                use_safetensors=True)
        except (OSError, ValueError, KeyError) as error:
            raise ModelLoadError(f"model directory {path}: cannot load encoder: {error}") from None
        model = cls(encoder, pooling, projection_dim, similarity, temperature, query_prompt,
                    document_prompt)
        if model.projection is not None and (path / HEAD_FILE).is_file():
            model.projection.load_state_dict(load_file(str(path / HEAD_FILE)))
        return model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[batch, dim]`` (L2-normalised, in float32, when the similarity is
        cosine)."""
        extra: dict[str, Any] = {}
        if self._position_ids:
            extra["position_ids"] = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                              **extra).last_hidden_state
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        elif self.pooling == "last_token":
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device),
                            last_token_index(attention_mask)]
        else:
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        if self.projection is not None:
            pooled = self.projection(pooled)
        if self.similarity == "cosine":
            # The one place embeddings are L2-normalised (the index takes them as they are),
            # in float32 so that a bf16 model's rows are unit vectors too.
            pooled = nn.functional.normalize(pooled.float(), p=2, dim=-1)
        return pooled

    def prompt(self, kind: TextKind | None) -> str:
        """The prompt prepended to texts of ``kind`` (None: raw texts, no prompt)."""
        if kind is None:
            return ""
        if kind == "query":
            return self.query_prompt
        if kind == "document":
            return self.document_prompt
        raise ValueError(f"text kind must be query or document, got {kind!r}")

    def score(self, queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        """All-pairs relevance ``[n_queries, n_docs]``."""
        return queries @ docs.T / self.temperature

    def save(self, directory: str | Path, tokenizer: PreTrainedTokenizerBase) -> None:
        """Write a checkpoint loadable by ``transformers`` and ``sentence-transformers``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.encoder.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        meta = {
            "pooling": self.pooling,
            "projection_dim": None if self.projection is None else self.dim,
            "similarity": self.similarity,
            "temperature": self.temperature,
            "query_prompt": self.query_prompt,
            "document_prompt": self.document_prompt,
        }
        (directory / META_FILE).write_text(json.dumps(meta, indent=2))
        if self.projection is not None:
            state = {
                k: v.detach().contiguous().cpu() for k, v in self.projection.state_dict().items()
            }
            save_file(state, str(directory / HEAD_FILE))
        _write_sentence_transformers_files(directory, self)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the position of the last token whose mask is 1 (left or right padding)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.long() * positions).argmax(dim=1)


def tokenize(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], prompt: str = "",
             **kwargs: Any) -> Any:
    """The one place text becomes tokens: ``prompt`` is prepended to every text (string
    concatenation, as sentence-transformers applies a prompt), then the tokenizer runs with
    ``kwargs``; truncation cuts the text's end, never the prompt."""
    return tokenizer([prompt + text for text in texts] if prompt else list(texts), **kwargs)


def import_loading_code() -> None:
    """Import transformers' model-loading code (``transformers.modeling_utils``, which brings
    torch.distributed.tensor and torch._dynamo: about 2 s on a 2-core CPU). The first
    ``from_pretrained`` imports it anyway; an inferencer calls this while it waits for its
    first checkpoint, so that the zero-shot refresh does not wait for it."""
    import transformers.modeling_utils  # noqa: F401


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"model directory {path}: cannot load tokenizer: {error}") from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # Decoder tokenizers (GPT-2, Llama) have no pad token; padding is masked out anyway.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _encoder_config(path: Path) -> PretrainedConfig:
    """The Hugging Face config of an encoder-only model directory, or ModelLoadError."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path}: no config.json (not a Hugging Face model)")
    _require_safetensors(path)
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"model directory {path}: cannot load encoder: {error}") from None
    if getattr(hf_config, "is_encoder_decoder", False) or not hasattr(hf_config, "hidden_size"):
        raise ModelLoadError(
            f"model directory {path}: {hf_config.model_type} is not a text encoder")
    return hf_config


def _read_meta(path: Path) -> dict:
    meta_path = path / META_FILE
    if not meta_path.is_file():
        return {}
    return json.loads(meta_path.read_text())


def _write_sentence_transformers_files(directory: Path, model: BiEncoder) -> None:
    """modules.json + pooling config so ``SentenceTransformer(directory)`` reproduces the encoder.

    The optional ANCE head is not expressed as sentence-transformers modules; a checkpoint
    with a head is still a valid transformers model, and ``BiEncoder.from_pretrained`` applies it.
    """
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if model.similarity == "cosine":
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    pooling_dir = directory / "1_Pooling"
    pooling_dir.mkdir(exist_ok=True)
    hidden = int(model.encoder.config.hidden_size)
    (pooling_dir / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": hidden,
                "pooling_mode_cls_token": model.pooling == "cls",
                "pooling_mode_mean_tokens": model.pooling == "mean",
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
                "pooling_mode_lasttoken": model.pooling == "last_token",
            },
            indent=2,
        )
    )
    # The prompts as sentence-transformers names them: encode(..., prompt_name="query") and
    # encode_query / encode_document prepend them; plain encode() applies the document prompt
    # (default_prompt_name) when there is one, as ance-train encodes the corpus.
    (directory / ST_CONFIG_FILE).write_text(json.dumps({
        "model_type": "SentenceTransformer",
        "prompts": {"query": model.query_prompt, "document": model.document_prompt},
        "default_prompt_name": "document" if model.document_prompt else None,
        "similarity_fn_name": model.similarity,
    }, indent=2))
    (directory / "sentence_bert_config.json").write_text(
        json.dumps(
            {
                "max_seq_length": int(
                    getattr(model.encoder.config, "max_position_embeddings", 512)
                ),
                "do_lower_case": False,
            }
        )
    )
