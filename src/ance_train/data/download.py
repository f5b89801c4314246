"""``ance-train data get beir/<name>``: an official BEIR archive, checked and unpacked into the
layout ``data.path`` reads (``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``).

The archive is streamed to a temporary file beside the target while its MD5 and SHA-256 are
computed, compared with the expected sum (``--md5`` / ``--sha256``, else the MD5 the BEIR
project publishes, :data:`BEIR_MD5`), and unpacked through :func:`staged_directory`: the
target appears complete or not at all.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ance_train.data.problems import DataError
from ance_train.data.staging import check_target, staged_directory

BEIR_URL = "https://public.ukp.informatik.tu-darmstadt.de/thakur/BEIR/datasets"
"""Where the BEIR project serves ``<name>.zip``; ``ANCE_BEIR_URL`` replaces it (a mirror)."""
BEIR_URL_VAR = "ANCE_BEIR_URL"

# The MD5 of each public archive as the BEIR project publishes it: the "Available Datasets"
# table of README.md in github.com/beir-cellar/beir at commit ef83d29307061c65 (the nfcorpus
# sum also matches ../shared/data/nfcorpus/README.md, whose archive was checked against it).
BEIR_MD5: dict[str, str] = {
    "msmarco": "444067daf65d982533ea17ebd59501e4",
    "trec-covid": "ce62140cb23feb9becf6270d0d1fe6d1",
    "nfcorpus": "a89dba18a62ef92f7d323ec890a0d38d",
    "nq": "d4d3d2e48787a744b6f6e691ff534307",
    "hotpotqa": "f412724f78b0d91183a0e86805e16114",
    "fiqa": "17918ed23cd04fb15047f73e6c3bd9d9",
    "arguana": "8ad3e3c2a5867cdced806d6503f29b99",
    "webis-touche2020": "46f650ba5a527fc69e0a6521c5a23563",
    "cqadupstack": "4e41456d7df8ee7760a7f866133bda78",
    "quora": "18fb154900ba42a600f84b839c173167",
    "dbpedia-entity": "c2a39eb420a3164af735795df012ac2c",
    "scidocs": "38121350fc3a4d2f48850f6aff52e4a9",
    "fever": "5a818580227bfb4b35bb6fa46d9b6c03",
    "climate-fever": "8b66f0a9126c521bae2bde127b4dc99d",
    "scifact": "5f7d1de60b170fc8027bb7898e2efca1",
}
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")
CHUNK = 1 << 20
TIMEOUT_S = 60.0

Progress = Callable[[int, int | None], None]
"""Called with (bytes so far, total bytes or None) while downloading."""


@dataclass(frozen=True)
class Downloaded:
    name: str
    url: str
    target: Path
    bytes: int
    md5: str
    sha256: str
    checked: str | None  # "md5" / "sha256" / "md5 (published by BEIR)"; None: unchecked


def parse_name(spec: str) -> str:
    """``beir/<name>`` → ``<name>``; a :class:`DataError` for anything else."""
    source, _, name = spec.partition("/")
    if source != "beir" or not NAME.fullmatch(name):
        raise DataError(f"unknown dataset {spec!r}: expected beir/<name>, e.g. beir/scifact "
                        f"(published: {', '.join(sorted(BEIR_MD5))})")
    return name


def beir_url(name: str) -> str:
    base = os.environ.get(BEIR_URL_VAR, "").strip() or BEIR_URL
    return f"{base.rstrip('/')}/{name}.zip"


def get_beir(name: str, target: Path, md5: str | None = None, sha256: str | None = None,
             progress: Progress | None = None) -> Downloaded:
    """Download BEIR dataset ``name`` into ``target`` (absent or an empty directory)."""
    target = Path(target)
    check_target(target)  # before the download, not after
    expected = _expected(name, md5, sha256)
    url = beir_url(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(prefix=f".{target.name}.", suffix=".zip",
                                     dir=target.parent) as archive:
        size, digests = _download(url, archive, progress)
        archive.flush()
        if expected is not None:
            kind, want, label = expected
            if digests[kind] != want:
                raise DataError(f"{url}: {kind} checksum mismatch: got {digests[kind]}, "
                                f"expected {want} ({label}); nothing was unpacked")
        with staged_directory(target) as staging:
            _unpack(Path(archive.name), staging, url)
    return Downloaded(name, url, target, size, digests["md5"], digests["sha256"],
                      None if expected is None else f"{expected[0]} ({expected[2]})")


def _expected(name: str, md5: str | None, sha256: str | None) -> tuple[str, str, str] | None:
    """(algorithm, hex digest, where it comes from), or None when no sum is known."""
    for kind, value, length in (("sha256", sha256, 64), ("md5", md5, 32)):
        if value is not None:
            value = value.strip().lower()
            if not re.fullmatch(f"[0-9a-f]{{{length}}}", value):
                raise DataError(f"--{kind} {value!r} is not a {length}-digit hex digest")
            return kind, value, f"--{kind}"
    if name in BEIR_MD5:
        return "md5", BEIR_MD5[name], "published by BEIR"
    return None


def _download(url: str, out, progress: Progress | None) -> tuple[int, dict[str, str]]:
    md5, sha256 = hashlib.md5(usedforsecurity=False), hashlib.sha256()
    request = urllib.request.Request(url, headers={"User-Agent": "ance-train"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            done = 0
            while chunk := response.read(CHUNK):
                out.write(chunk)
                md5.update(chunk)
                sha256.update(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
    except urllib.error.HTTPError as error:
        hint = (f" (no such dataset there: check the name, or set {BEIR_URL_VAR} to a "
                "mirror)" if error.code == 404 else "")
        raise DataError(f"{url}: HTTP {error.code} {error.reason}{hint}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise DataError(f"{url}: download failed: {reason}") from None
    if total is not None and done != total:
        raise DataError(f"{url}: download cut short at {done} of {total} bytes")
    return done, {"md5": md5.hexdigest(), "sha256": sha256.hexdigest()}


def _unpack(archive: Path, staging: Path, url: str) -> None:
    """Extract the archive into ``staging``, lifting the dataset folder most BEIR archives
    wrap their files in (``scifact/corpus.jsonl``) to its top."""
    try:
        with zipfile.ZipFile(archive) as zipped:
            members = [m for m in zipped.infolist()
                       if not m.filename.startswith("__MACOSX/")]
            for member in members:
                parts = PurePosixPath(member.filename).parts
                if member.filename.startswith("/") or ".." in parts or ":" in member.filename:
                    raise DataError(f"{url}: archive member {member.filename!r} would be "
                                    "written outside the dataset directory; refused")
            unzipped = staging / ".unzipped"
            zipped.extractall(unzipped, members)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as error:
        raise DataError(f"{url}: not a readable zip archive ({error})") from None
    root = unzipped
    while not (root / "corpus.jsonl").is_file():
        entries = list(root.iterdir())
        if len(entries) != 1 or not entries[0].is_dir():
            found = sorted(str(p.relative_to(unzipped)) for p in unzipped.rglob("corpus.jsonl"))
            raise DataError(f"{url}: the archive holds no BEIR dataset (corpus.jsonl, "
                            "queries.jsonl, qrels/) at its top"
                            + (f"; it holds several: {', '.join(found[:5])}" if found else ""))
        root = entries[0]
    missing = [name for name in ("queries.jsonl", "qrels") if not (root / name).exists()]
    if missing:
        raise DataError(f"{url}: the archive's dataset lacks {', '.join(missing)}")
    for entry in root.iterdir():
        entry.rename(staging / entry.name)
    shutil.rmtree(unzipped)
