"""Where the base model comes from: a local directory, a Hugging Face Hub id, or an ``s3://``
directory (``model.path``, see :func:`ance_train.config.model_source_kind` and docs/models.md).

A non-local model is resolved ONCE — a Hub id through ``huggingface_hub.snapshot_download``
(into its cache, ``HF_HOME``; ``HF_TOKEN`` for a private or gated model), an ``s3://`` prefix
through the run's S3 settings — by ``ance-train prepare`` (the trainer pod's init step) or by
the embedded launcher, and copied into the run's object store under
:data:`~ance_train.protocol.keys.BASE_MODEL`, with a record of its origin (path, requested
revision, the Hub commit it resolved to) under
:data:`~ance_train.protocol.keys.BASE_MODEL_SOURCE`. The trainer starts from that copy
(:func:`base_model_dir`); inferencers, the indexer and ``export`` read the trainer's
checkpoints, which descend from it. So every role of a run uses the same snapshot even when
the Hub's branch moves on, and pods need no Hub access besides the one that prepares.

``prepare`` run again keeps a stored copy of the same path and revision (no network needed).
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ance_train.config import ModelConfig
from ance_train.infra.store import (
    MANIFEST_NAME,
    ObjectNotFound,
    ObjectStore,
    S3Reader,
    StorageError,
    s3_client_from_env,
)
from ance_train.modeling.files import ModelLoadError, check_encoder
from ance_train.protocol import keys

log = logging.getLogger(__name__)

DEFAULT_REVISION = "main"
# Never downloaded: pickle-based weights (only safetensors are loaded, model.py) and other
# runtimes' exports, which can be several times the model's size.
IGNORED_FILES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.ot", "*.onnx",
                 "*.onnx_data", "onnx/*", "openvino/*", "*.gguf", "*.tflite", "coreml/*")


@dataclass(frozen=True)
class ResolvedModel:
    """A model directory on this machine and the record of where it came from."""

    directory: Path
    record: dict[str, Any]
    scratch: Path | None = None  # a download of ours (s3://), removed by :meth:`cleanup`

    def cleanup(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def requested_revision(config: ModelConfig) -> str | None:
    return (config.revision or DEFAULT_REVISION) if config.source_kind == "hub" else None


def describe(config: ModelConfig) -> str:
    """The model as messages name it."""
    kind = config.source_kind
    if kind == "hub":
        return f"Hugging Face Hub model {config.path!r} (revision {requested_revision(config)})"
    if kind == "s3":
        return f"model directory {config.s3}"
    return f"model directory {config.path}"


def _ignored(rel: str) -> bool:
    return any(fnmatch.fnmatch(rel, pattern) for pattern in IGNORED_FILES)


# -- resolution ----------------------------------------------------------------------------
def resolve_model(config: ModelConfig, scratch: Path) -> ResolvedModel:
    """The model of ``config`` as a local directory: a local path as it is; a Hub id from the
    Hugging Face cache (downloaded there when missing); an ``s3://`` directory downloaded into
    ``scratch``. Raises :class:`ModelLoadError` naming the model and what to do."""
    kind = config.source_kind
    if kind == "hub":
        return _from_hub(config)
    if kind == "s3":
        return _from_s3(config, scratch)
    return ResolvedModel(Path(config.path), {"kind": "local", "path": config.path})


def _hub_help(config: ModelConfig) -> str:
    revision = requested_revision(config)
    flag = "" if revision == DEFAULT_REVISION else f" --revision {revision}"
    return (f"download it where the Hub is reachable with `hf download {config.path}{flag}` "
            f"(older huggingface_hub: `huggingface-cli download {config.path}{flag}`) into the "
            f"same HF_HOME, or run `ance-train prepare --config <run config>` where the Hub is "
            f"reachable (it copies the model into the run's object store, which every service "
            f"reads), or set model.path to a local directory")


def _from_hub(config: ModelConfig) -> ResolvedModel:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    revision = requested_revision(config)
    name = describe(config)
    not_local = " (model.path is no existing local directory, so it was read as a Hub id)"
    try:
        directory = snapshot_download(config.path, revision=revision,
                                      ignore_patterns=list(IGNORED_FILES))
    except RevisionNotFoundError:
        raise ModelLoadError(f"{name}: the Hub has no revision {revision!r} of it: set "
                             f"model.revision to an existing branch, tag or commit") from None
    except GatedRepoError:
        raise ModelLoadError(f"{name} is gated: accept its terms on the Hub and set HF_TOKEN "
                             f"to a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{name}: no such model on the Hub{not_local}, or it is private "
                             f"(then set HF_TOKEN)") from None
    except LocalEntryNotFoundError as error:
        from huggingface_hub import constants

        offline = (" and HF_HUB_OFFLINE is set (unset it to download)"
                   if constants.HF_HUB_OFFLINE else f" and the Hub ({constants.ENDPOINT}) "
                   f"cannot be reached ({type(error.__cause__ or error).__name__})")
        raise ModelLoadError(
            f"{name} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}){offline}: "
            f"{_hub_help(config)}") from None
    except HfHubHTTPError as error:
        raise ModelLoadError(f"{name}: the Hub answered {error}") from None
    path = Path(directory)
    return ResolvedModel(path, {"kind": "hub", "path": config.path, "revision": revision,
                                "commit": path.name})  # snapshots/<commit hash>


def _from_s3(config: ModelConfig, scratch: Path) -> ResolvedModel:
    url = config.s3
    assert url is not None
    client = s3_client_from_env()
    if client is None:
        raise ModelLoadError(f"model.path is {url} but ANCE_S3_ENDPOINT is not set: the model "
                             "is read with the run's S3 settings (ANCE_S3_ENDPOINT, "
                             "ANCE_S3_ACCESS_KEY, ANCE_S3_SECRET_KEY, ANCE_S3_SECURE)")
    reader = S3Reader(client, url.bucket)
    try:
        listing = {key[len(url.key):]: size for key, size in reader.list(url.key).items()}
        files = {rel: size for rel, size in listing.items() if rel and not _ignored(rel)}
        if "config.json" not in files:
            raise ModelLoadError(f"model directory {url}: no config.json under it (not a "
                                 f"Hugging Face model directory; found {len(listing)} objects)")
        target = scratch / "model"
        shutil.rmtree(target, ignore_errors=True)
        digest = hashlib.sha256()
        for rel in sorted(files):
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            sha = hashlib.sha256()
            with reader.open(url.key + rel) as source, open(path, "wb") as sink:
                while chunk := source.read(1 << 20):
                    sha.update(chunk)
                    sink.write(chunk)
            digest.update(f"{rel}\0{sha.hexdigest()}\n".encode())
    except (StorageError, OSError) as error:
        shutil.rmtree(scratch / "model", ignore_errors=True)
        raise ModelLoadError(f"model directory {url}: cannot read it: {error}") from None
    return ResolvedModel(target, {"kind": "s3", "path": str(url), "revision": None,
                                  "commit": digest.hexdigest()}, scratch=target)


# -- the run's copy ------------------------------------------------------------------------
def stored_record(store: ObjectStore) -> dict[str, Any] | None:
    """The origin record of the base model in the run's store, or None."""
    try:
        record = store.get_json(keys.BASE_MODEL_SOURCE)
    except ObjectNotFound:
        return None
    return record if isinstance(record, dict) else None


def _matches(record: dict[str, Any], config: ModelConfig) -> bool:
    path = str(config.s3) if config.source_kind == "s3" else config.path
    return record.get("path") == path and record.get("revision") == requested_revision(config)


def publish_model(store: ObjectStore, resolved: ResolvedModel) -> dict[str, Any]:
    """Copy a non-local base model into the run's store (the record last); returns its
    record. A local model is not copied (the embedded mode and an image both have it)."""
    record = dict(resolved.record)
    if record["kind"] == "local":
        return record
    store.delete(keys.BASE_MODEL_SOURCE)
    manifest = store.put_dir(keys.BASE_MODEL, resolved.directory)
    record["files"] = len(manifest["files"])
    store.put_json(keys.BASE_MODEL_SOURCE, record)
    log.info("base model %s (commit %s) copied to %s", record["path"], record.get("commit"),
             keys.BASE_MODEL)
    return record


def prepare_model(config: ModelConfig, store: ObjectStore, scratch: Path
                  ) -> tuple[dict[str, Any], bool]:
    """Resolve the base model once for the run (``ance-train prepare``): a stored copy of the
    same path and revision is kept (no network); otherwise the model is resolved, checked
    and copied into the store. Returns its record and whether the stored copy was kept."""
    if config.source_kind == "local":
        check_encoder(config.path)
        return {"kind": "local", "path": config.path}, False
    record = stored_record(store)
    if (record is not None and _matches(record, config)
            and store.exists(f"{keys.BASE_MODEL}/{MANIFEST_NAME}")):
        return record, True
    resolved = resolve_model(config, scratch)
    try:
        check_encoder(resolved.directory)
        return publish_model(store, resolved), False
    finally:
        resolved.cleanup()


def base_model_dir(config: ModelConfig, store: ObjectStore, directory: Path) -> Path:
    """The directory the trainer starts from: ``model.path`` when local, else the run's
    stored copy, downloaded into ``directory``. Raises :class:`ModelLoadError` (before any
    work) when the copy is missing or of another model."""
    if config.source_kind == "local":
        return Path(config.path)
    record = stored_record(store)
    prepare = ("run `ance-train prepare --config <run config>` first where the model can be "
               "read (the trainer pod's init container does; `ance-train run` does it itself)")
    if record is None:
        raise ModelLoadError(f"{describe(config)}: the run's object store {store!r} holds no "
                             f"copy of it ({keys.BASE_MODEL_SOURCE}): {prepare}")
    if not _matches(record, config):
        raise ModelLoadError(
            f"{describe(config)}: the run's object store holds a copy of "
            f"{record.get('path')!r} (revision {record.get('revision')}), not of this model: "
            f"{prepare}")
    shutil.rmtree(directory, ignore_errors=True)
    try:
        store.get_dir(keys.BASE_MODEL, directory)
    except ObjectNotFound:
        raise ModelLoadError(f"{describe(config)}: the copy in the run's store is incomplete "
                             f"(no {keys.BASE_MODEL}/{MANIFEST_NAME}): {prepare}") from None
    log.info("base model %s at commit %s, from the run's store", record.get("path"),
             record.get("commit"))
    return directory
