"""Reads a safetensors object straight into a resident module's tensors, verified as it goes.

:class:`~ance_train.modeling.checkpoint_cache.ModelCache` swaps a new checkpoint's weights
into its resident model with it. The object is read once, chunk by chunk, into the module's
parameters and buffers themselves, and each chunk is hashed as it lands
(:class:`~ance_train.infra.store.verified.VerifiedReader`): the checksum verified is that of
the bytes the model holds, and no copy of the file is made. A tensor whose dtype, layout or
device differs from the file's (a bf16 model, a GPU) is read into a tensor of the file's
dtype, then copied in with ``copy_``, as ``load_state_dict`` copies: the result is the same,
bit for bit.

The layout (the safetensors format): an 8-byte little-endian header length, the JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, optional ``__metadata__``),
then the tensors' bytes back to back. A file that does not fit the module exactly (other
names or shapes, an unknown dtype, holes) or a module with its own state-dict loading hooks
gets None from :func:`plan_read`, before anything is written: it is loaded whole.
"""

from __future__ import annotations

import json
import math
import struct

import torch
from torch import nn

from ance_train.infra.store.verified import VerifiedReader

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER = 100 << 20  # the format's own limit

# Per tensor of the file, in its order: (the module's tensor, the tensor its bytes land in).
Plan = list[tuple[torch.Tensor, torch.Tensor]]


def plan_read(reader: VerifiedReader, module: nn.Module) -> Plan | None:
    """Read the header of the safetensors object and match it to ``module``'s state dict;
    None where it does not fit exactly (nothing is written to the module here)."""
    if any(_custom_loading(m) for m in module.modules()):
        return None
    length = bytearray(8)
    reader.readinto(memoryview(length))
    (header_size,) = struct.unpack("<Q", length)
    if header_size > min(MAX_HEADER, reader.size - 8):
        return None
    header_bytes = bytearray(header_size)
    reader.readinto(memoryview(header_bytes))
    try:
        header = json.loads(header_bytes)
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    header.pop("__metadata__", None)
    state = module.state_dict()
    if set(header) != set(state):
        return None
    plan: Plan = []
    end = 0
    for name, info in sorted(header.items(), key=lambda item: _begin(item[1])):
        slot = _slot(info, state[name], end)
        if slot is None:
            return None
        plan.append(slot)
        end += slot[1].numel() * slot[1].element_size()
    return plan if 8 + header_size + end == reader.size else None


def read_into(reader: VerifiedReader, plan: Plan) -> None:
    """Read the tensors of ``plan`` (after :func:`plan_read`) into the module, then verify
    the object (CorruptObject: the module holds unverified bytes and must not be used)."""
    with torch.no_grad():
        for target, into in plan:
            reader.readinto(into.reshape(-1).view(torch.uint8).numpy().data)
            if into is not target:
                target.copy_(into)
    reader.verify()


def _custom_loading(module: nn.Module) -> bool:
    return bool(module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks
                or type(module)._load_from_state_dict is not nn.Module._load_from_state_dict)


def _begin(info: object) -> int:
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    return offsets[0] if isinstance(offsets, list) and offsets and isinstance(
        offsets[0], int) else -1


def _slot(info: object, target: torch.Tensor, begin: int
          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where a tensor of the file that starts at ``begin`` lands in ``target``; None where it
    does not fit (another shape, an unknown dtype, not right after the previous one)."""
    if not isinstance(info, dict):
        return None
    dtype, shape, offsets = (DTYPES.get(str(info.get("dtype"))), info.get("shape"),
                             info.get("data_offsets"))
    if (dtype is None or not isinstance(shape, list) or list(target.shape) != shape
            or offsets != [begin, begin + math.prod(shape) * dtype.itemsize]):
        return None
    if target.dtype == dtype and target.device.type == "cpu" and target.is_contiguous():
        return target, target
    return target, torch.empty(shape, dtype=dtype)
