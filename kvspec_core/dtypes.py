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
_ALIASES = {"float": "float32", "half": "float16", "fp32": "float32", "fp16": "float16",
            "bf16": "bfloat16", "double": "float64"}


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``, ``"torch.float16"``, ``"half"``...)."""
    key = name.removeprefix("torch.")
    key = _ALIASES.get(key, key)
    try:
        return _TORCH_DTYPES[key]
    except KeyError:
        raise UnknownNameError(
            f"unknown torch dtype {name!r}; known: {sorted(_TORCH_DTYPES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return int(dtype.itemsize)
