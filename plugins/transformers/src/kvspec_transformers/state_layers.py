"""State layers (Mamba-2, gated delta-net) on kvspec's cache, in ``align`` mode.

A linear-attention layer of Qwen3-Next (``Qwen3NextGatedDeltaNet``) or Bamba (``BambaMixer``)
keeps a conv window and a recurrent (SSM / delta-rule) state. Here both live in the layer's
``materialize()`` view, in the block the allocator placed for the request, never in tensors of
the cache's own: :meth:`MambaSpec.state_views` gives them as the model code reads them, and
:meth:`MambaSpec.state_columns` says which block a step starts from and which it ends in (the
family's ``align`` rules: the state after ``n`` tokens lives in block-table column
``(n - 1) // block_size``; a prefix hit hands back the block saved at its boundary).

The model's own code drives the layer unchanged, through transformers' linear-attention cache
calls: ``get_conv_state`` / ``get_recurrent_state`` (they return the block's views, which the
decode kernels update in place), ``update_conv_state`` and ``update_recurrent_state`` (they
write the block). One difference with transformers' cache: it keeps ``d_conv`` conv columns,
kvspec (like vLLM) the ``d_conv - 1`` a causal convolution reads; the oldest column only ever
feeds an output the model discards, so the computed values are the same.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from kvspec_core.errors import ConfigError
from kvspec_mamba.checkpoints import prefill_step_ends
from kvspec_mamba.specs import MambaSpec
from kvspec_transformers.layer_adapters import LayerBinding, StepDriven
from kvspec_transformers.step import StepContext

#: The state index transformers' single-state layers use (``number_of_states`` 1).
_STATE = 0

#: Mixers whose transformers code cannot resume a multi-token step from a saved state, by
#: ``MambaSpec.mamba_type``, with the reason. Jamba's ``JambaMambaMixer`` (Mamba-1) prepends
#: the conv window but runs ``mamba_selective_scan``, which starts every multi-token step
#: from a zero SSM state (no ``initial_state``): a prefill resumed after a prefix hit, or
#: split at a block boundary, would drop the state and answer with wrong tokens.
NO_MULTI_TOKEN_RESUME = {
    "mamba1": "transformers' Mamba-1 scan (mamba_selective_scan) starts every multi-token "
    "step from a zero SSM state, so a prefill cannot resume from a cached state",
}


class StateLayer(StepDriven, LinearAttentionCacheLayerMixin):
    """The conv window and recurrent state of one state layer, in its kvspec blocks.

    Before each step (:meth:`begin_step`) the state the step starts from is copied into the
    block the step ends in when the two differ (a cached block is never written), and the
    block's views become this layer's ``conv_states`` / ``recurrent_states``.
    """

    def __init__(self, binding: LayerBinding) -> None:
        spec = binding.spec
        if not isinstance(spec, MambaSpec) or not spec.has_conv_state or len(spec.shapes) != 2:
            raise ConfigError(
                f"layer {binding.layer_name}: {type(spec).__name__} "
                f"({getattr(spec, 'mamba_type', spec.kind)}) is not a conv window plus a "
                "recurrent state; kvspec-transformers runs Mamba-2 and gated delta-net layers"
            )
        if binding.context is None:
            raise ConfigError(
                f"layer {binding.layer_name}: a state layer needs the plan's SizingContext "
                "(LayerBinding.context): its Mamba cache mode decides which block holds the state"
            )
        super().__init__(binding, number_of_states=1)
        self.spec: MambaSpec = spec
        self.mamba_cache_mode = binding.context.mamba_cache_mode
        #: Why the model's mixer cannot resume a multi-token step from a saved state (the
        #: engine then refuses prefix caching), or ``None`` when it can.
        self.no_resume_reason: str | None = NO_MULTI_TOKEN_RESUME.get(spec.mamba_type)
        #: Block the current step writes its end state to.
        self.write_block = 0

    # -- engine steps
    def begin_step(self, step: StepContext) -> None:
        super().begin_step(step)
        table = self.block_table
        columns = self.spec.state_columns(step.start, step.num_tokens, self.mamba_cache_mode)
        if columns.write >= len(table) or not table[columns.write]:
            raise ConfigError(
                f"layer {self.binding.layer_name}: the block table {table} of request "
                f"{step.request_id!r} has no block in column {columns.write} for the state "
                f"after {step.end} tokens; allocate the step's slots before running it"
            )
        self.write_block = table[columns.write]
        view = self.binding.view
        if columns.read is not None:
            read_block = table[columns.read] if columns.read < len(table) else 0
            if not read_block:
                raise ConfigError(
                    f"layer {self.binding.layer_name}: request {step.request_id!r} resumes "
                    f"after {step.start} tokens but its block table {table} holds no state "
                    f"in column {columns.read}; resume only from the allocator's prefix hit"
                )
            if read_block != self.write_block:
                view[self.write_block].copy_(view[read_block])
        conv, recurrent = self.spec.state_views(view, self.write_block)
        self.conv_states[_STATE] = conv.unsqueeze(0)
        self.recurrent_states[_STATE] = recurrent.unsqueeze(0)
        self.is_conv_states_initialized[_STATE] = True
        self.is_recurrent_states_initialized[_STATE] = True
        # A fresh request starts from a zero state: the model then takes its no-state path.
        self.has_previous_state[_STATE] = step.start > 0

    def prefill_step_ends(
        self, num_computed: int, num_tokens: int, checkpoint_at: int | None
    ) -> tuple[int, ...]:
        """Where a prefill of ``num_tokens`` tokens (``num_computed`` cached) ends its steps:
        in ``align`` mode also at the prefix's checkpoint hint and the last block boundary
        before the final token, so the states there are saved (transformers' modules export
        no state from inside a step); otherwise in one step."""
        if self.mamba_cache_mode != "align":
            return (num_tokens,)
        return prefill_step_ends(num_computed, num_tokens, self.spec.block_size, checkpoint_at)

    def finish_step(self, step: StepContext) -> None:
        super().finish_step(step)
        self.conv_states[_STATE] = self.recurrent_states[_STATE] = None
        self.is_conv_states_initialized[_STATE] = False
        self.is_recurrent_states_initialized[_STATE] = False
        self.has_previous_state[_STATE] = False

    # -- transformers LinearAttentionCacheLayerMixin
    def lazy_initialization(
        self,
        conv_states: torch.Tensor | None = None,
        recurrent_states: torch.Tensor | None = None,
        state_idx: int = 0,
        **kwargs: Any,
    ) -> None:
        return None  # the states live in the block views bound at begin_step

    def _bound(self, what: str, state_idx: int) -> torch.Tensor:
        """The ``what`` state bound for the current step (refused outside a step)."""
        if self._step is None:
            raise ConfigError(
                f"layer {self.binding.layer_name} ran outside an engine step; run the model "
                "through TransformersEngine, which starts each step on the cache"
            )
        tensor = (self.conv_states if what == "conv" else self.recurrent_states).get(state_idx)
        if tensor is None:
            raise ConfigError(
                f"layer {self.binding.layer_name} keeps one {what} state; the model asked for "
                f"state {state_idx}"
            )
        return tensor

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Store the last ``d_conv - 1`` inputs of ``conv_states`` ``[1, channels, tokens]``
        and return what the causal convolution must see, as transformers does: the stored
        window followed by the new inputs, or (no previous state) the inputs left-padded
        with zeros to the kernel width."""
        stored = self._bound("conv", state_idx)
        if self.has_previous_state[state_idx]:
            full = torch.cat([stored.to(conv_states.dtype), conv_states], dim=-1)
        else:
            kernel = conv_kernel_size or stored.shape[-1] + 1
            full = F.pad(conv_states, (max(kernel - conv_states.shape[-1], 0), 0), value=0)
            self.has_previous_state[state_idx] = True
        stored.copy_(full[..., -stored.shape[-1] :])
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        stored = self._bound("recurrent", state_idx)
        stored.copy_(recurrent_states)
        return stored
