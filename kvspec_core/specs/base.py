"""The spec protocol: what every kind of layer tells the planner and the runtime.

A spec is a frozen attrs value describing one layer's KV cache (or, merged, one group's).
Subclasses set ``kind`` and override the sizing properties; the planner and the runtime call
only the methods defined here, so a third-party kind works without touching the core.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import ClassVar, Protocol, TypeVar

import attrs
import torch

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.errors import InvalidFieldError
from kvspec_core.specs.merging import merge_by_rules
from kvspec_core.validation import is_bool, optional, positive_int

SpecT = TypeVar("SpecT", bound="KVSpec")


class SpecKinds(Protocol):
    """What specs ask of the registry of spec kinds.

    :class:`kvspec_core.plugins.registry.SpecRegistry` implements it; the registry imports the
    specs, never the other way round, so the spec protocol stays beneath the plugin machinery.
    """

    def uniform_base_of(self, spec: KVSpec | type[KVSpec]) -> type[KVSpec]:
        """The class whose instances may share a uniform-type group with ``spec``."""
        ...

    def class_of(self, kind: str) -> type[KVSpec]:
        """The spec class registered as ``kind``."""
        ...


@attrs.frozen(kw_only=True)
class KVSpec:
    """Base of every layer spec.

    Attributes:
        block_size: tokens per block (page) of this layer's cache.
        dcp_sharded: whether decode context parallelism shards this cache's token positions.
        block_stride_alignment: byte alignment required between consecutive physical blocks.
    """

    #: Registered kind name (``"full_attention"``); subclasses set it.
    kind: ClassVar[str] = ""
    #: Fields combined with ``any`` when layers merge (a capability any member needs).
    merge_any_fields: ClassVar[frozenset[str]] = frozenset()
    #: Fields where ``None`` means "not set" and set values must agree when layers merge.
    merge_optional_fields: ClassVar[frozenset[str]] = frozenset()

    block_size: int = attrs.field(validator=positive_int)
    dcp_sharded: bool = attrs.field(default=False, validator=is_bool)
    block_stride_alignment: int | None = attrs.field(default=None, validator=optional(positive_int))

    # ----------------------------------------------------------------- page geometry
    @property
    def num_heads(self) -> int:
        """H of the logical ``[blocks, H, states, content]`` page."""
        raise NotImplementedError(f"{type(self).__name__} does not define num_heads")

    @property
    def tokens_per_state(self) -> int | Fraction:
        """Tokens one stored state covers; ``<= 0`` means one state per block (Mamba)."""
        raise NotImplementedError(f"{type(self).__name__} does not define tokens_per_state")

    @property
    def state_content_size_bytes(self) -> int:
        """Bytes of one (head slot, state) cell."""
        raise NotImplementedError(f"{type(self).__name__} does not define state_content_size_bytes")

    @property
    def num_states(self) -> int:
        """States in one page of ``block_size`` tokens."""
        return self.num_kernel_states(self.block_size)

    def num_kernel_states(self, kernel_block_size: int) -> int:
        """States in one kernel block of ``kernel_block_size`` tokens."""
        if self.tokens_per_state > 0:
            return int(kernel_block_size // self.tokens_per_state)
        return 1

    @property
    def unpadded_page_size_bytes(self) -> int:
        """Bytes of real content in one page."""
        return self.num_heads * self.num_states * self.state_content_size_bytes

    @property
    def page_size_padded(self) -> int | None:
        """Page size after padding, ``None`` when unpadded; specs that pad declare a field
        of this name, which the page size and the post-init check below honour."""
        return None

    @property
    def page_size_bytes(self) -> int:
        """Bytes one page occupies, padding included."""
        padded = self.page_size_padded
        return padded if padded is not None else self.unpadded_page_size_bytes

    def __attrs_post_init__(self) -> None:
        padded = self.page_size_padded
        if padded is not None and padded < self.unpadded_page_size_bytes:
            raise InvalidFieldError(
                type(self).__name__,
                "page_size_padded",
                padded,
                f"must be >= the unpadded page size {self.unpadded_page_size_bytes}",
            )

    @property
    def view_dtype(self) -> torch.dtype | None:
        """Dtype of this layer's torch view; ``None`` keeps raw bytes."""
        return None

    @property
    def has_layer_views(self) -> bool:
        """Whether materialisation creates a per-layer ``[B, H, N, C]`` view."""
        return True

    @property
    def uses_slot_mapping(self) -> bool:
        """Whether the engine computes a per-token slot mapping for this layer."""
        return True

    @property
    def block_table_token_alignment(self) -> int | None:
        """Token multiple the block table rows are padded to; ``None`` for no padding."""
        return 128

    # ----------------------------------------------------------------- placement
    @property
    def host_resident(self) -> bool:
        """Whether this layer's group lives in a host (CPU) pool rather than the device pool."""
        return False

    @property
    def group_role(self) -> str:
        """Role of this layer's group: ``default``, or a plugin's (``hisparse_source``...)."""
        return "default"

    @property
    def transferable(self) -> bool:
        """Whether the group is part of the KV state a connector transfers between engines;
        ephemeral replicas rebuilt from a source group are not."""
        return True

    # ----------------------------------------------------------------- prefix caching
    @property
    def prefix_cacheable(self) -> bool:
        """Whether this layer's group takes part in prefix caching."""
        return True

    @property
    def prefix_replay_tokens(self) -> int:
        """Tokens that must be recomputed after a prefix hit (bounded replay)."""
        return 0

    # ----------------------------------------------------------------- sizing
    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        """Admission cap: the most blocks one request of ``ctx.max_model_len`` holds at once.

        The single formula that startup sizing and runtime admission both use.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define max_blocks_per_request")

    def fixed_blocks_per_request(self, ctx: SizingContext) -> int:
        """Of :meth:`max_blocks_per_request`, the blocks a request holds whatever its length
        (a recurrent state, the encoder's K/V); 0 when they all grow with it (the default).
        The planner gives a pool these whole for every request it counts as begun, so a
        fraction of a request's concurrency never buys a fraction of its state."""
        return 0

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        """Most bytes of this layer's cache one request holds at once."""
        return self.max_blocks_per_request(ctx) * self.page_size_bytes

    def block_table_width(self, ctx: SizingContext, max_len: int) -> int:
        """Block-table entries one request needs for ``max_len`` tokens (encoder included)."""
        return cdiv(max_len, self.block_size)

    # ----------------------------------------------------------------- derivation and merge
    def with_block_size(self: SpecT, block_size: int) -> SpecT:
        """A copy of this spec with another block size (validated like construction)."""
        return attrs.evolve(self, block_size=block_size)

    @classmethod
    def merge(cls: type[SpecT], specs: Sequence[SpecT], layer_names: Sequence[str] = ()) -> SpecT:
        """One spec for a group of layers; refuses, naming field, values and layers, when
        they cannot share a group. Order-independent; merging equal specs returns the spec."""
        return merge_by_rules(cls, specs, layer_names)

    def is_uniform_with(self, specs: Mapping[str, KVSpec], registry: SpecKinds) -> bool:
        """Whether all ``specs`` can share one uniform-type group with this one: by default,
        all are instances of this kind's registered uniform-type base."""
        base = registry.uniform_base_of(self)
        # A subclass registered with its own uniform base (R-SWA under full attention) opted
        # out of its parent's groups; honouring that keeps the decision order-independent.
        return all(
            isinstance(spec, base) and registry.uniform_base_of(spec) is base
            for spec in specs.values()
        )
