"""Cross-layer KV sharing: a layer that reads another layer's cache and holds none.

vLLM's ``kv_sharing_target_layer_name``; Gemma-3n's last ``num_kv_shared_layers`` layers,
YOCO's cross-decoder, Character.AI's and MobileLLM's shared layers. The reading layer has
attention of its own (its queries, its window) but no K/V projection: it attends over the K/V
its source layer cached. So it needs no blocks (``max_blocks_per_request == 0``, a memoryless
layer), the planner gives it no group and no pool, the runtime allocates nothing for it, and
``materialize()`` gives it a view aliasing its source's bytes. The planner checks the pairing
(:mod:`kvspec_core.planner.kv_sharing`): the source exists, comes earlier in the model, holds
a cache, and its spec describes the cache this layer reads (``reader_spec``).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, ClassVar

import attrs
import torch

from kvspec_core.context import SizingContext
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError
from kvspec_core.specs.base import KVSpec
from kvspec_core.validation import positive_int


def _target_name(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidFieldTypeError(
            type(instance).__name__,
            attribute.name,
            value,
            "expected the non-empty name of the layer whose KV cache this layer reads",
        )


def _reader_spec(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, KVSpec):
        raise InvalidFieldTypeError(
            type(instance).__name__,
            attribute.name,
            value,
            "expected the KVSpec this layer would have with a cache of its own",
        )
    if isinstance(value, KVSharingSpec):
        raise InvalidFieldError(
            type(instance).__name__,
            attribute.name,
            value,
            "must be the layer's own attention spec, not another KVSharingSpec; a layer that "
            "reads a reading layer names that layer as its target_layer",
        )


@attrs.frozen(kw_only=True)
class KVSharingSpec(KVSpec):
    """A layer that reads the KV cache of ``target_layer`` instead of holding one.

    Attributes:
        target_layer: the layer whose cache this layer reads (an earlier layer; a layer that
            itself reads another is followed to the layer holding the cache).
        reader_spec: the spec this layer would have with a cache of its own: its family,
            window and page geometry. It must merge with the source layer's spec
            (``type(spec).merge``): the same cache, read through the same view.
        block_size: the reader's block size (``reader_spec.block_size``; set it or leave it).
    """

    kind: ClassVar[str] = "kv_sharing"

    target_layer: str = attrs.field(validator=_target_name)
    reader_spec: KVSpec = attrs.field(validator=_reader_spec)
    block_size: int = attrs.field(
        # Defaults run before validators: a reader_spec that is no spec is refused by its own.
        default=attrs.Factory(
            lambda self: self.reader_spec.block_size if isinstance(self.reader_spec, KVSpec) else 1,
            takes_self=True,
        ),
        validator=positive_int,
    )

    def __attrs_post_init__(self) -> None:
        if self.block_size != self.reader_spec.block_size:
            raise InvalidFieldError(
                type(self).__name__,
                "block_size",
                self.block_size,
                f"must equal reader_spec.block_size ({self.reader_spec.block_size}); the "
                "reader reads its source's blocks",
            )
        super().__attrs_post_init__()

    # The page the layer reads is its reader spec's (which equals its source's).
    @property
    def num_heads(self) -> int:
        return self.reader_spec.num_heads

    @property
    def tokens_per_state(self) -> int | Fraction:
        return self.reader_spec.tokens_per_state

    @property
    def state_content_size_bytes(self) -> int:
        return self.reader_spec.state_content_size_bytes

    def num_kernel_states(self, kernel_block_size: int) -> int:
        return self.reader_spec.num_kernel_states(kernel_block_size)

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.reader_spec.unpadded_page_size_bytes

    @property
    def page_size_padded(self) -> int | None:
        return self.reader_spec.page_size_padded

    @property
    def page_size_bytes(self) -> int:
        return self.reader_spec.page_size_bytes

    @property
    def view_dtype(self) -> torch.dtype | None:
        return self.reader_spec.view_dtype

    @property
    def has_layer_views(self) -> bool:
        return self.reader_spec.has_layer_views

    @property
    def uses_slot_mapping(self) -> bool:
        # The reader writes no token: its source does.
        return False

    @property
    def prefix_cacheable(self) -> bool:
        # No group of its own: what it reads is cached (or not) with its source's group.
        return False

    @property
    def transferable(self) -> bool:
        # Nothing of its own to transfer; its source's group carries the bytes.
        return False

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        """0: the layer holds no blocks (it reads its source's)."""
        return 0
