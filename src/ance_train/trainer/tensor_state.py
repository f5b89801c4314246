"""Pickle-free storage of nested state (optimizer, scheduler, RNG states, records).

A nested structure of dicts, lists, tuples, scalars, strings, NumPy arrays and torch tensors
is split in two files: the tensors go to a safetensors file (one entry per tensor, named by
its path in the structure) and everything else to JSON, where each tensor is a placeholder
naming its entry. Dicts with non-string keys (an optimizer's parameter ids), tuples (Python's
RNG state) and NumPy arrays are tagged so that they come back as the same types. Loading never
executes code from the files: JSON and safetensors only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_ITEMS = "__items__"
_ARRAY = "__ndarray__"
_MARKERS = frozenset({_TENSOR, _TUPLE, _ITEMS, _ARRAY})


class StateFormatError(ValueError):
    """The state cannot be written, or the files do not describe a valid state."""


def save_state(state: Any, json_path: Path, tensors_path: Path) -> None:
    """Write ``state`` as ``json_path`` (structure, scalars) + ``tensors_path`` (tensors)."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(state, "state", tensors)
    save_file(tensors, str(tensors_path))
    json_path.write_text(json.dumps(structure))


def load_state(json_path: Path, tensors_path: Path) -> Any:
    """Read back what :func:`save_state` wrote (tensors on the CPU)."""
    try:
        structure = json.loads(json_path.read_text())
        tensors = load_file(str(tensors_path))
    except (OSError, ValueError) as error:
        raise StateFormatError(f"cannot read state {json_path} / {tensors_path}: {error}") from None
    return _decode(structure, tensors, str(json_path))


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise StateFormatError(f"two tensors would be stored as {path!r}")
        tensors[path] = value.detach().cpu().contiguous()
        return {_TENSOR: path}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise StateFormatError(f"cannot store a {value.dtype} array at {path}")
        return {_ARRAY: value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not _MARKERS & value.keys():
            return {k: _encode(v, f"{path}.{k}", tensors) for k, v in value.items()}
        return {_ITEMS: [[_encode(k, f"{path}.key{i}", tensors),
                          _encode(v, f"{path}.{k}", tensors)]
                         for i, (k, v) in enumerate(value.items())]}
    raise StateFormatError(f"cannot store {type(value).__name__} at {path} without pickle")


def _decode(value: Any, tensors: dict[str, torch.Tensor], source: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, source) for v in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        name = value[_TENSOR]
        if name not in tensors:
            raise StateFormatError(f"{source}: tensor {name!r} missing from the tensors file")
        return tensors[name]
    if _ARRAY in value:
        return np.asarray(value[_ARRAY], dtype=np.dtype(value["dtype"]))
    if _TUPLE in value:
        return tuple(_decode(v, tensors, source) for v in value[_TUPLE])
    if _ITEMS in value:
        return {_hashable(_decode(k, tensors, source)): _decode(v, tensors, source)
                for k, v in value[_ITEMS]}
    return {k: _decode(v, tensors, source) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
