"""The attention base: K/V heads, head sizes, dtype, quant mode, padded and packed pages."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import attrs
import torch

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.errors import InvalidFieldError
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
            type(instance).__name__, attribute.name, value,
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
    tokens_per_state: int | Fraction = attrs.field(
        default=1, validator=_positive_tokens_per_state
    )

    def __attrs_post_init__(self) -> None:
        if self.num_states < 1:
            raise InvalidFieldError(
                type(self).__name__, "tokens_per_state", self.tokens_per_state,
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
