"""MLA specs: the latent cache of multi-head latent attention, its hidden-state marker
and the compressed-attention ring buffer.

MLA stores one latent vector per token (``kv_lora_rank + qk_rope_head_dim`` values, 576 for
DeepSeek-V2/V3) shared by every attention head, so a page is
``block_size x num_kv_heads (1) x cell`` where the cell is ``head_size x dtype bytes`` for a
dense latent or the published record size of a packed ``*_ds_mla`` format (656 B for
``fp8_ds_mla``). ``alignment`` pads the page up to a multiple of the kernel's stride.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from kvspec_core.context import SizingContext
from kvspec_core.errors import KVSpecError
from kvspec_core.specs.attention import AttentionSpec
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.full_attention import FullAttentionSpec
from kvspec_core.validation import is_bool, non_negative_int, one_of, optional, positive_int
from kvspec_mla.formats import MODEL_VERSIONS
from kvspec_mla.mla_fields import (
    CACHE_ROLES,
    MLAPaging,
    check_cache_dtype_str,
    packed_record_bytes,
)

if TYPE_CHECKING:
    from kvspec_core.specs.base import SpecKinds


@attrs.frozen(kw_only=True)
class MLAAttentionSpec(MLAPaging, FullAttentionSpec):
    """Full attention over a multi-head latent cache (DeepSeek-V2/V3/V3.2/V4).

    Layers merge when every field agrees, except ``non_causal`` and
    ``non_causal_multi_token_decode`` (a group capability: any member needing it enables it)
    and full attention's optional ``sliding_window`` / ``attention_chunk_size``.

    Attributes:
        head_size_v: 0: the latent serves as both K and V (no separate V is stored).
        cache_dtype_str: the cache dtype name the engine uses; a packed ``*_ds_mla`` name
            sizes the cell from the published record.
        alignment: page size is padded up to a multiple of this many bytes.
        model_version: ``None`` or ``deepseek_v4`` (selects the V4 record layout).
        cache_role: ``sparse`` (attention latent) or ``indexer`` (sparse-attention indexer keys).
        is_index_group_leader: whether this layer leads a group of layers sharing one index.
        storage_block_size: token width used to view storage when it differs from the block.
        non_causal_multi_token_decode: a member flattens a non-causal query block into decode
            rows.
    """

    kind: ClassVar[str] = "mla_attention"
    merge_any_fields: ClassVar[frozenset[str]] = FullAttentionSpec.merge_any_fields | {
        "non_causal_multi_token_decode"
    }

    head_size_v: int = attrs.field(default=0, validator=non_negative_int)
    cache_dtype_str: str | None = attrs.field(default=None, validator=check_cache_dtype_str)
    alignment: int | None = attrs.field(default=None, validator=optional(positive_int))
    model_version: str | None = attrs.field(default=None, validator=one_of(*MODEL_VERSIONS))
    cache_role: str = attrs.field(default="sparse", validator=one_of(*CACHE_ROLES))
    is_index_group_leader: bool = attrs.field(default=False, validator=is_bool)
    storage_block_size: int | None = attrs.field(default=None, validator=optional(positive_int))
    non_causal_multi_token_decode: bool = attrs.field(default=False, validator=is_bool)

    def latent_columns(self, qk_rope_head_dim: int) -> tuple[slice, slice]:
        """Where a dense latent cell ``view[block, 0, state]`` keeps its two parts:
        ``(compressed latent, roped key)`` column slices, the ``kv_lora_rank`` latent first
        and the ``qk_rope_head_dim`` rope key after it (512 + 64 for DeepSeek-V2/V3).

        Refuses a packed ``*_ds_mla`` record (its layout is the kernel's, not two dense
        parts) and a rope width that leaves no latent.
        """
        paged: Any = self  # attrs fields are read-only; the protocol declares them settable
        if packed_record_bytes(paged) is not None:
            raise KVSpecError(
                f"MLAAttentionSpec.latent_columns: cache_dtype_str={self.cache_dtype_str!r} "
                "packs the latent into a kernel record; only a dense latent has columns"
            )
        if (
            isinstance(qk_rope_head_dim, bool)
            or not isinstance(qk_rope_head_dim, int)
            or not (0 < qk_rope_head_dim < self.head_size)
        ):
            raise KVSpecError(
                f"MLAAttentionSpec.latent_columns: qk_rope_head_dim={qk_rope_head_dim!r} must "
                f"be an int in [1, {self.head_size - 1}] (the cell holds {self.head_size} values)"
            )
        split = self.head_size - qk_rope_head_dim
        return slice(0, split), slice(split, self.head_size)


@attrs.frozen(kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Marker for hidden-state cache layers (hidden states extracted for speculative
    decoding); sized and merged exactly like MLA."""

    kind: ClassVar[str] = "hidden_state_cache"


@attrs.frozen(kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """The ring holding the raw keys of the token group a compressed-attention layer is
    still compressing: one block per request for its whole lifetime.

    ``block_size`` is the ring capacity; it must exceed the compression ratio by the
    speculative lookahead, because a speculative step stores all its rows (drafts included)
    before acceptance is known while the next step still reads the open group from the ring.
    """

    kind: ClassVar[str] = "circular_buffer"

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return 1

    def block_table_width(self, ctx: SizingContext, max_len: int) -> int:
        return 1

    @property
    def block_table_token_alignment(self) -> int | None:
        return None

    @property
    def prefix_cacheable(self) -> bool:
        # The ring is overwritten in place; no block ever holds a stable prefix.
        return False

    @property
    def uses_slot_mapping(self) -> bool:
        # The kernel addresses the ring itself.
        return False

    def is_uniform_with(self, specs: Mapping[str, KVSpec], registry: SpecKinds) -> bool:
        return all(isinstance(spec, CircularBufferSpec) for spec in specs.values())
