"""model.path as a Hugging Face Hub id (with model.revision) or an s3:// directory: resolved
once by `prepare` (or the embedded launcher), copied into the run's store, and every role
uses that copy; `export --push-to-hub` uploads through huggingface_hub.

The Hub is a loopback stand-in (dev/ance_train_dev/hub_standin.py) serving the endpoints the real
huggingface_hub client calls; the commands run as real processes with HF_ENDPOINT pointing
at it and HF_HOME in a temporary directory. S3 is the moto server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from minio import Minio
from safetensors.torch import load_file

from ance_train.config import ConfigError, ModelConfig, load_config, parse_config
from ance_train.data.corpus import open_corpus
from ance_train.infra.store import LocalStore, store_from_env
from ance_train.modeling.model import BiEncoder, ModelLoadError, load_tokenizer
from ance_train.modeling.source import base_model_dir, stored_record
from ance_train.protocol import keys
from ance_train.protocol.embeddings import unpack_embeddings
from ance_train.runtime import fetch_dataset

from ance_train_dev.helpers import make_tiny_bert, write_config
from ance_train_dev.hub_standin import HubStandIn

REPO_ID = "ance-test/tiny-bert"


def cli(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ance_train.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def hub_env(hub: HubStandIn, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "ANCE_S3_", "HUGGINGFACE_"))}
    return {**env, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", **extra}


@pytest.fixture
def hub(tmp_path: Path):
    with HubStandIn() as stand_in:
        yield stand_in


@pytest.fixture(scope="module")
def two_berts(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hub-models")
    return make_tiny_bert(root / "v1", seed=1), make_tiny_bert(root / "v2", seed=2)


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -- how model.path is read ----------------------------------------------------------------
def test_a_hub_id_stays_an_existing_local_directory_wins_and_revision_needs_a_hub_id(
        tmp_path: Path, scifact_subset: Path, tiny_model: Path) -> None:
    data = {"path": str(scifact_subset)}
    hub_id = load_config(write_config(tmp_path / "hub.yaml", data=data,
                                      model={"path": "BAAI/bge-small-en-v1.5",
                                             "revision": "v1"}))
    assert hub_id.model.path == "BAAI/bge-small-en-v1.5"
    assert hub_id.model.source_kind == "hub" and hub_id.model.revision == "v1"
    # org/name that exists next to the config file is that directory.
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    wins = load_config(write_config(tmp_path / "local.yaml", data=data,
                                    model={"path": "org/name"}))
    assert wins.model.path == str(local) and wins.model.source_kind == "local"
    s3 = load_config(write_config(tmp_path / "s3.yaml", data=data,
                                  model={"path": "s3://models/tiny/"}))
    assert s3.model.path == "s3://models/tiny/" and s3.model.source_kind == "s3"
    # A path that is not of the Hub's form is a (missing) local directory, made absolute.
    missing = load_config(write_config(tmp_path / "missing.yaml", data=data,
                                       model={"path": "./models/x"}))
    assert missing.model.path == str(tmp_path / "models" / "x")
    with pytest.raises(ConfigError, match=r"model: Value error, model.revision \('v1'\) "
                                          r"applies to a Hugging Face Hub id only"):
        parse_config({"data": data, "model": {"path": str(tiny_model), "revision": "v1"}})
    with pytest.raises(ConfigError, match=r"model\.path: Value error.*invalid bucket name"):
        parse_config({"data": data, "model": {"path": "s3://A_B/x"}})
    with pytest.raises(ConfigError, match=r"model\.pooling"):
        parse_config({"data": data, "model": {"pooling": "max"}})
    assert ModelConfig(pooling="last_token").pooling == "last_token"


# -- Hub ids ---------------------------------------------------------------------------------
def test_prepare_copies_the_hub_snapshot_once_and_the_trainer_loads_that_copy(
        tmp_path: Path, hub: HubStandIn, two_berts: tuple[Path, Path],
        scifact_subset: Path) -> None:
    v1, v2 = two_berts
    first = hub.commit_folder(REPO_ID, v1)
    config = write_config(tmp_path / "config.yaml", run_id="hub-prepare",
                          data={"path": str(scifact_subset)}, model={"path": REPO_ID})
    env = hub_env(hub, tmp_path / "hf")
    store_dir = tmp_path / "store"
    done = cli("prepare", "--config", str(config), "--store-dir", str(store_dir), env=env)
    assert done.returncode == 0, done.stderr
    assert f"copied model {REPO_ID} (commit {first})" in done.stdout
    store = LocalStore("hub-prepare", store_dir)
    record = stored_record(store)
    assert record == {"kind": "hub", "path": REPO_ID, "revision": "main", "commit": first,
                      "files": 4}
    # The Hub's main moves on; prepare again keeps the run's snapshot and downloads nothing.
    hub.commit_folder(REPO_ID, v2)
    downloads = len(hub.downloads())
    again = cli("prepare", "--config", str(config), "--store-dir", str(store_dir), env=env)
    assert again.returncode == 0, again.stderr
    assert f"kept model {REPO_ID} (commit {first})" in again.stdout
    assert len(hub.downloads()) == downloads
    # The trainer's starting point is the stored copy, byte for byte the first commit.
    loaded = base_model_dir(load_config(config).model, store, tmp_path / "trainer-base")
    for name, data in hub.files(REPO_ID, first).items():
        assert (loaded / name).read_bytes() == data, name
    assert_same_weights(weights(loaded), weights(v1))


def test_revision_pins_a_commit_and_a_moved_model_needs_prepare_again(
        tmp_path: Path, hub: HubStandIn, two_berts: tuple[Path, Path],
        scifact_subset: Path) -> None:
    v1, v2 = two_berts
    first = hub.commit_folder(REPO_ID, v1)
    hub.commit_folder(REPO_ID, v2)  # main is now v2
    config = write_config(tmp_path / "config.yaml", run_id="hub-pinned",
                          data={"path": str(scifact_subset)},
                          model={"path": REPO_ID, "revision": first})
    store_dir = tmp_path / "store"
    done = cli("prepare", "--config", str(config), "--store-dir", str(store_dir),
               env=hub_env(hub, tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    store = LocalStore("hub-pinned", store_dir)
    assert stored_record(store)["commit"] == first
    loaded = base_model_dir(load_config(config).model, store, tmp_path / "base")
    assert_same_weights(weights(loaded), weights(v1))
    # A config naming another revision does not silently train from this copy.
    other = ModelConfig(path=REPO_ID, revision="main")
    with pytest.raises(ModelLoadError, match=rf"holds a copy of '{REPO_ID}' \(revision "
                                             rf"{first}\), not of this model: run "
                                             r"`ance-train prepare"):
        base_model_dir(other, store, tmp_path / "other")
    empty = LocalStore("never-prepared", store_dir)
    with pytest.raises(ModelLoadError, match=rf"Hugging Face Hub model '{REPO_ID}' \(revision "
                                             r"main\): the run's object store .* holds no copy "
                                             r"of it \(model/source.json\): run `ance-train "
                                             r"prepare --config"):
        base_model_dir(other, empty, tmp_path / "none")


def test_offline_without_the_model_the_error_names_it_and_what_to_run(
        tmp_path: Path, hub: HubStandIn, scifact_subset: Path) -> None:
    """HF_HUB_OFFLINE with an empty cache: validate, prepare and run all stop before any
    work, naming the model and the command that fetches it."""
    config = write_config(tmp_path / "config.yaml", run_id="offline",
                          output_dir=str(tmp_path / "runs"), data={"path": str(scifact_subset)},
                          model={"path": REPO_ID, "revision": "v2"})
    env = hub_env(hub, tmp_path / "hf", HF_HUB_OFFLINE="1")
    expected = (f"error: Hugging Face Hub model '{REPO_ID}' (revision v2) is not in the "
                f"Hugging Face cache ({tmp_path / 'hf' / 'hub'}) and HF_HUB_OFFLINE is set "
                f"(unset it to download): download it where the Hub is reachable with `hf "
                f"download {REPO_ID} --revision v2`")
    for command in (["validate", "--config", str(config)],
                    ["prepare", "--config", str(config), "--store-dir", str(tmp_path / "s")],
                    ["run", "--config", str(config)]):
        failed = cli(*command, env=env)
        assert failed.returncode == 1, failed.stdout + failed.stderr
        message = " ".join(failed.stderr.split())
        assert expected in message, message
        assert "`ance-train prepare --config <run config>`" in message
    assert not (tmp_path / "runs" / "offline").exists()  # no work started
    assert not (tmp_path / "s").exists()
    assert hub.requests == []  # offline: nothing asked of the Hub
    # Online, an unknown repo is named as such.
    missing = cli("validate", "--config", str(config), env=hub_env(hub, tmp_path / "hf"))
    assert missing.returncode == 1
    assert (f"Hugging Face Hub model '{REPO_ID}' (revision v2): no such model on the Hub"
            in " ".join(missing.stderr.split()))


@pytest.mark.e2e
def test_every_role_uses_the_same_hub_snapshot(
        tmp_path: Path, hub: HubStandIn, two_berts: tuple[Path, Path], scifact_subset: Path
) -> None:
    """An embedded run from a Hub id: the launcher resolves it once; the trainer's zero-shot
    checkpoint (what inferencers and the indexer load) holds the Hub commit's weights, the
    inferencers' step-0 embeddings are that model's, and export names the Hub id."""
    v1, _ = two_berts
    commit = hub.commit_folder(REPO_ID, v1)
    config_path = write_config(
        tmp_path / "config.yaml", run_id="hub-run", output_dir=str(tmp_path / "runs"),
        data={"path": str(scifact_subset), "dev_fraction": 0.2},
        model={"path": REPO_ID, "max_query_length": 16, "max_doc_length": 32,
               "query_prompt": "query: ", "document_prompt": "passage: "},
        training={"steps": 2, "batch_size": 4, "refresh_every": 2, "warmup_steps": 1,
                  "torch_threads": 1, "mixed_precision": "off"},
        negatives={"pool": "random", "per_query": 1, "warmup": "none"},
        inference={"replicas": 1, "shard_size": 150, "batch_size": 32, "torch_threads": 1,
                   "precision": "fp32", "embedding_dtype": "float32"},
    )
    env = hub_env(hub, tmp_path / "hf", PYTHONUNBUFFERED="1")
    done = cli("run", "--config", str(config_path), "--max-minutes", "6", env=env, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    store = LocalStore("hub-run", tmp_path / "runs" / "hub-run" / "store")
    assert stored_record(store)["commit"] == commit
    zero_shot = tmp_path / "checkpoint-0"
    store.get_dir(keys.checkpoint(0), zero_shot)
    assert_same_weights(weights(zero_shot), weights(v1))
    meta = json.loads((zero_shot / "ance_model.json").read_text())
    assert (meta["query_prompt"], meta["document_prompt"]) == ("query: ", "passage: ")
    # The inferencer's corpus embeddings of step 0 are the Hub model's, document prompt on.
    from ance_train.modeling.encoding import encode_texts

    config = load_config(config_path)
    hub_model = BiEncoder.from_pretrained(v1, config.model)
    shard = next(key for key in store.list(keys.embeddings(0)) if "/corpus-" in key)
    ids, vectors = unpack_embeddings(store.get_bytes(shard))
    fetch_dataset(store, tmp_path / "data")
    texts = open_corpus(config.data, tmp_path / "data").texts([int(i) for i in ids])
    expected = encode_texts(hub_model, load_tokenizer(v1), texts,
                            config.model.max_doc_length, kind="document")
    np.testing.assert_allclose(vectors, expected, atol=1e-5)
    unprompted = encode_texts(hub_model, load_tokenizer(v1), texts,
                              config.model.max_doc_length)
    assert not np.allclose(vectors, unprompted, atol=1e-3)  # the prompt was applied
    out = tmp_path / "export"
    exported = cli("export", "--run", str(config_path), "--checkpoint", "0", "--out", str(out),
                   env=env)
    assert exported.returncode == 0, exported.stderr
    assert_same_weights(weights(out), weights(v1))
    assert f"base_model: {REPO_ID}" in (out / "README.md").read_text()


# -- s3:// -----------------------------------------------------------------------------------
def test_an_s3_model_directory_is_copied_into_the_run_store(
        tmp_path: Path, s3_env: dict[str, str], tiny_model: Path, scifact_subset: Path) -> None:
    client = Minio(s3_env["ANCE_S3_ENDPOINT"], s3_env["ANCE_S3_ACCESS_KEY"],
                   s3_env["ANCE_S3_SECRET_KEY"], secure=False)
    if not client.bucket_exists("models"):
        client.make_bucket("models")
    for path in sorted(tiny_model.rglob("*")):
        if path.is_file():
            client.fput_object("models", f"tiny/bert/{path.relative_to(tiny_model)}", str(path))
    with open(os.devnull, "rb") as empty:  # pickle weights in the bucket are not fetched
        client.put_object("models", "tiny/bert/pytorch_model.bin", empty, 0)
    config = write_config(tmp_path / "config.yaml", run_id="s3-model",
                          data={"path": str(scifact_subset)},
                          model={"path": "s3://models/tiny/bert"})
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HF_")}, **s3_env,
           "HF_HUB_OFFLINE": "1"}
    done = cli("prepare", "--config", str(config), env=env)
    assert done.returncode == 0, done.stderr
    old = {k: os.environ.get(k) for k in s3_env}
    os.environ.update(s3_env)
    try:
        store = store_from_env("s3-model")
        record = stored_record(store)
        loaded = base_model_dir(load_config(config).model, store, tmp_path / "base")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert record["kind"] == "s3" and record["path"] == "s3://models/tiny/bert/"
    assert record["files"] == sum(1 for p in tiny_model.rglob("*") if p.is_file())
    assert not (loaded / "pytorch_model.bin").exists()  # pickle weights are never fetched
    for path in tiny_model.rglob("*"):
        if path.is_file():
            assert (loaded / path.relative_to(tiny_model)).read_bytes() == path.read_bytes()
    missing = write_config(tmp_path / "missing.yaml", run_id="s3-missing",
                           data={"path": str(scifact_subset)},
                           model={"path": "s3://models/nothing/here"})
    failed = cli("validate", "--config", str(missing), env=env)
    assert failed.returncode == 1
    assert ("model directory s3://models/nothing/here/: no config.json under it"
            in " ".join(failed.stderr.split()))


# -- export --push-to-hub ------------------------------------------------------------------
def test_export_pushes_the_exported_directory_to_the_hub(
        tmp_path: Path, hub: HubStandIn, tiny_model: Path) -> None:
    store = LocalStore("push-run", tmp_path / "store")
    model = BiEncoder.from_pretrained(tiny_model, ModelConfig(query_prompt="query: "))
    model.save(tmp_path / "checkpoint", load_tokenizer(tiny_model))
    store.put_dir(keys.checkpoint(3), tmp_path / "checkpoint")
    out = tmp_path / "out"
    env = hub_env(hub, tmp_path / "hf", HF_TOKEN="hf_standin_token")
    done = cli("export", "--run", "push-run", "--store-dir", str(tmp_path / "store"),
               "--checkpoint", "last", "--out", str(out), "--push-to-hub", "me/ance-tiny",
               env=env)
    assert done.returncode == 0, done.stderr
    pushed = hub.files("me/ance-tiny")
    local = {p.relative_to(out).as_posix(): p.read_bytes()
             for p in out.rglob("*") if p.is_file()}
    assert pushed == local
    assert "config_sentence_transformers.json" in pushed and "README.md" in pushed
    commit = hub.repos["me/ance-tiny"].refs["main"]
    assert f"pushed to the Hub: {hub.endpoint}/me/ance-tiny/commit/{commit}" in " ".join(
        done.stdout.split())
    posts = [(path, auth) for method, path, auth in hub.requests if method == "POST"]
    assert [path for path, _ in posts] == [
        "/api/repos/create", "/api/validate-yaml", "/api/models/me/ance-tiny/preupload/main",
        "/api/models/me/ance-tiny/commit/main"]
    assert {auth for _, auth in posts} == {"Bearer hf_standin_token"}
    # Without a token the Hub refuses; the error names the repo.
    failed = cli("export", "--run", "push-run", "--store-dir", str(tmp_path / "store"),
                 "--checkpoint", "last", "--out", str(tmp_path / "out2"),
                 "--push-to-hub", "not a repo id", env=env)
    assert failed.returncode == 1
    assert "cannot push" in failed.stderr and "'not a repo id'" in failed.stderr
