"""The attention base: K/V heads, head sizes, dtype, quant mode, padded and packed pages."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import attrs
import torch

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.errors import InvalidFieldError, KVSpecError
from kvspec_core.kv_dtypes import NO_QUANT, KVQuantMode
from kvspec_core.specs.base import KVSpec
from kvspec_core.validation import MAX_FIELD_VALUE, instance_of, is_bool, optional, positive_int


def _positive_tokens_per_state(instance: Any, attribute: Any, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, Fraction)):
        raise InvalidFieldError(
            type(instance).__name__, attribute.name, value, "must be a positive int or Fraction"
        )
    if not 0 < value <= MAX_FIELD_VALUE:
        raise InvalidFieldError(
            type(instance).__name__,
            attribute.name,
            value,
            "must be > 0 (ints > 1 compress tokens into one state, fractions < 1 store "
            "several states per token)",
        )


@attrs.frozen(kw_only=True)
class AttentionSpec(KVSpec):
    """Base of attention-like layers: a page is ``[heads, states, K+V content]``.

    Attributes:
        num_kv_heads: KV heads held by this rank.
        head_size / head_size_v: K and V head sizes (``head_size_v`` defaults to ``head_size``).
        dtype: storage dtype of the cache.
        kv_quant_mode: how K/V are quantised (scale bytes add to each cell).
        max_tp_shards: distinct shards across tensor parallelism; ranks beyond hold replicas.
        page_size_padded: page size after padding, at least the unpadded size.
        num_head_slots: H of the page when a backend packs heads differently.
        state_content_bytes: bytes of one cell when a backend packs content differently.
        tokens_per_state: tokens per stored state (ints > 1 compress, fractions < 1 expand).
    """

    dcp_sharded: bool = attrs.field(default=True, validator=is_bool)
    num_kv_heads: int = attrs.field(validator=positive_int)
    head_size: int = attrs.field(validator=positive_int)
    dtype: torch.dtype = attrs.field(validator=instance_of(torch.dtype, "expected a torch.dtype"))
    head_size_v: int = attrs.field(
        default=attrs.Factory(lambda self: self.head_size, takes_self=True),
        validator=positive_int,
    )
    kv_quant_mode: KVQuantMode = attrs.field(
        default=NO_QUANT, validator=instance_of(KVQuantMode, "expected a KVQuantMode")
    )
    max_tp_shards: int | None = attrs.field(default=None, validator=optional(positive_int))
    page_size_padded: int | None = attrs.field(default=None, validator=optional(positive_int))
    num_head_slots: int | None = attrs.field(default=None, validator=optional(positive_int))
    state_content_bytes: int | None = attrs.field(default=None, validator=optional(positive_int))
    tokens_per_state: int | Fraction = attrs.field(default=1, validator=_positive_tokens_per_state)

    def __attrs_post_init__(self) -> None:
        if self.num_states < 1:
            raise InvalidFieldError(
                type(self).__name__,
                "tokens_per_state",
                self.tokens_per_state,
                f"must leave at least one state per block of {self.block_size} tokens",
            )
        super().__attrs_post_init__()

    @property
    def num_heads(self) -> int:
        return self.num_head_slots if self.num_head_slots is not None else self.num_kv_heads

    @property
    def state_content_size_bytes(self) -> int:
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        return self.kv_quant_mode.content_bytes(self.head_size, self.head_size_v, self.dtype)

    @property
    def view_dtype(self) -> torch.dtype | None:
        if self.state_content_size_bytes % self.dtype.itemsize:
            return None
        return self.dtype

    def block_table_width(self, ctx: SizingContext, max_len: int) -> int:
        shards = ctx.dcp_size if self.dcp_sharded else 1
        return cdiv(max_len, self.block_size * shards)

    def tokens_held_per_rank(self, ctx: SizingContext, num_tokens: int) -> int:
        """Tokens of a ``num_tokens`` request this rank stores (DCP shards positions)."""
        if self.dcp_sharded and ctx.dcp_size > 1:
            return cdiv(num_tokens, ctx.dcp_size)
        return num_tokens

    # ----------------------------------------------------------------- engine helpers
    # An engine (``kvspec-transformers``) asks the spec which keys a query reads and where a
    # token lives, so that family rules (window, chunk, state packing) are stated once, here
    # and in the family plugins, never copied into the engine.

    def first_attended_position(self, position: int) -> int:
        """First key position a query at token ``position`` attends to: its keys are
        ``[first_attended_position(position), position]``. Attention over the whole request
        starts at 0; sliding windows and chunks override this. The value never decreases as
        ``position`` grows, so a step reads from its first query's start."""
        _check_position(self, position)
        return 0

    def slot_mapping(
        self, block_table: Sequence[int], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where tokens live: ``(block ids, state indices)`` of token ``positions`` (a 1-D
        integer tensor of rank-local positions) in a request's ``block_table``.

        Token ``p`` is in block ``block_table[p // block_size]`` at state
        ``(p % block_size) // tokens_per_state``, i.e. ``view[block, :, state]`` of this
        layer's ``materialize()`` view. Refuses positions past the table and positions whose
        entry is the null block 0 (freed below a window, or skipped by a prefix hit): the
        engine asked for a token this family does not keep.
        """
        if not self.uses_slot_mapping:
            raise KVSpecError(
                f"{type(self).__name__}.slot_mapping: a {self.kind} cache is addressed by its "
                "kernel, not per token (uses_slot_mapping is False)"
            )
        if not isinstance(self.tokens_per_state, int):
            raise KVSpecError(
                f"{type(self).__name__}.slot_mapping: tokens_per_state="
                f"{self.tokens_per_state} stores several states per token; a token has no "
                "single slot (address its states with num_kernel_states)"
            )
        if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
            raise KVSpecError(
                f"{type(self).__name__}.slot_mapping: positions must be a 1-D integer tensor, "
                f"got shape {tuple(positions.shape)} and dtype {positions.dtype}"
            )
        table = torch.as_tensor(list(block_table), dtype=torch.int64)
        if positions.numel() == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty
        lowest, highest = int(positions.min()), int(positions.max())
        if lowest < 0 or highest >= table.numel() * self.block_size:
            raise KVSpecError(
                f"{type(self).__name__}.slot_mapping: positions {lowest}..{highest} are outside "
                f"a block table of {table.numel()} blocks of {self.block_size} tokens; allocate "
                "the step's slots before mapping them"
            )
        indices = positions.to(torch.int64) // self.block_size
        blocks = table[indices]
        if bool((blocks == 0).any()):
            first = int(positions[blocks == 0][0])
            raise KVSpecError(
                f"{type(self).__name__}.slot_mapping: position {first} lies in block-table "
                f"entry {first // self.block_size}, the null block (freed or never held); a "
                f"query may read only from first_attended_position onwards"
            )
        states = (positions.to(torch.int64) % self.block_size) // self.tokens_per_state
        return blocks, states


def _check_position(spec: AttentionSpec, position: int) -> None:
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise KVSpecError(
            f"{type(spec).__name__}.first_attended_position: position={position!r} must be "
            "an int >= 0"
        )
