"""Collecting dataset problems: every one names its file and line, and one :class:`DataError`
lists them all (the first :data:`MAX_ERRORS`)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

MAX_ERRORS = 20
"""How many problems a :class:`DataError` lists (all are counted)."""


class DataError(ValueError):
    """The dataset is missing, malformed or inconsistent; the message names file and line."""


class Problems:
    """Collects problems, keeping the first :data:`MAX_ERRORS` messages and counting all."""

    def __init__(self, root: object | None) -> None:
        """``root``: the dataset's directory or ``s3://`` prefix, named in the error."""
        self.root = root
        self.messages: list[str] = []
        self.count = 0

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.messages) < MAX_ERRORS:
            self.messages.append(message)

    def at(self, name: str, line_no: int, message: str) -> None:
        self.add(f"{name} line {line_no}: {message}")

    def raise_if_any(self) -> None:
        if not self.count:
            return
        where = f" in dataset {self.root}" if self.root is not None else ""
        noun = "problem" if self.count == 1 else "problems"
        lines = [f"{self.count} {noun}{where}:"]
        lines += [f"  {message}" for message in self.messages]
        if self.count > len(self.messages):
            lines.append(f"  …and {self.count - len(self.messages)} more")
        raise DataError("\n".join(lines))


def quote(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def display_path(path: object, root: object | None) -> str:
    """The path relative to the dataset directory when it lies inside it, else the full path;
    an object in a bucket is named by its whole ``s3://`` URL."""
    if isinstance(path, Path) and isinstance(root, Path):
        with contextlib.suppress(ValueError):
            return path.relative_to(root).as_posix()
    return str(path)
