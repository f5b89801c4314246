"""`ance-train data get beir/NAME`: from a real HTTP server on loopback serving zip archives
made here (ANCE_BEIR_URL points at it)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ance_train_dev.helpers import write_config
from ance_train_dev.synthetic import write_beir


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """(directory served as <url>/beir/datasets/, the environment pointing the CLI at it)."""
    served = tmp_path / "www"
    (served / "beir" / "datasets").mkdir(parents=True)
    handler = functools.partial(_QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/beir/datasets"
    try:
        yield served / "beir" / "datasets", dict(os.environ, ANCE_BEIR_URL=url)
    finally:
        server.shutdown()
        server.server_close()


def make_archive(path: Path, dataset: Path, folder: str | None) -> str:
    """Zip ``dataset`` (inside ``folder/`` as BEIR archives are, or at the top); its md5."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in sorted(dataset.rglob("*")):
            if file.is_file():
                name = file.relative_to(dataset).as_posix()
                archive.write(file, f"{folder}/{name}" if folder else name)
    return hashlib.md5(path.read_bytes()).hexdigest()


def ance(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ance_train.cli", *args], capture_output=True,
                          text=True, env=env, timeout=180)


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def toy_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_beir(tmp_path_factory.mktemp("toy") / "toy", num_docs=60, num_train=24,
                      num_test=8, seed=3)


def test_good_checksum_unpacks_a_dataset_that_validates(mirror, toy_dataset: Path,
                                                        tmp_path: Path, tiny_model) -> None:
    served, env = mirror
    md5 = make_archive(served / "toy.zip", toy_dataset, folder="toy")
    target = tmp_path / "data" / "toy"
    result = ance("data", "get", "beir/toy", "--to", str(target), "--md5", md5, env=env)
    assert result.returncode == 0, result.stderr
    assert "checksum ok: md5 (--md5)" in result.stdout
    for name in ("corpus.jsonl", "queries.jsonl", "qrels/train.tsv", "qrels/test.tsv"):
        assert (target / name).read_bytes() == (toy_dataset / name).read_bytes(), name
    assert leftovers(target.parent) == []  # no download or staging directory left

    config = write_config(tmp_path / "run.yaml", run_id="toy", output_dir=str(tmp_path / "runs"),
                          data={"path": str(target)}, model={"path": str(tiny_model)})
    validated = ance("validate", "--config", str(config), env=env)
    assert validated.returncode == 0, validated.stderr
    assert "ok: 60 docs" in validated.stdout

    again = ance("data", "get", "beir/toy", "--to", str(target), "--md5", md5, env=env)
    assert again.returncode == 1 and "is not empty" in again.stderr  # never overwritten


def test_an_archive_without_a_folder_and_without_a_known_sum_is_unpacked_with_a_warning(
        mirror, toy_dataset: Path, tmp_path: Path) -> None:
    served, env = mirror
    md5 = make_archive(served / "flat.zip", toy_dataset, folder=None)
    target = tmp_path / "flat"
    target.mkdir()  # an empty directory is a fine target
    result = ance("data", "get", "beir/flat", "--to", str(target), env=env)
    assert result.returncode == 0, result.stderr
    assert "no checksum known for flat" in result.stderr and md5 in result.stderr
    assert (target / "qrels" / "train.tsv").is_file()


def test_bad_checksum_is_an_error_and_leaves_nothing(mirror, toy_dataset: Path,
                                                    tmp_path: Path) -> None:
    served, env = mirror
    make_archive(served / "toy.zip", toy_dataset, folder="toy")
    target = tmp_path / "out" / "toy"
    result = ance("data", "get", "beir/toy", "--to", str(target), "--md5", "0" * 32, env=env)
    assert result.returncode == 1
    assert "md5 checksum mismatch" in result.stderr and "expected " + "0" * 32 in result.stderr
    assert not target.exists() and leftovers(target.parent) == []


def test_the_published_md5_is_checked_by_default(mirror, toy_dataset: Path,
                                                tmp_path: Path) -> None:
    """A dataset of the published table (here scifact, served with other contents) is
    checked against BEIR's md5 without any option."""
    served, env = mirror
    make_archive(served / "scifact.zip", toy_dataset, folder="scifact")
    target = tmp_path / "scifact"
    result = ance("data", "get", "beir/scifact", "--to", str(target), env=env)
    assert result.returncode == 1
    assert "5f7d1de60b170fc8027bb7898e2efca1 (published by BEIR)" in result.stderr
    assert not target.exists() and leftovers(tmp_path) == []


def test_missing_dataset_is_a_clear_404(mirror, tmp_path: Path) -> None:
    _, env = mirror
    target = tmp_path / "nope"
    result = ance("data", "get", "beir/nope", "--to", str(target), env=env)
    assert result.returncode == 1
    assert "nope.zip: HTTP 404" in result.stderr and "ANCE_BEIR_URL" in result.stderr
    assert not target.exists() and leftovers(tmp_path) == []


def test_unsafe_or_foreign_archives_are_refused_and_cleaned_up(mirror, toy_dataset: Path,
                                                               tmp_path: Path) -> None:
    served, env = mirror
    with zipfile.ZipFile(served / "evil.zip", "w") as archive:
        archive.writestr("../outside.txt", "x")
    with zipfile.ZipFile(served / "other.zip", "w") as archive:
        archive.writestr("readme.txt", "not a dataset")
    (served / "broken.zip").write_bytes(b"PK not really a zip")
    for name, message in (("evil", "outside the dataset directory"),
                          ("other", "holds no BEIR dataset"),
                          ("broken", "not a readable zip archive")):
        result = ance("data", "get", f"beir/{name}", "--to", str(tmp_path / name), env=env)
        assert result.returncode == 1, name
        assert message in result.stderr, result.stderr
        assert not (tmp_path / name).exists()
    assert not (tmp_path.parent / "outside.txt").exists()
    assert leftovers(tmp_path) == []
    bad_name = ance("data", "get", "scifact", env=env)
    assert bad_name.returncode == 1 and "expected beir/<name>" in bad_name.stderr
