"""Loads the model of a published checkpoint from the object store, keeping the latest one."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ance_train.config import ModelConfig
from ance_train.infra.store import ObjectStore
from ance_train.protocol import keys

if TYPE_CHECKING:  # torch and transformers are imported on the first load: an indexer that
    # serves no text query never needs them, and each of its process starts takes ~2 s less
    import torch
    from transformers import PreTrainedTokenizerBase

    from ance_train.modeling.model import BiEncoder

# The trainer's resume state (optimizer moments: about twice the weights' size) is written
# into every checkpoint as ``training_state.*``; a model used for encoding never needs it.
TRAINING_STATE_PREFIX = "training_state."


class ModelCache:
    """``prepare`` (e.g. a precision conversion) is applied once to each loaded model.
    ``device`` None: CUDA if torch sees a GPU, else the CPU, decided on the first load."""

    def __init__(self, store: ObjectStore, config: ModelConfig, directory: Path,
                 device: torch.device | None,
                 prepare: Callable[[BiEncoder], BiEncoder] | None = None) -> None:
        self.store = store
        self.prepare = prepare
        self.config = config
        self.directory = directory
        self.device = device
        self.step: int | None = None
        self.model: BiEncoder | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.lock = threading.Lock()

    def get(self, step: int) -> tuple[BiEncoder, PreTrainedTokenizerBase]:
        import torch

        from ance_train.modeling.model import BiEncoder, load_tokenizer

        with self.lock:
            if self.device is None:
                self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            if self.step != step:
                local = self.directory / str(step)
                self.store.get_dir(keys.checkpoint(step), local,
                                   skip=lambda rel: rel.startswith(TRAINING_STATE_PREFIX))
                model = BiEncoder.from_pretrained(local, self.config).to(self.device).eval()
                if self.prepare is not None:
                    model = self.prepare(model)
                tokenizer = load_tokenizer(local)
                if self.step is not None:
                    shutil.rmtree(self.directory / str(self.step), ignore_errors=True)
                self.model, self.tokenizer, self.step = model, tokenizer, step
            assert self.model is not None and self.tokenizer is not None
            return self.model, self.tokenizer
