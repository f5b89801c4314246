"""What a model directory must hold, checked from its files alone: no torch, no transformers.

``ance-train run`` (the launcher), ``validate`` and ``prepare`` check the base model before
anything starts, in processes that never load a model: importing ``transformers`` imports
torch (about 3 s of CPU per process), so the check reads ``config.json`` and the tokenizer
files directly. The services load the model itself with ``transformers``
(:meth:`ance_train.modeling.model.BiEncoder.from_pretrained`, whose checks say the same).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
# config.json keys that transformers' config classes map to ``hidden_size`` (attribute_map).
HIDDEN_SIZE_KEYS = ("hidden_size", "n_embd", "n_embed", "d_model", "dim", "hidden_dim",
                    "embed_dim", "model_dim", "emb_dim")
# Files a tokenizer is built from (fast tokenizer.json, WordPiece, BPE, SentencePiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model", "sentencepiece.model",
                   "tokenizer.tiktoken")


class ModelLoadError(ValueError):
    """The model directory is missing, unreadable or not a text encoder."""


def check_encoder(path: str | Path) -> dict[str, Any]:
    """Fail fast, without loading the weights (or importing torch), unless ``path`` holds a
    text encoder (config, safetensors weights) and its tokenizer; the error names the
    directory. Returns its ``config.json``."""
    path = Path(path)
    config = encoder_config_json(path)
    check_tokenizer_files(path)
    return config


def encoder_config_json(path: Path) -> dict[str, Any]:
    """``config.json`` of an encoder-only model directory with safetensors weights, or
    ModelLoadError (the messages of :func:`ance_train.modeling.model._encoder_config`)."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path}: no config.json (not a Hugging Face model)")
    require_safetensors(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"model directory {path}: cannot load encoder: {error}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"model directory {path}: cannot load encoder: config.json names "
                             "no model_type")
    if config.get("is_encoder_decoder") or not any(
            config.get(key) is not None for key in HIDDEN_SIZE_KEYS):
        raise ModelLoadError(
            f"model directory {path}: {config['model_type']} is not a text encoder")
    return config


def require_safetensors(path: Path) -> None:
    if not any((path / name).is_file() for name in SAFETENSORS_WEIGHTS):
        found = sorted(p.name for p in path.glob("*.bin")) or ["no weights file"]
        raise ModelLoadError(
            f"model directory {path}: no safetensors weights (model.safetensors); found "
            f"{', '.join(found)}. Only safetensors are loaded (pickle files can run code): "
            "convert the weights with save_pretrained(..., safe_serialization=True)")


def check_tokenizer_files(path: Path) -> None:
    """``path`` holds the files of a tokenizer; a ``tokenizer.json`` must load (with the
    ``tokenizers`` library, which does not import torch)."""
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as error:  # the Rust library raises plain Exception
            raise ModelLoadError(
                f"model directory {path}: cannot load tokenizer: {error}") from None
        return
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"model directory {path}: cannot load tokenizer: none of "
                             f"{', '.join(TOKENIZER_FILES)} in it")
