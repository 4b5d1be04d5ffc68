"""kvspec plugin for the Mamba / linear-attention state family (``mamba``)."""

from kvspec_mamba.checkpoints import (
    StateColumns,
    is_prefill_checkpoint_valid,
    prefill_checkpoint_position,
    prefill_step_ends,
    state_columns,
)
from kvspec_mamba.layers import mamba_spec, ssm_dtype_of
from kvspec_mamba.specs import MAMBA_TYPES, MambaSpec

__all__ = [
    "MAMBA_TYPES",
    "MambaSpec",
    "StateColumns",
    "is_prefill_checkpoint_valid",
    "mamba_spec",
    "prefill_checkpoint_position",
    "prefill_step_ends",
    "ssm_dtype_of",
    "state_columns",
]
