"""Loads the model of a published checkpoint from the object store, keeping the latest one.

A checkpoint's model is read against its ``WEIGHTS.json``, written before the checkpoint is
announced and while its training state is still uploading (``MANIFEST.json`` for one stored
before ``WEIGHTS.json`` existed; :mod:`ance_train.protocol.checkpoints`): an encoder never
waits for, nor reads, the optimizer state.

With ``reuse`` (the inferencer's ``inference.reuse_between_refreshes``) the model stays
resident between checkpoints: when a new checkpoint differs from the one loaded only in its
weights (every other file of its manifest has the same sha256: config, tokenizer, pooling and
prompts), only ``model.safetensors`` (and the projection head) is read, straight into the
resident model's tensors and hashed as it is read (:mod:`.weight_swap`: one pass, no copy of
the file), converted where the model was (bf16 rounds the same way either way, so the result
is the model a full load gives, bit for bit: ``tests/test_encoding.py``,
``tests/test_weight_swap.py``). Anything else, or a weight file that does not fit the resident
model, loads the whole checkpoint as before; weights that fail their checksum once read in
leave no resident model (the next load is a whole one).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ance_train.config import ModelConfig
from ance_train.infra.store import CorruptObject, ObjectNotFound, ObjectStore
from ance_train.protocol import keys

if TYPE_CHECKING:  # torch and transformers are imported on the first load: an indexer that
    # serves no text query never needs them, and each of its process starts takes ~2 s less
    import torch
    from transformers import PreTrainedTokenizerBase

    from ance_train.modeling.model import BiEncoder
    from ance_train.modeling.weight_swap import Plan

# What changes from one checkpoint to the next of a run: the encoder's and the head's weights.
ENCODER_WEIGHTS = "model.safetensors"
HEAD_WEIGHTS = "ance_head.safetensors"  # modeling.model.HEAD_FILE
WEIGHT_FILES = (ENCODER_WEIGHTS, HEAD_WEIGHTS)


def weights_manifest(store: ObjectStore, step: int) -> tuple[str, dict]:
    """The name and content of the manifest that lists checkpoint ``step``'s model files:
    its WEIGHTS.json, or MANIFEST.json in a checkpoint stored before WEIGHTS.json existed
    (ObjectNotFound when it has neither)."""
    try:
        return (keys.CHECKPOINT_WEIGHTS_MANIFEST,
                store.get_json(keys.checkpoint_weights_manifest(step)))
    except ObjectNotFound:
        return keys.CHECKPOINT_MANIFEST, store.get_json(keys.checkpoint_manifest(step))


def download_model(store: ObjectStore, step: int, directory: Path) -> dict:
    """Download checkpoint ``step``'s model (every file but the training state) into
    ``directory``, verified against :func:`weights_manifest`; returns that manifest."""
    prefix = keys.checkpoint(step)
    try:
        return store.get_dir(prefix, directory, skip=keys.is_training_state,
                             manifest_name=keys.CHECKPOINT_WEIGHTS_MANIFEST)
    except ObjectNotFound:
        if store.exists(keys.checkpoint_weights_manifest(step)):
            raise  # an object it lists is missing
        return store.get_dir(prefix, directory, skip=keys.is_training_state)


class ModelCache:
    """``prepare`` (e.g. a precision conversion) is applied once to each loaded model.
    ``device`` None: CUDA if torch sees a GPU, else the CPU, decided on the first load."""

    def __init__(self, store: ObjectStore, config: ModelConfig, directory: Path,
                 device: torch.device | None,
                 prepare: Callable[[BiEncoder], BiEncoder] | None = None,
                 reuse: bool = False) -> None:
        self.store = store
        self.reuse = reuse
        self.reloaded: bool | None = None  # the last new checkpoint was built from scratch
        # sha256 of the loaded checkpoint's files other than the weights (None: none loaded)
        self.fingerprint: str | None = None
        self._others: dict[str, str] | None = None
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
                if not (self.reuse and self._replace_weights(step)):
                    manifest = download_model(self.store, step, local)
                    model = BiEncoder.from_pretrained(local, self.config).to(self.device).eval()
                    if self.prepare is not None:
                        model = self.prepare(model)
                    self.model, self.tokenizer = model, load_tokenizer(local)
                    self._remember(manifest)
                    self.reloaded = True
                if self.step is not None:
                    shutil.rmtree(self.directory / str(self.step), ignore_errors=True)
                self.step = step
            assert self.model is not None and self.tokenizer is not None
            return self.model, self.tokenizer

    def _remember(self, manifest: dict) -> None:
        others = {rel: info["sha256"] for rel, info in manifest["files"].items()
                  if rel not in WEIGHT_FILES and not keys.is_training_state(rel)}
        self._others = others
        self.fingerprint = hashlib.sha256(json.dumps(others, sort_keys=True).encode()
                                          ).hexdigest()

    def _replace_weights(self, step: int) -> bool:
        """Copy checkpoint ``step``'s weights into the resident model when nothing else of it
        differs from the loaded one; False: it must be loaded whole."""
        from ance_train.modeling.weight_swap import plan_read, read_into

        if self.model is None or self._others is None:
            return False
        prefix = keys.checkpoint(step)
        _, manifest = weights_manifest(self.store, step)
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or ENCODER_WEIGHTS not in files:
            return False
        others = {rel: info.get("sha256") for rel, info in files.items()
                  if rel not in WEIGHT_FILES and not keys.is_training_state(rel)}
        head = HEAD_WEIGHTS in files
        if others != self._others or head != (self.model.projection is not None):
            return False
        names = WEIGHT_FILES if head else (ENCODER_WEIGHTS,)
        modules = {ENCODER_WEIGHTS: self.model.encoder, HEAD_WEIGHTS: self.model.projection}
        with contextlib.ExitStack() as stack:
            readers = {name: stack.enter_context(self.store.open_verified(f"{prefix}/{name}"))
                       for name in names}
            plans: dict[str, Plan] = {}
            for name, reader in readers.items():
                if reader.size != files[name].get("size"):
                    self.store.get_bytes(reader.key)  # a corrupt object: its checksum's error
                    raise CorruptObject(f"object {reader.key!r} has {reader.size} bytes but "
                                        f"the manifest records {files[name].get('size')}")
                module = modules[name]
                assert module is not None  # a head iff the checkpoint has one (checked above)
                plan = plan_read(reader, module)
                if plan is None:  # keys or shapes that do not fit: a full load sorts it out
                    return False  # (nothing was written to the resident model)
                plans[name] = plan
            try:
                for name, reader in readers.items():
                    read_into(reader, plans[name])
            except BaseException:
                self.model = self.tokenizer = None  # partly overwritten: never used again
                self._others = self.step = None
                raise
        self.reloaded = False
        return True
