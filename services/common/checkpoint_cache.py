"""Loads the model of a published checkpoint from the object store, keeping the latest one."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from .config import ModelConfig
from .model import BiEncoder, load_tokenizer
from .refresh import checkpoint_prefix
from .storage import ObjectStore


class ModelCache:
    def __init__(self, store: ObjectStore, config: ModelConfig, directory: Path,
                 device: torch.device) -> None:
        self.store = store
        self.config = config
        self.directory = directory
        self.device = device
        self.step: int | None = None
        self.model: BiEncoder | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.lock = threading.Lock()

    def get(self, step: int) -> tuple[BiEncoder, PreTrainedTokenizerBase]:
        with self.lock:
            if self.step != step:
                local = self.directory / str(step)
                self.store.get_dir(checkpoint_prefix(step), local)
                model = BiEncoder.from_pretrained(local, self.config).to(self.device).eval()
                tokenizer = load_tokenizer(local)
                if self.step is not None:
                    shutil.rmtree(self.directory / str(self.step), ignore_errors=True)
                self.model, self.tokenizer, self.step = model, tokenizer, step
            assert self.model is not None and self.tokenizer is not None
            return self.model, self.tokenizer
