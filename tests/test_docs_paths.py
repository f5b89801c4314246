"""The documentation names files and modules that exist, and nothing outside the repository.

Over every Markdown file of docs/ (benchmark reports included), README.md and the READMEs
of services/, bench/ and scripts/:

* a repository path (``src/…``, ``tests/…``, ``bench/…``, ``scripts/…``, ``services/…``,
  ``helm/…``, ``docker/…``, ``configs/…``, ``proto/…`` with a file extension) exists;
* a backticked package path (``protocol/events.py``, ``infra/store/``-style, as
  docs/architecture.md writes them) exists under ``src/ance_train/``, ``src/`` or the root;
* a dotted name ``ance_train.x.y`` is a module, or a module and a name it defines at top level
  (``ance_train.infra.bus.WorkQueue``), found with :mod:`ast`, nothing imported, or an
  entry-point group pyproject.toml declares (``ance_train.negative_strategies``);
* a relative Markdown link, or a backticked ``….md``, points at a file inside the repository.

Only names that once existed and are mentioned *as gone* are listed in ``HISTORICAL``.
"""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
PACKAGE = SRC / "ance_train"
DOCS = sorted({*REPO.glob("docs/**/*.md"), REPO / "README.md",
               *REPO.glob("services/**/README.md"), *REPO.glob("bench/**/README.md"),
               *REPO.glob("scripts/**/README.md")})
HISTORICAL = {
    "services/__init__.py",  # architecture.md, Layout: why the old package root was removed
}
ENTRY_POINT_GROUPS = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get(
    "entry-points", {}))
TOP = r"(?:src|tests|bench|dev|scripts|services|docker|helm|configs|proto)"
EXT = r"(?:py|sh|md|ya?ml|txt|proto|json|conf|c|map|tpl|toml)"
REPO_PATH = re.compile(rf"(?<![\w/.-]){TOP}/[\w/.-]*\w\.{EXT}\b")
PACKAGE_PATH = re.compile(r"`((?:\w+/)+\w+\.py)`")
DOTTED = re.compile(r"\bance_train(?:\.\w+)+")
LINK = re.compile(r"\]\(([^)\s]+)\)")
MD_NAME = re.compile(r"`([\w./-]+\.md)`")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def occurrences(pattern: re.Pattern[str], group: int = 0) -> list[tuple[str, str]]:
    return [(rel(doc), match.group(group)) for doc in DOCS
            for match in pattern.finditer(doc.read_text())]


def test_the_documents_are_found() -> None:
    assert REPO / "docs" / "architecture.md" in DOCS
    assert len(DOCS) > 10


@pytest.mark.parametrize("doc, path", sorted(set(occurrences(REPO_PATH))))
def test_repository_path_exists(doc: str, path: str) -> None:
    assert path in HISTORICAL or (REPO / path).exists(), f"{doc} names {path}"


@pytest.mark.parametrize("doc, path", sorted(set(occurrences(PACKAGE_PATH, 1))))
def test_package_path_exists(doc: str, path: str) -> None:
    assert path in HISTORICAL or any(
        (base / path).exists() for base in (PACKAGE, SRC, REPO)), f"{doc} names {path}"


@cache
def top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def module_path(parts: list[str]) -> Path | None:
    base = SRC.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@pytest.mark.parametrize("doc, name", sorted(set(occurrences(DOTTED))))
def test_dotted_module_name_exists(doc: str, name: str) -> None:
    if name in ENTRY_POINT_GROUPS:
        return
    parts = name.split(".")
    for length in range(len(parts), 0, -1):
        path = module_path(parts[:length])
        if path is not None:
            break
    else:
        raise AssertionError(f"{doc} names {name}: no such module")
    rest = parts[length:]
    if rest:  # a module, then a name it defines (a method after it is not checked)
        assert rest[0] in top_level_names(path), (
            f"{doc} names {name}: {'.'.join(parts[:length])} has no {rest[0]}")


@pytest.mark.parametrize("doc, target", sorted(set(occurrences(LINK, 1))))
def test_relative_link_stays_inside_and_exists(doc: str, target: str) -> None:
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
        return  # a URL or an anchor of the same page
    path = ((REPO / doc).parent / target.split("#")[0]).resolve()
    assert path.is_relative_to(REPO), f"{doc} links outside the repository: {target}"
    assert path.exists(), f"{doc} links to a missing {target}"


@pytest.mark.parametrize("doc, name", sorted(set(occurrences(MD_NAME, 1))))
def test_named_markdown_file_exists_inside(doc: str, name: str) -> None:
    candidates = [((REPO / doc).parent / name).resolve(), (REPO / name).resolve()]
    inside = [path for path in candidates if path.is_relative_to(REPO)]
    assert any(path.exists() for path in inside), (
        f"{doc} names {name}, which is not a file of the repository")
