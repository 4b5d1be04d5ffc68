"""kvspec plugin for the Mamba / linear-attention state family (``mamba``)."""

from kvspec_mamba.checkpoints import is_prefill_checkpoint_valid, prefill_checkpoint_position
from kvspec_mamba.layers import mamba_spec, ssm_dtype_of
from kvspec_mamba.specs import MAMBA_TYPES, MambaSpec

__all__ = [
    "MAMBA_TYPES",
    "MambaSpec",
    "is_prefill_checkpoint_valid",
    "mamba_spec",
    "prefill_checkpoint_position",
    "ssm_dtype_of",
]
