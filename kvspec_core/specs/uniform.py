"""The uniform-type wrapper: layers of one type but different shapes in one group."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.errors import InvalidFieldError, MergeError
from kvspec_core.specs.base import KVSpec, SpecKinds


def _check_layer_specs(instance: Any, attribute: Any, value: object) -> None:
    if (
        not isinstance(value, tuple)
        or not value
        or not all(
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], KVSpec)
            and not isinstance(item[1], UniformTypeSpecs)
            for item in value
        )
    ):
        raise InvalidFieldError(
            type(instance).__name__,
            attribute.name,
            value,
            "must be a non-empty tuple of (layer name, layer spec) pairs",
        )


@attrs.frozen(kw_only=True)
class UniformTypeSpecs(KVSpec):
    """One group whose layers share a type (they always need the same blocks per token) but
    not a shape: a page holds every layer's page side by side.

    Build it with :meth:`from_specs`, which checks uniformity through the registry.
    """

    kind: ClassVar[str] = "uniform_type"

    layer_specs: tuple[tuple[str, KVSpec], ...] = attrs.field(validator=_check_layer_specs)

    def __attrs_post_init__(self) -> None:
        sizes = {spec.block_size for _, spec in self.layer_specs}
        if sizes != {self.block_size}:
            raise InvalidFieldError(
                type(self).__name__,
                "block_size",
                self.block_size,
                f"must equal every layer's block size (layers have {sorted(sizes)})",
            )
        # Runtime rules read the group's dcp_sharded; the layers must agree with it.
        sharding = {spec.dcp_sharded for _, spec in self.layer_specs}
        if sharding != {self.dcp_sharded}:
            raise InvalidFieldError(
                type(self).__name__,
                "dcp_sharded",
                self.dcp_sharded,
                f"must equal every layer's dcp_sharded (layers have {sorted(sharding)})",
            )

    @property
    def specs(self) -> dict[str, KVSpec]:
        return dict(self.layer_specs)

    @property
    def first_spec(self) -> KVSpec:
        return self.layer_specs[0][1]

    @property
    def num_heads(self) -> int:
        return self.first_spec.num_heads

    @property
    def tokens_per_state(self) -> Any:
        return self.first_spec.tokens_per_state

    @property
    def state_content_size_bytes(self) -> int:
        return self.first_spec.state_content_size_bytes

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for _, spec in self.layer_specs)

    @property
    def unpadded_page_size_bytes(self) -> int:
        return sum(spec.unpadded_page_size_bytes for _, spec in self.layer_specs)

    @property
    def prefix_cacheable(self) -> bool:
        return all(spec.prefix_cacheable for _, spec in self.layer_specs)

    @property
    def prefix_replay_tokens(self) -> int:
        return max(spec.prefix_replay_tokens for _, spec in self.layer_specs)

    @property
    def block_table_token_alignment(self) -> int | None:
        return self.first_spec.block_table_token_alignment

    @property
    def uses_slot_mapping(self) -> bool:
        return self.first_spec.uses_slot_mapping

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return max(
            cdiv(spec.max_memory_usage_bytes(ctx), spec.page_size_bytes)
            for _, spec in self.layer_specs
        )

    def fixed_blocks_per_request(self, ctx: SizingContext) -> int:
        # Fixed only when every layer's blocks are: one growing layer makes the group grow.
        if all(
            spec.fixed_blocks_per_request(ctx) == spec.max_blocks_per_request(ctx)
            for _, spec in self.layer_specs
        ):
            return self.max_blocks_per_request(ctx)
        return 0

    def block_table_width(self, ctx: SizingContext, max_len: int) -> int:
        widths = {spec.block_table_width(ctx, max_len) for _, spec in self.layer_specs}
        if len(widths) != 1:
            raise MergeError(
                f"layers of one uniform-type group need different block-table widths "
                f"{sorted(widths)} for {max_len} tokens; they cannot share a group"
            )
        return widths.pop()

    def max_layers_per_page_size(self) -> int:
        """Most layers sharing one page size (the pattern's repetitions in a balanced group)."""
        return Counter(spec.page_size_bytes for _, spec in self.layer_specs).most_common(1)[0][1]

    @staticmethod
    def is_uniform_type(specs: Mapping[str, KVSpec], registry: SpecKinds) -> bool:
        """Whether ``specs`` share block size, DCP sharding and the first spec's uniformity rule."""
        if not specs:
            return False
        values = list(specs.values())
        if len({spec.block_size for spec in values}) > 1:
            return False
        if len({spec.dcp_sharded for spec in values}) > 1:
            return False
        return values[0].is_uniform_with(specs, registry)

    @classmethod
    def from_specs(
        cls, specs: Mapping[str, KVSpec], registry: SpecKinds
    ) -> UniformTypeSpecs | None:
        """The wrapper over ``specs`` if they are uniform, else ``None``."""
        if not cls.is_uniform_type(specs, registry):
            return None
        first = next(iter(specs.values()))
        return cls(
            block_size=first.block_size,
            dcp_sharded=first.dcp_sharded,
            layer_specs=tuple(specs.items()),
        )


def iter_layer_specs(spec: KVSpec) -> tuple[KVSpec, ...]:
    """The per-layer specs a group spec covers (the wrapper's members, or the spec itself)."""
    if isinstance(spec, UniformTypeSpecs):
        return tuple(layer_spec for _, layer_spec in spec.layer_specs)
    return (spec,)
