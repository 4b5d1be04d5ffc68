"""Per-layer adapters: how one model layer's cache lives in its kvspec ``materialize()`` view.

Every cache-holding layer of a model gets one adapter. The adapter *is* the transformers
cache layer of that layer (``Cache.layers[i]``), so the model's own code calls it
(``cache.update(...)`` for attention, ``update_conv_state`` / ``update_recurrent_state`` for
linear-attention state layers), and the engine drives it once per step.

Adapter interface (what the engine and the attention function call)::

    adapter = factory(binding)           # LayerBinding: layer index/name, group, spec, view
    adapter.begin_step(step)             # before each forward: the step's positions and the
                                         # request's block table of every group
    adapter.finish_step(step)            # after each forward (state layers save their state)
    adapter.read(module, start, end)     # attention layers only: K, V of positions
                                         # [start, end), read paged from the view
    adapter.prefill_step_ends(start, num_tokens, checkpoint_at)   # optional: where a
                                         # prefill must end a step (state layers save a
                                         # reusable state only at a step's end)
    adapter.no_resume_reason             # optional: why the model's mixer cannot resume a
                                         # multi-token step from a saved state (the engine
                                         # then refuses prefix caching); None if it can

Adding a family (e.g. a state layer whose conv/SSM state lives in a state view): subclass
the transformers base that the model's code expects (``CacheLayerMixin`` for attention,
``LinearAttentionCacheLayerMixin`` for linear attention) together with :class:`StepDriven`,
and register a factory for the family's spec class with
:func:`kvspec_transformers.register_layer_adapter` (the registry, and the built-in
registrations, live in :mod:`kvspec_transformers.adapter_registry`). The most derived
registered spec class wins (``MLAAttentionSpec`` before ``AttentionSpec``); nothing in
:mod:`kvspec_transformers.cache` or :mod:`kvspec_transformers.engine` changes.

Family rules are never restated here: which positions a query reads comes from
``spec.first_attended_position`` and where a token lives from ``spec.slot_mapping``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from transformers.cache_utils import CacheLayerMixin

from kvspec_core.context import SizingContext
from kvspec_core.errors import ConfigError
from kvspec_core.specs.attention import AttentionSpec
from kvspec_core.specs.base import KVSpec
from kvspec_transformers.step import StepContext


@attrs.frozen(kw_only=True, eq=False)
class LayerBinding:
    """One model layer tied to its place in a kvspec plan.

    Attributes:
        layer_index: the model's layer index (``module.layer_idx``).
        layer_name: the kvspec layer name (``model.layers.3``).
        group: the plan group, i.e. the index of the block table the allocator keeps.
        spec: the layer's own spec (its family's rules).
        view: the layer's ``materialize()`` view ``[blocks, heads, states, content]``.
        context: the sizing context the plan was made with (e.g. the Mamba cache mode,
            which decides where state layers keep their state).
        source_layer: for a layer that reads another layer's cache (``plan.kv_sharing``),
            that layer's name; ``group`` and ``view`` are then the source's (the view
            aliases its bytes), ``spec`` is the reader's own (``reader_spec``), and the
            layer writes nothing. ``None`` for a layer holding its own cache.
    """

    layer_index: int
    layer_name: str
    group: int
    spec: KVSpec
    view: torch.Tensor
    context: SizingContext | None = None
    source_layer: str | None = None


@runtime_checkable
class LayerAdapter(Protocol):
    """What the engine needs of every adapter (see the module docstring)."""

    binding: LayerBinding

    def begin_step(self, step: StepContext) -> None: ...

    def finish_step(self, step: StepContext) -> None: ...


class StepDriven:
    """Mixin keeping the binding and the current step; the base of every adapter."""

    def __init__(self, binding: LayerBinding, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.binding = binding
        self._step: StepContext | None = None

    @property
    def step(self) -> StepContext:
        if self._step is None:
            raise ConfigError(
                f"layer {self.binding.layer_name} ran outside an engine step; run the model "
                "through TransformersEngine, which starts each step on the cache"
            )
        return self._step

    @property
    def block_table(self) -> tuple[int, ...]:
        """This layer's group's block table for the current step."""
        return self.step.block_tables[self.binding.group]

    def begin_step(self, step: StepContext) -> None:
        self._step = step

    def finish_step(self, step: StepContext) -> None:
        self._step = None


def _check_plain_cells(layer_name: str, spec: object) -> None:
    """Refuse a spec whose cells are not plain ``[K | V]`` values of its dtype: the
    adapters store K/V as they are and never quantise them, so per-token-head scales or
    values packed below the dtype's width (int8/fp8/int4 per token-head, NVFP4, TurboQuant)
    would not fit their cells."""
    if not isinstance(spec, AttentionSpec):
        return
    mode = spec.kv_quant_mode
    width = spec.dtype.itemsize * 8
    if mode.scale_bytes_per_token_head or mode.element_bits(spec.dtype) != (width, width):
        raise ConfigError(
            f"layer {layer_name}: the KV-cache quant mode {mode.name!r} stores scales or packed "
            "values, which kvspec-transformers does not write (it stores K and V as they "
            "are); plan with kv_cache_dtype 'auto', a float dtype, or 'fp8' (per-tensor, "
            "unscaled)"
        )


class PagedAttentionLayer(StepDriven, CacheLayerMixin):
    """K and V of an attention layer, paged: a cell is ``[K | V]`` of one head and token.

    ``update`` writes the step's K/V into the slots ``spec.slot_mapping`` names and returns
    them unchanged; the registered paged attention function reads every key it needs back
    from the view (:meth:`read`), so cached blocks are really what the model attends to.

    A layer reading another's cache (``binding.source_layer``) is bound to its source's view
    and block table: :meth:`read` gives the source's K/V, and ``update`` is refused (the
    model computes no K/V for it; a write would overwrite the source's).
    """

    is_sliding = False
    is_compileable = False
    supports_early_init = False

    def __init__(self, binding: LayerBinding) -> None:
        if not isinstance(binding.spec, AttentionSpec):
            raise ConfigError(
                f"layer {binding.layer_name}: {type(binding.spec).__name__} is not an "
                "attention spec; register an adapter for its family"
            )
        _check_plain_cells(binding.layer_name, binding.spec)
        super().__init__(binding)
        self.spec: AttentionSpec = binding.spec
        self.is_initialized = True

    # -- transformers CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.binding.source_layer is not None:
            raise ConfigError(
                f"layer {self.binding.layer_name} reads layer {self.binding.source_layer}'s "
                "KV cache (plan.kv_sharing) but the model wrote K/V for it; plan the model's "
                "own config, whose cross-layer KV sharing is the model's"
            )
        self._write(self.cells_of(key_states, value_states))
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.step.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.step.start + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # -- paged storage
    def cells_of(self, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        """``[tokens, heads, content]`` cells of ``[1, heads, tokens, dim]`` K and V."""
        return torch.cat((key_states[0], value_states[0]), dim=-1).transpose(0, 1)

    def _write(self, cells: torch.Tensor) -> None:
        step = self.step
        if cells.shape[0] != step.num_tokens:
            raise ConfigError(
                f"layer {self.binding.layer_name} got {cells.shape[0]} new tokens in a step of "
                f"{step.num_tokens}; feed the model exactly the step's tokens"
            )
        view = self.binding.view
        if cells.shape[1:] != (view.shape[1], view.shape[-1]):
            # (Falcon's new architecture hands the cache K/V already repeated to every head.)
            raise ConfigError(
                f"layer {self.binding.layer_name} wrote cells of {cells.shape[1]} heads x "
                f"{cells.shape[2]} values, but its planned cache holds {view.shape[1]} heads x "
                f"{view.shape[-1]}; the model's K/V do not match its config's KV heads and "
                "head sizes, which kvspec planned"
            )
        blocks, states = self.spec.slot_mapping(self.block_table, step.positions)
        view[blocks, :, states] = cells.to(view.dtype)

    def read_cells(self, start: int, end: int) -> torch.Tensor:
        """``[tokens, heads, content]`` cells of positions ``[start, end)``, read paged."""
        positions = torch.arange(start, end, dtype=torch.int64)
        blocks, states = self.spec.slot_mapping(self.block_table, positions)
        return self.binding.view[blocks, :, states]

    def read(
        self, module: torch.nn.Module, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, kv_heads, tokens, dim]`` K and V of positions ``[start, end)``."""
        cells = self.read_cells(start, end).transpose(0, 1).unsqueeze(0)
        head_size = self.spec.head_size
        return cells[..., :head_size], cells[..., head_size:]


class MLALatentLayer(PagedAttentionLayer):
    """Multi-head latent attention: one ``kv_lora_rank + qk_rope_head_dim`` latent per token
    (576 values for DeepSeek-V2), shared by every head, as the MLA spec sizes it.

    The model hands ``update`` the normalised latent and the roped key as two one-head
    tensors; they are stored side by side. :meth:`read` expands the latents of the read
    range into per-head K and V with the module's own ``expand_kv`` (its ``kv_b_proj``),
    in the dtype the model handed ``update`` this step (not the cache's: fp8, or bfloat16
    under a float32 model).
    """

    def __init__(self, binding: LayerBinding) -> None:
        super().__init__(binding)
        self._latent_dtype: torch.dtype | None = None

    def begin_step(self, step: StepContext) -> None:
        super().begin_step(step)
        self._latent_dtype = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The dtype the model computes the latent in: transformers' own cache hands it back
        # to expand_kv in that dtype, and kv_b_proj refuses another (a quantised projection's
        # weight dtype would be no guide, so it is not read from the weight).
        self._latent_dtype = key_states.dtype
        return super().update(key_states, value_states, *args, **kwargs)

    def cells_of(self, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        width = key_states.shape[-1] + value_states.shape[-1]
        if width != self.spec.head_size:
            raise ConfigError(
                f"layer {self.binding.layer_name}: latent of {key_states.shape[-1]} + rope key "
                f"of {value_states.shape[-1]} values does not fill the MLA cell of "
                f"{self.spec.head_size}; plan the layer from the model's own config"
            )
        return super().cells_of(key_states, value_states)

    def read(
        self, module: torch.nn.Module, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._latent_dtype is None:
            raise ConfigError(
                f"layer {self.binding.layer_name}: the attention read the MLA cache before the "
                "model wrote this step's latent (cache.update); run the model's own attention"
            )
        latent = self.read_cells(start, end).transpose(0, 1).unsqueeze(0).to(self._latent_dtype)
        # getattr, not attribute access: the spec is typed as an AttentionSpec (the MLA spec
        # comes from a plugin) and torch types module attributes as Tensor | Module.
        columns: Callable[[int], tuple[slice, slice]] = getattr(self.spec, "latent_columns")  # noqa: B009
        compressed, rope_key = columns(int(getattr(module, "qk_rope_head_dim")))  # noqa: B009
        expand: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
        expand = getattr(module, "expand_kv")  # noqa: B009
        return expand(latent[..., compressed], latent[..., rope_key])
