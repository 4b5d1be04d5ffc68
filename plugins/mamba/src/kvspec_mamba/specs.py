"""The Mamba / linear-attention state family: one fixed-size state per block, not per token.

A state-space or linear-attention layer carries a recurrent state (a short convolution window
plus an SSM or delta-rule matrix) whose size does not grow with the sequence. A page holds one
such state; ``block_size`` is the token span one saved state covers (the requested attention
block size, never inflated to match pages).

Per request the cache holds the running state plus one per speculative token block; with
prefix caching in ``align`` mode it also keeps the state at the last block boundary and the
prefill checkpoints a cached prefix resumes from.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError, PlanError
from kvspec_core.specs.base import KVSpec
from kvspec_core.validation import (
    MAX_FIELD_VALUE,
    is_bool,
    non_negative_int,
    one_of,
    optional,
    positive_int,
)
from kvspec_mamba.checkpoints import StateColumns, state_columns

if TYPE_CHECKING:
    from kvspec_core.specs.base import SpecKinds

#: Kinds of recurrent state a :class:`MambaSpec` may describe.
MAMBA_TYPES = ("mamba1", "mamba2", "short_conv", "gated_delta_net", "linear_attention")


def _check_shapes(instance: Any, attribute: Any, value: object) -> None:
    if (
        not isinstance(value, tuple)
        or not value
        or not all(
            isinstance(shape, tuple)
            and shape
            and all(
                isinstance(dim, int) and not isinstance(dim, bool) and 0 < dim <= MAX_FIELD_VALUE
                for dim in shape
            )
            for shape in value
        )
    ):
        raise InvalidFieldError(
            type(instance).__name__,
            attribute.name,
            value,
            "must be a non-empty tuple of shapes, each a non-empty tuple of positive ints "
            "(e.g. ((3, 8192), (8192, 16)))",
        )


def _check_dtypes(instance: Any, attribute: Any, value: object) -> None:
    if not isinstance(value, tuple) or not all(isinstance(d, torch.dtype) for d in value):
        raise InvalidFieldError(
            type(instance).__name__, attribute.name, value, "must be a tuple of torch dtypes"
        )
    shapes = instance.shapes
    if len(value) != len(shapes):
        raise InvalidFieldError(
            type(instance).__name__,
            attribute.name,
            value,
            f"must hold one dtype per state shape ({len(shapes)} shapes, {len(value)} dtypes)",
        )


@attrs.frozen(kw_only=True)
class MambaSpec(KVSpec):
    """Recurrent state of a Mamba, short-conv or linear-attention layer.

    Attributes:
        shapes: shape of each state tensor of one request (conv window, SSM state, ...).
        dtypes: dtype of each state tensor, in the order of ``shapes``.
        page_size_padded: page size after padding, at least the real state size.
        mamba_type: ``mamba1``, ``mamba2``, ``short_conv``, ``gated_delta_net`` or
            ``linear_attention``.
        num_speculative_blocks: extra states kept for speculative decoding.
        num_prefill_checkpoint_blocks: extra states kept for prefill checkpoints (``align``).
        prefill_checkpoint_alignment: token multiple a backend can export checkpoints at;
            ``None`` when it cannot export them mid-query.
        tp_replicated: every TP rank holds the whole state (``False``: sharded across TP).
    """

    kind: ClassVar[str] = "mamba"

    shapes: tuple[tuple[int, ...], ...] = attrs.field(validator=_check_shapes)
    dtypes: tuple[torch.dtype, ...] = attrs.field(validator=_check_dtypes)
    page_size_padded: int | None = attrs.field(default=None, validator=optional(positive_int))
    mamba_type: str = attrs.field(default="mamba2", validator=one_of(*MAMBA_TYPES))
    num_speculative_blocks: int = attrs.field(default=0, validator=non_negative_int)
    num_prefill_checkpoint_blocks: int = attrs.field(default=0, validator=non_negative_int)
    prefill_checkpoint_alignment: int | None = attrs.field(
        default=None, validator=optional(positive_int)
    )
    tp_replicated: bool = attrs.field(default=False, validator=is_bool)

    def __attrs_post_init__(self) -> None:
        real = self.state_content_size_bytes
        if real > MAX_FIELD_VALUE:
            raise InvalidFieldError(
                type(self).__name__,
                "shapes",
                self.shapes,
                f"make a state of {real} bytes, above the limit of {MAX_FIELD_VALUE}",
            )
        super().__attrs_post_init__()

    # ----------------------------------------------------------------- page geometry
    @property
    def num_heads(self) -> int:
        return 1

    @property
    def tokens_per_state(self) -> int:
        # <= 0: one state per block whatever its token span.
        return -1

    @property
    def state_content_size_bytes(self) -> int:
        # One dtype per shape (checked at construction).
        return sum(
            prod(shape) * dtype.itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def block_table_token_alignment(self) -> int | None:
        return None

    # ----------------------------------------------------------------- sizing
    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        """Running state plus speculative states; ``align`` mode adds the state at the last
        block boundary and the prefill checkpoints. Never scaled by DCP: the state is
        replicated across decode-context ranks."""
        if ctx.mamba_cache_mode == "align":
            return 2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks
        return 1 + self.num_speculative_blocks

    def fixed_blocks_per_request(self, ctx: SizingContext) -> int:
        """All of them: a request holds its states whatever its length."""
        return self.max_blocks_per_request(ctx)

    def block_table_width(self, ctx: SizingContext, max_len: int) -> int:
        if ctx.mamba_cache_mode == "align":
            # Rows are indexed by position over the whole sequence even though only a few
            # states are resident (earlier columns are nulled as the request advances).
            return cdiv(max_len, self.block_size) + self.num_speculative_blocks
        return self.max_blocks_per_request(ctx)

    # ----------------------------------------------------------------- engine helpers
    @property
    def has_conv_state(self) -> bool:
        """Whether the first state is a convolution window (every type but the lone
        recurrent state of ``linear_attention``)."""
        return self.mamba_type != "linear_attention"

    def state_views(self, layer_view: torch.Tensor, block_id: int) -> tuple[torch.Tensor, ...]:
        """The state tensors block ``block_id`` holds in one layer's materialised view, as
        model code reads them; they alias the cache, so writing them writes the block.

        ``layer_view`` is the layer's view from :func:`kvspec_core.planner.materialize`
        (``KVCacheBuffers.views[layer]``): ``uint8`` ``[num_blocks, 1, 1, content bytes]``.
        One tensor per state, in ``shapes`` order, each in its ``dtypes`` entry. The conv
        window, stored ``[d_conv - 1, channels]`` (one time step per row, as vLLM stores it),
        comes back transposed to ``[channels, d_conv - 1]``, the layout transformers' and the
        causal-conv1d kernels use (channels outermost); other states keep their stored shape
        (gated delta-net ``[v_heads, k_dim, v_dim]``, Mamba-2 ``[heads, head_dim, d_state]``),
        which is transformers' per-request shape. Block 0, the pool's null block, is refused.
        """
        owner = "MambaSpec.state_views"
        content = self.state_content_size_bytes
        expected = (
            f"this layer's materialised view: a torch.uint8 tensor [num_blocks, 1, 1, {content}]"
        )
        if not isinstance(layer_view, torch.Tensor):
            raise InvalidFieldTypeError(
                owner, "layer_view", type(layer_view).__name__, f"expected {expected}"
            )
        if (
            layer_view.dtype != torch.uint8
            or layer_view.dim() != 4
            or tuple(layer_view.shape[1:]) != (1, 1, content)
        ):
            raise InvalidFieldError(
                owner,
                "layer_view",
                f"{layer_view.dtype} tensor {list(layer_view.shape)}",
                f"must be {expected}",
            )
        num_blocks = layer_view.shape[0]
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise InvalidFieldTypeError(owner, "block_id", block_id, "expected an int block id")
        if block_id == 0:
            raise InvalidFieldError(
                owner,
                "block_id",
                block_id,
                "block 0 is the pool's null block (a skipped block-table "
                "entry) and holds no state; pass a real block of the "
                "request's block table",
            )
        if not 0 < block_id < num_blocks:
            raise InvalidFieldError(
                owner, "block_id", block_id, f"must be a block id in 1..{num_blocks - 1}"
            )
        page = layer_view[block_id, 0, 0]
        views = []
        start = 0
        for index, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes, strict=True)):
            size = prod(shape) * dtype.itemsize
            try:
                state = page[start : start + size].view(dtype).view(shape)
            except RuntimeError as error:
                raise PlanError(
                    f"state {index} ({dtype}, shape {shape}) of block {block_id} starts at byte "
                    f"{page.storage_offset() + start} of its pool buffer, which a {dtype} view "
                    f"cannot start at ({error}); align the pool's blocks to "
                    f"{dtype.itemsize} bytes (block_stride_alignment)"
                ) from error
            if index == 0 and self.has_conv_state:
                state = state.transpose(-1, -2)
            views.append(state)
            start += size
        return tuple(views)

    def state_columns(
        self, num_computed: int, num_new_tokens: int, mamba_cache_mode: str
    ) -> StateColumns:
        """The block-table columns a step reads its start state from and writes its end
        state to (:func:`kvspec_mamba.checkpoints.state_columns` with this block size)."""
        return state_columns(num_computed, num_new_tokens, self.block_size, mamba_cache_mode)

    # ----------------------------------------------------------------- grouping
    def is_uniform_with(self, specs: Mapping[str, KVSpec], registry: SpecKinds) -> bool:
        """Uniform with state layers that keep the same number of states per request
        (speculative and checkpoint counts, alignment), the same page size and the same TP
        placement; shapes and dtypes may differ."""
        base = registry.uniform_base_of(self)
        return all(
            registry.uniform_base_of(spec) is base
            and isinstance(spec, MambaSpec)
            and spec.num_speculative_blocks == self.num_speculative_blocks
            and spec.num_prefill_checkpoint_blocks == self.num_prefill_checkpoint_blocks
            and spec.prefill_checkpoint_alignment == self.prefill_checkpoint_alignment
            and spec.page_size_bytes == self.page_size_bytes
            and spec.tp_replicated == self.tp_replicated
            for spec in specs.values()
        )
