"""Torch dtypes by name, and their sizes, so specs and plans can be written as plain data."""

from __future__ import annotations

import torch

from kvspec_core.errors import UnknownNameError

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float64": torch.float64,
}
#: Names model configs use for the same dtypes.
_ALIASES = {
    "float": "float32",
    "half": "float16",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "double": "float64",
}


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``, ``"torch.float16"``, ``"half"``...)."""
    if not isinstance(name, str):
        raise UnknownNameError(f"a torch dtype name must be a str, got {name!r}")
    key = name.removeprefix("torch.")
    key = _ALIASES.get(key, key)
    try:
        return _TORCH_DTYPES[key]
    except KeyError:
        raise UnknownNameError(
            f"unknown torch dtype {name!r}; known: {sorted(_TORCH_DTYPES)}"
        ) from None


def dtype_from_written_name(name: str) -> torch.dtype:
    """The torch dtype :func:`dtype_name` wrote as ``name``: any torch dtype, not only the
    ones model configs use, since a spec may hold any ``torch.dtype`` and must read back."""
    if isinstance(name, str) and name.isidentifier() and not name.startswith("_"):
        found = getattr(torch, name, None)
        if isinstance(found, torch.dtype):
            return found
    raise UnknownNameError(f"{name!r} is not the name of a torch dtype (torch.<name>)")


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return int(dtype.itemsize)
