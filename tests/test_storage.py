"""Tests of the object store against a real moto S3 server and real local directories."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ance_train.infra import store as storage
from ance_train.infra.store import (
    MANIFEST_NAME,
    CorruptObject,
    InvalidKey,
    LocalStore,
    ObjectNotFound,
    ObjectStore,
    S3Store,
    StorageError,
    store_from_env,
)

from ance_train_dev.servers import free_port, moto_server

StoreFactory = Callable[[str], ObjectStore]


@pytest.fixture(scope="module")
def moto_env() -> Iterator[dict[str, str]]:
    with moto_server() as env:
        yield env


def _s3(env: dict[str, str], run_id: str, retry_seconds: float = 5.0) -> S3Store:
    return S3Store(
        run_id,
        env["ANCE_S3_ENDPOINT"],
        env["ANCE_S3_ACCESS_KEY"],
        env["ANCE_S3_SECRET_KEY"],
        env["ANCE_S3_BUCKET"],
        secure=False,
        retry_seconds=retry_seconds,
    )


@pytest.fixture(params=["local", "s3"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Factory of stores of one backend sharing one root / bucket."""
    if request.param == "local":
        root = tmp_path / "store"
        return lambda run_id: LocalStore(run_id, root)
    env = request.getfixturevalue("moto_env")
    # moto keeps state for the whole module: give every test its own run ids.
    suffix = uuid.uuid4().hex[:8]
    return lambda run_id: _s3(env, f"{run_id}-{suffix}")


@pytest.fixture
def store(make_store: StoreFactory) -> ObjectStore:
    return make_store("run")


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------- both backends


def test_bytes_roundtrip_and_overwrite(store: ObjectStore) -> None:
    data = b"\x00\x01binary\xff" * 100
    sha = store.put_bytes("checkpoints/100/model.bin", data)
    assert sha == hashlib.sha256(data).hexdigest()
    assert store.get_bytes("checkpoints/100/model.bin") == data
    store.put_bytes("checkpoints/100/model.bin", b"new")
    assert store.get_bytes("checkpoints/100/model.bin") == b"new"
    assert store.put_bytes("empty", b"") == hashlib.sha256(b"").hexdigest()
    assert store.get_bytes("empty") == b""


def test_json_roundtrip(store: ObjectStore) -> None:
    obj = {"step": 100, "metrics": {"mrr@10": 0.331}, "names": ["a", "é"], "ok": True}
    store.put_json("eval/100.json", obj)
    assert store.get_json("eval/100.json") == obj


def test_json_invalid_is_corrupt(store: ObjectStore) -> None:
    store.put_bytes("eval/1.json", b"{not json")
    with pytest.raises(CorruptObject, match=re.escape("eval/1.json")):
        store.get_json("eval/1.json")


def test_file_roundtrip(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "src.npz"
    data = os.urandom((1 << 20) + 12345)  # more than one read chunk
    src.write_bytes(data)
    sha = store.put_file("embeddings/100/passage-0.npz", src)
    assert sha == hashlib.sha256(data).hexdigest()
    dest = tmp_path / "out" / "nested" / "p.npz"
    assert store.get_file("embeddings/100/passage-0.npz", dest) == sha
    assert dest.read_bytes() == data
    assert sorted(p.name for p in dest.parent.iterdir()) == ["p.npz"]  # no temp files left
    # an existing destination is replaced
    store.put_bytes("embeddings/100/passage-0.npz", b"v2")
    store.get_file("embeddings/100/passage-0.npz", dest)
    assert dest.read_bytes() == b"v2"


def test_put_file_missing_source(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        store.put_file("x", tmp_path / "does-not-exist")
    assert not store.exists("x")


def test_list_sorted_recursive_under_prefix(store: ObjectStore) -> None:
    keys = [
        "checkpoints/100/z.json",
        "checkpoints/100/config.json",
        "checkpoints/100/sub/model.safetensors",
        "checkpoints/1000/config.json",
        "negatives/100.npz",
    ]
    for k in keys:
        store.put_bytes(k, k.encode())
    assert store.list("checkpoints/100") == [
        "checkpoints/100/config.json",
        "checkpoints/100/sub/model.safetensors",
        "checkpoints/100/z.json",
    ]
    assert store.list("checkpoints/100/") == store.list("checkpoints/100")
    assert store.list("checkpoints") == sorted(k for k in keys if k.startswith("checkpoints/"))
    assert store.list("") == sorted(keys)
    assert store.list() == sorted(keys)
    assert store.list("eval") == []
    assert not any(k.endswith(".sha256") for k in store.list())


def test_exists_delete(store: ObjectStore, tmp_path: Path) -> None:
    store.put_bytes("negatives/5.npz", b"neg")
    assert store.exists("negatives/5.npz")
    assert not store.exists("negatives/6.npz")
    assert not store.exists("negatives")  # a "directory" is not an object
    store.delete("negatives/5.npz")
    assert not store.exists("negatives/5.npz")
    assert store.list("negatives") == []
    with pytest.raises(ObjectNotFound):
        store.get_bytes("negatives/5.npz")
    store.delete("negatives/5.npz")  # idempotent


def test_missing_object(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound, match="nothing/here"):
        store.get_bytes("nothing/here")
    with pytest.raises(ObjectNotFound):
        store.get_json("nothing/here.json")
    dest = tmp_path / "dl" / "f"
    with pytest.raises(ObjectNotFound):
        store.get_file("nothing/here", dest)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []  # temp file cleaned up


def test_put_dir_get_dir(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    (src / "tokenizer").mkdir(parents=True)
    files = {
        "config.json": b'{"dim": 384}',
        "model.safetensors": os.urandom(3000),
        "tokenizer/vocab.txt": b"[PAD]\n[CLS]\n",
        "tokenizer/empty": b"",
    }
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    manifest = store.put_dir("checkpoints/200", src)
    assert manifest["files"] == {
        rel: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for rel, d in files.items()
    }
    assert store.list("checkpoints/200") == sorted(
        [f"checkpoints/200/{r}" for r in files] + [f"checkpoints/200/{MANIFEST_NAME}"]
    )
    assert store.get_json(f"checkpoints/200/{MANIFEST_NAME}") == manifest
    dest = tmp_path / "restored"
    assert store.get_dir("checkpoints/200", dest) == manifest
    assert _tree(dest) == files


def test_get_dir_skips_the_files_it_is_told_to(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    src.mkdir()
    files = {"model.safetensors": os.urandom(500), "training_state.safetensors": b"moments",
             "training_state.json": b"{}"}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    store.put_dir("checkpoints/7", src)
    dest = tmp_path / "restored"
    store.get_dir("checkpoints/7", dest, skip=lambda rel: rel.startswith("training_state."))
    assert _tree(dest) == {"model.safetensors": files["model.safetensors"]}


def test_put_dir_writes_manifest_last(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "d"
    src.mkdir()
    for name in ("b", "a", "c"):
        (src / name).write_bytes(name.encode())
    order: list[str] = []
    real_put_file, real_put_bytes = store.put_file, store.put_bytes

    def put_file(key: str, path: str | os.PathLike[str], share: bool = False) -> str:
        order.append(key)
        return real_put_file(key, path, share=share)

    def put_bytes(key: str, data: bytes) -> str:
        order.append(key)
        return real_put_bytes(key, data)

    store.put_file = put_file  # type: ignore[method-assign]
    store.put_bytes = put_bytes  # type: ignore[method-assign]
    store.put_dir("x", src)
    assert order == ["x/a", "x/b", "x/c", f"x/{MANIFEST_NAME}"]


def test_interrupted_put_dir_is_never_used(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "d"
    src.mkdir()
    (src / "a").write_bytes(b"v1-a")
    (src / "b").write_bytes(b"v1-b")
    store.put_dir("ckpt", src)
    (src / "a").write_bytes(b"v2-a")
    (src / "b").write_bytes(b"v2-b")
    real_put_file = store.put_file
    calls = 0

    def failing_put_file(key: str, path: str | os.PathLike[str]) -> str:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise StorageError("simulated crash during upload")
        return real_put_file(key, path)

    store.put_file = failing_put_file  # type: ignore[method-assign]
    with pytest.raises(StorageError, match="simulated"):
        store.put_dir("ckpt", src)
    # the old manifest is gone, so the half-new/half-old directory cannot be loaded
    with pytest.raises(ObjectNotFound):
        store.get_dir("ckpt", tmp_path / "out")


def test_get_dir_without_manifest(store: ObjectStore, tmp_path: Path) -> None:
    store.put_bytes("checkpoints/300/config.json", b"{}")
    store.put_bytes("checkpoints/300/model.bin", b"weights")
    dest = tmp_path / "out"
    with pytest.raises(ObjectNotFound, match=MANIFEST_NAME):
        store.get_dir("checkpoints/300", dest)
    assert not dest.exists() or _tree(dest) == {}


def test_get_dir_detects_file_replaced_after_manifest(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "d"
    src.mkdir()
    (src / "w.bin").write_bytes(b"original")
    store.put_dir("ckpt", src)
    # a valid object on its own, but not the one the manifest describes
    store.put_bytes("ckpt/w.bin", b"different")
    with pytest.raises(CorruptObject, match="manifest"):
        store.get_dir("ckpt", tmp_path / "out")
    assert not (tmp_path / "out" / "w.bin").exists()


def test_put_dir_rejects_manifest_name(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "d"
    src.mkdir()
    (src / MANIFEST_NAME).write_bytes(b"{}")
    with pytest.raises(StorageError, match=MANIFEST_NAME):
        store.put_dir("p", src)


BAD_KEYS = [
    "",
    "../x",
    "a/../../x",
    "/abs",
    "a//b",
    "a/./b",
    ".",
    "a/..",
    "a\\b",
    "a/",
    "x\x00y",
    "obj.sha256",
    f"a/.b{storage._TMP_MARKER}",
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_invalid_keys_rejected(store: ObjectStore, key: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidKey):
        store.put_bytes(key, b"x")
    with pytest.raises(InvalidKey):
        store.get_bytes(key)
    with pytest.raises(InvalidKey):
        store.exists(key)
    with pytest.raises(InvalidKey):
        store.delete(key)
    with pytest.raises(ValueError):  # InvalidKey is also a ValueError
        store.get_file(key, tmp_path / "f")
    assert store.list() == []


@pytest.mark.parametrize("prefix", ["../x", "/abs", "a//b", "a/./b", "/"])
def test_invalid_prefixes_rejected(store: ObjectStore, prefix: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidKey):
        store.list(prefix)
    with pytest.raises(InvalidKey):
        store.get_dir(prefix, tmp_path / "out")


@pytest.mark.parametrize("run_id", ["", ".", "..", "a/b", "../x", "-x", "a b"])
def test_invalid_run_ids_rejected(run_id: str, tmp_path: Path, moto_env: dict[str, str]) -> None:
    with pytest.raises(InvalidKey):
        LocalStore(run_id, tmp_path)
    with pytest.raises(InvalidKey):
        _s3(moto_env, run_id)
    assert list(tmp_path.iterdir()) == []


def test_runs_are_isolated(make_store: StoreFactory) -> None:
    a, b = make_store("run-a"), make_store("run-b")
    a.put_bytes("data/x", b"from a")
    b.put_bytes("data/x", b"from b")
    a.put_bytes("only-a", b"1")
    assert a.get_bytes("data/x") == b"from a"
    assert b.get_bytes("data/x") == b"from b"
    assert a.list() == ["data/x", "only-a"]
    assert b.list() == ["data/x"]
    assert not b.exists("only-a")
    b.delete("data/x")
    assert a.get_bytes("data/x") == b"from a"
    assert not b.exists("data/x")


# --------------------------------------------------------------------------- LocalStore


def test_local_layout_and_sidecar(tmp_path: Path) -> None:
    s = LocalStore("r1", tmp_path)
    sha = s.put_bytes("checkpoints/1/config.json", b"{}")
    data_file = tmp_path / "r1" / "checkpoints" / "1" / "config.json"
    assert data_file.read_bytes() == b"{}"
    sidecar = data_file.with_name("config.json.sha256")
    assert sidecar.read_text().strip() == sha
    assert sorted(p.name for p in data_file.parent.iterdir()) == [
        "config.json",
        "config.json.sha256",
    ]


def test_local_sidecar_written_after_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = LocalStore("r1", tmp_path)
    src = tmp_path / "src"
    src.write_bytes(b"file")
    replaced: list[str] = []
    real_replace = os.replace

    def spy(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
        replaced.append(Path(b).name)
        real_replace(a, b)

    monkeypatch.setattr(storage.os, "replace", spy)
    s.put_bytes("k", b"bytes")
    s.put_file("f", src)
    assert replaced == ["k", "k.sha256", "f", "f.sha256"]


def test_local_modified_bytes_are_corrupt(tmp_path: Path) -> None:
    s = LocalStore("r1", tmp_path)
    s.put_bytes("embeddings/1/passage-0.npz", b"A" * 1000)
    path = tmp_path / "r1" / "embeddings" / "1" / "passage-0.npz"
    path.write_bytes(b"A" * 999 + b"B")
    with pytest.raises(CorruptObject, match=re.escape("embeddings/1/passage-0.npz")):
        s.get_bytes("embeddings/1/passage-0.npz")
    dest = tmp_path / "out" / "p.npz"
    dest.parent.mkdir()
    dest.write_bytes(b"previous")
    with pytest.raises(CorruptObject):
        s.get_file("embeddings/1/passage-0.npz", dest)
    assert dest.read_bytes() == b"previous"  # never replaced by corrupt data
    assert sorted(p.name for p in dest.parent.iterdir()) == ["p.npz"]
    path.write_bytes(b"A" * 500)  # truncated
    with pytest.raises(CorruptObject):
        s.get_bytes("embeddings/1/passage-0.npz")


def test_local_bad_sidecar_is_corrupt(tmp_path: Path) -> None:
    s = LocalStore("r1", tmp_path)
    s.put_bytes("k", b"data")
    (tmp_path / "r1" / "k.sha256").write_text("garbage\n")
    with pytest.raises(CorruptObject, match="no valid sha256"):
        s.get_bytes("k")


def test_local_file_without_sidecar_does_not_exist(tmp_path: Path) -> None:
    s = LocalStore("r1", tmp_path)
    s.put_bytes("negatives/1.npz", b"done")
    (tmp_path / "r1" / "negatives" / "2.npz").write_bytes(b"half-written")
    (tmp_path / "r1" / "negatives" / f".3.npz.abc{storage._TMP_MARKER}").write_bytes(b"tmp")
    assert not s.exists("negatives/2.npz")
    assert s.exists("negatives/1.npz")
    assert s.list("negatives") == ["negatives/1.npz"]
    with pytest.raises(ObjectNotFound):
        s.get_bytes("negatives/2.npz")


def test_local_key_conflicts_with_directory(tmp_path: Path) -> None:
    s = LocalStore("r1", tmp_path)
    s.put_bytes("a", b"file")
    with pytest.raises(StorageError):
        s.put_bytes("a/b", b"nested under a file")
    assert s.get_bytes("a") == b"file"


# --------------------------------------------------------------------------- S3Store


def test_s3_metadata_and_key_layout(moto_env: dict[str, str]) -> None:
    s = _s3(moto_env, "layout-run")
    sha = s.put_bytes("eval/7.json", b"{}")
    st = s.client.stat_object(s.bucket, "layout-run/eval/7.json")
    assert st.metadata["x-amz-meta-sha256"] == sha
    names = [o.object_name for o in s.client.list_objects(s.bucket, "layout-run/", recursive=True)]
    assert names == ["layout-run/eval/7.json"]


def test_s3_overwritten_object_is_corrupt(moto_env: dict[str, str], tmp_path: Path) -> None:
    s = _s3(moto_env, "corrupt-run")
    old_sha = s.put_bytes("embeddings/1/query-0.npz", b"good bytes")
    bad = b"evil bytes"
    s.client.put_object(
        s.bucket,
        "corrupt-run/embeddings/1/query-0.npz",
        io.BytesIO(bad),
        len(bad),
        metadata={"sha256": old_sha},
    )
    with pytest.raises(CorruptObject, match=re.escape("embeddings/1/query-0.npz")):
        s.get_bytes("embeddings/1/query-0.npz")
    dest = tmp_path / "q.npz"
    with pytest.raises(CorruptObject):
        s.get_file("embeddings/1/query-0.npz", dest)
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []


def test_s3_object_without_checksum_is_corrupt(moto_env: dict[str, str]) -> None:
    s = _s3(moto_env, "nosha-run")
    s.client.put_object(s.bucket, "nosha-run/data/x", io.BytesIO(b"x"), 1)
    assert s.exists("data/x")
    with pytest.raises(CorruptObject, match="no valid sha256"):
        s.get_bytes("data/x")


def test_s3_large_multipart_roundtrip(moto_env: dict[str, str], tmp_path: Path) -> None:
    s = _s3(moto_env, "big-run")
    src = tmp_path / "big"
    data = os.urandom(11 * 1024 * 1024)  # above minio's 5 MiB part size: multipart upload
    src.write_bytes(data)
    sha = s.put_file("checkpoints/1/model.safetensors", src)
    dest = tmp_path / "big.out"
    assert s.get_file("checkpoints/1/model.safetensors", dest) == sha
    assert dest.read_bytes() == data


def test_s3_creates_bucket(moto_env: dict[str, str]) -> None:
    bucket = f"fresh-{uuid.uuid4().hex[:10]}"
    s = S3Store(
        "r",
        moto_env["ANCE_S3_ENDPOINT"],
        moto_env["ANCE_S3_ACCESS_KEY"],
        moto_env["ANCE_S3_SECRET_KEY"],
        bucket,
        region="us-east-1",
    )
    assert s.client.bucket_exists(bucket)
    s.put_bytes("k", b"v")
    # a second store on the existing bucket works and sees the object
    s2 = S3Store(
        "r",
        moto_env["ANCE_S3_ENDPOINT"],
        moto_env["ANCE_S3_ACCESS_KEY"],
        moto_env["ANCE_S3_SECRET_KEY"],
        bucket,
    )
    assert s2.get_bytes("k") == b"v"


def test_s3_not_found_is_not_retried(moto_env: dict[str, str]) -> None:
    s = _s3(moto_env, "nf-run", retry_seconds=30.0)
    t0 = time.monotonic()
    with pytest.raises(ObjectNotFound):
        s.get_bytes("missing")
    assert time.monotonic() - t0 < 3.0


def test_s3_retries_then_raises_storage_error(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nothing listens here
    caplog.set_level(logging.WARNING, logger=storage.__name__)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=re.escape(f"127.0.0.1:{port}")):
        S3Store("r", f"127.0.0.1:{port}", "AKID", "super-secret-key", "bkt", retry_seconds=2)
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 10.0
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) >= 2
    assert "super-secret-key" not in caplog.text


# --------------------------------------------------------------------------- store_from_env


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("ANCE_S3_") or name == "ANCE_STORE_DIR":
            monkeypatch.delenv(name)
    return monkeypatch


def test_store_from_env_s3(clean_env: pytest.MonkeyPatch, moto_env: dict[str, str]) -> None:
    for k, v in moto_env.items():
        clean_env.setenv(k, v)
    clean_env.setenv("ANCE_STORE_DIR", "/should/not/be/used")
    s = store_from_env("env-run")
    assert isinstance(s, S3Store)
    assert s.bucket == moto_env["ANCE_S3_BUCKET"]
    assert s.run_id == "env-run"
    s.put_json("eval/1.json", {"a": 1})
    assert s.client.stat_object(moto_env["ANCE_S3_BUCKET"], "env-run/eval/1.json").size > 0


def test_store_from_env_default_bucket(
    clean_env: pytest.MonkeyPatch, moto_env: dict[str, str]
) -> None:
    for k, v in moto_env.items():
        if k != "ANCE_S3_BUCKET":
            clean_env.setenv(k, v)
    s = store_from_env("env-run")
    assert isinstance(s, S3Store)
    assert s.bucket == "ance-train"
    assert s.client.bucket_exists("ance-train")


@pytest.mark.parametrize("missing", ["ANCE_S3_ACCESS_KEY", "ANCE_S3_SECRET_KEY"])
def test_store_from_env_missing_credentials(
    clean_env: pytest.MonkeyPatch, moto_env: dict[str, str], missing: str
) -> None:
    for k, v in moto_env.items():
        if k != missing:
            clean_env.setenv(k, v)
    with pytest.raises(StorageError, match=missing):
        store_from_env("r")


def test_store_from_env_bad_secure_flag(
    clean_env: pytest.MonkeyPatch, moto_env: dict[str, str]
) -> None:
    for k, v in moto_env.items():
        clean_env.setenv(k, v)
    clean_env.setenv("ANCE_S3_SECURE", "maybe")
    with pytest.raises(StorageError, match="ANCE_S3_SECURE"):
        store_from_env("r")


def test_store_from_env_local(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("ANCE_STORE_DIR", str(tmp_path / "envdir"))
    s = store_from_env("r1")
    assert isinstance(s, LocalStore)
    s.put_bytes("k", b"v")
    assert (tmp_path / "envdir" / "r1" / "k").read_bytes() == b"v"
    s2 = store_from_env("r1", local_root=str(tmp_path / "argdir"))
    assert isinstance(s2, LocalStore)
    assert s2.root == tmp_path / "argdir"
    assert not s2.exists("k")


def test_store_from_env_unconfigured(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(StorageError, match="ANCE_STORE_DIR"):
        store_from_env("r1")


def test_unfinished_multipart_uploads_of_the_run_are_aborted(moto_env, tmp_path: Path) -> None:
    """A writer killed between the parts of a multipart upload leaves it open (bench/chaos.py
    found two after a soak); the sweep aborts the run's, and only the run's."""
    suffix = uuid.uuid4().hex[:8]
    mine, other = _s3(moto_env, f"mine-{suffix}"), _s3(moto_env, f"other-{suffix}")
    mine.put_bytes("checkpoints/1/done.bin", b"complete")
    client, bucket = mine._client, moto_env["ANCE_S3_BUCKET"]
    for name in (f"mine-{suffix}/checkpoints/1/state.safetensors", f"other-{suffix}/x.bin"):
        upload_id = client._create_multipart_upload(bucket, name, {})
        client._upload_part(bucket, name, b"\0" * (5 * 2**20), None, upload_id, 1)

    def open_uploads() -> list[str]:
        page = client._list_multipart_uploads(bucket, prefix="")
        return sorted(u.object_name for u in page.uploads if suffix in u.object_name)

    assert len(open_uploads()) == 2
    assert mine.abort_unfinished_uploads() == ["checkpoints/1/state.safetensors"]
    assert open_uploads() == [f"other-{suffix}/x.bin"]
    assert mine.list() == ["checkpoints/1/done.bin"]  # complete objects untouched
    assert mine.abort_unfinished_uploads() == []
    assert LocalStore("run", tmp_path).abort_unfinished_uploads() == []
    other.abort_unfinished_uploads()
