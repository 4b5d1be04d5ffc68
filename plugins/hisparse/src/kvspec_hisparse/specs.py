"""HiSparse's device-side page specs: the per-request hot cache and the resident pages.

HiSparse keeps a sparse-attention model's full KV in a host (CPU) pool and stages on the
device only what the current step reads. Both specs here are raw byte pages that the
HiSparse runtime addresses itself (no per-layer torch views), and both are ephemeral replicas
of host-resident KV: never prefix cached, never transferred between engines.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.specs.base import KVSpec
from kvspec_core.validation import positive_int


@attrs.frozen(kw_only=True)
class RawPageSpec(KVSpec):
    """A page of ``page_size`` opaque bytes: one cell, one state per block.

    Not a registered kind itself; the HiSparse specs derive from it.
    """

    page_size: int = attrs.field(validator=positive_int)

    @property
    def num_heads(self) -> int:
        return 1

    @property
    def tokens_per_state(self) -> int:
        # <= 0: one state per block, whatever the block size (the page is opaque).
        return 0

    @property
    def state_content_size_bytes(self) -> int:
        return self.page_size

    @property
    def page_size_bytes(self) -> int:
        return self.page_size

    @property
    def has_layer_views(self) -> bool:
        # The HiSparse runtime lays out the raw backing tensor itself.
        return False

    @property
    def prefix_cacheable(self) -> bool:
        # A replica of host-resident KV: the host source group is what prefix caching keys.
        return False

    @property
    def transferable(self) -> bool:
        # Rebuilt from the transferable host source group after a connector load.
        return False


@attrs.frozen(kw_only=True)
class HiSparseHotSpec(RawPageSpec):
    """Per-request hot cache: a fixed ``blocks_per_request`` device blocks the sparse kernel
    reads its selected tokens from, addressed by the kernel (no slot mapping).

    Attributes:
        page_size: bytes of one page (the source layers' pages packed together).
        blocks_per_request: device blocks each request holds for its lifetime.
    """

    kind: ClassVar[str] = "hisparse_hot"

    blocks_per_request: int = attrs.field(validator=positive_int)

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return self.blocks_per_request

    def block_table_width(self, ctx: SizingContext, max_len: int) -> int:
        return self.blocks_per_request

    @property
    def block_table_token_alignment(self) -> int | None:
        return None

    @property
    def uses_slot_mapping(self) -> bool:
        return False


@attrs.frozen(kw_only=True)
class HiSparseResidentSpec(RawPageSpec):
    """Reclaimable device pages holding host-backed KV of the tokens in flight.

    A request holds at most the pages of the tokens scheduled but not yet written back to the
    host, never more than ``max_model_len``: ``cdiv(min(in_flight, max_model_len), block)``.
    """

    kind: ClassVar[str] = "hisparse_resident"

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return cdiv(min(ctx.max_in_flight_tokens, ctx.max_model_len), self.block_size)
