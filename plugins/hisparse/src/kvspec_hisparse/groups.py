"""Group roles of a HiSparse model: the host-resident source and the device-side indexer.

A HiSparse plan keeps the sparse-attention layers' KV (the *source*) in a host pool and the
sparse indexer's keys (the *indexer*) on the device. :class:`HiSparseGroupSpec` wraps the
group spec of either (any family's spec, usually a uniform-type group of MLA layers) and
adds only its placement: sizing, paging and merging are the wrapped spec's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from kvspec_core.context import SizingContext
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError, MergeError
from kvspec_core.specs.base import KVSpec, SpecT
from kvspec_core.specs.merging import require_class
from kvspec_core.validation import is_bool, one_of, optional, positive_int
from kvspec_hisparse.specs import RawPageSpec

if TYPE_CHECKING:
    from kvspec_core.specs.base import SpecKinds

#: Role of the host-resident group holding the sparse-attention KV.
ROLE_SOURCE = "hisparse_source"
#: Role of the device-side group holding the sparse indexer's keys.
ROLE_INDEXER = "hisparse_indexer"
GROUP_ROLES = (ROLE_SOURCE, ROLE_INDEXER)


def _check_inner(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, KVSpec) or isinstance(value, (HiSparseGroupSpec, RawPageSpec)):
        raise InvalidFieldTypeError(
            type(instance).__name__,
            attribute.name,
            value,
            "expected the KVSpec of the group's layers (not a HiSparse spec)",
        )


def _from_inner(name: str) -> Any:
    def default(self: Any) -> Any:
        # Defaults are computed before validators run: refuse a bad inner here, by name,
        # instead of an AttributeError from reading its field.
        _check_inner(self, attrs.fields(type(self)).inner, self.inner)
        return getattr(self.inner, name)

    return attrs.Factory(default, takes_self=True)


@attrs.frozen(kw_only=True)
class HiSparseGroupSpec(KVSpec):
    """A group of a HiSparse plan: ``inner`` placed by ``role``.

    ``hisparse_source`` groups live in the host pool (``host_resident``); ``hisparse_indexer``
    groups stay in the device pool. Both are transferable KV state: the indexer's keys cannot
    be rebuilt from the source's latents, so a connector moves both (the device hot and
    resident pages are the ephemeral, non-transferable replicas).

    Attributes:
        inner: the spec the group's layers have (sizing and paging come from it).
        role: ``hisparse_source`` or ``hisparse_indexer``.
        block_size / dcp_sharded / block_stride_alignment: default to, and must equal,
            ``inner``'s.
    """

    kind: ClassVar[str] = "hisparse_group"

    inner: KVSpec = attrs.field(validator=_check_inner)
    role: str = attrs.field(validator=one_of(*GROUP_ROLES))
    block_size: int = attrs.field(default=_from_inner("block_size"), validator=positive_int)
    dcp_sharded: bool = attrs.field(default=_from_inner("dcp_sharded"), validator=is_bool)
    block_stride_alignment: int | None = attrs.field(
        default=_from_inner("block_stride_alignment"), validator=optional(positive_int)
    )

    def __attrs_post_init__(self) -> None:
        for name in ("block_size", "dcp_sharded", "block_stride_alignment"):
            inner_value = getattr(self.inner, name)
            if getattr(self, name) != inner_value:
                raise InvalidFieldError(
                    type(self).__name__,
                    name,
                    getattr(self, name),
                    f"must equal the wrapped {type(self.inner).__name__}'s {name}="
                    f"{inner_value!r} (leave it unset to take it from the wrapped spec)",
                )

    # ----------------------------------------------------------------- placement
    @property
    def host_resident(self) -> bool:
        return self.role == ROLE_SOURCE

    @property
    def group_role(self) -> str:
        return self.role

    @property
    def transferable(self) -> bool:
        return True

    # ----------------------------------------------------------------- delegated geometry
    @property
    def num_heads(self) -> int:
        return self.inner.num_heads

    @property
    def tokens_per_state(self) -> Any:
        return self.inner.tokens_per_state

    @property
    def state_content_size_bytes(self) -> int:
        return self.inner.state_content_size_bytes

    def num_kernel_states(self, kernel_block_size: int) -> int:
        return self.inner.num_kernel_states(kernel_block_size)

    @property
    def num_states(self) -> int:
        return self.inner.num_states

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.inner.unpadded_page_size_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.inner.page_size_bytes

    @property
    def view_dtype(self) -> torch.dtype | None:
        return self.inner.view_dtype

    @property
    def has_layer_views(self) -> bool:
        return self.inner.has_layer_views

    @property
    def uses_slot_mapping(self) -> bool:
        return self.inner.uses_slot_mapping

    @property
    def block_table_token_alignment(self) -> int | None:
        return self.inner.block_table_token_alignment

    @property
    def prefix_cacheable(self) -> bool:
        return self.inner.prefix_cacheable

    @property
    def prefix_replay_tokens(self) -> int:
        return self.inner.prefix_replay_tokens

    # ----------------------------------------------------------------- delegated sizing
    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return self.inner.max_blocks_per_request(ctx)

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        return self.inner.max_memory_usage_bytes(ctx)

    def block_table_width(self, ctx: SizingContext, max_len: int) -> int:
        return self.inner.block_table_width(ctx, max_len)

    # ----------------------------------------------------------------- derivation and merge
    def with_block_size(self, block_size: int) -> HiSparseGroupSpec:
        return attrs.evolve(
            self, inner=self.inner.with_block_size(block_size), block_size=block_size
        )

    @classmethod
    def merge(cls: type[SpecT], specs: Sequence[SpecT], layer_names: Sequence[str] = ()) -> SpecT:
        """One group spec: roles must agree, and the wrapped specs merge by their own rule."""
        if not specs:
            raise MergeError(f"cannot merge an empty list of {cls.__name__} specs")
        require_class(cls, specs, layer_names)
        groups: list[HiSparseGroupSpec] = list(specs)  # type: ignore[arg-type]
        roles = {spec.role for spec in groups}
        if len(roles) > 1:
            by_role = {
                role: [
                    layer_names[i] if i < len(layer_names) else f"#{i}"
                    for i, spec in enumerate(groups)
                    if spec.role == role
                ]
                for role in sorted(roles)
            }
            detail = "; ".join(f"{role!r} in {', '.join(names)}" for role, names in by_role.items())
            raise MergeError(
                f"layers cannot share one KV cache group: field 'role' differs ({detail}) among "
                f"{cls.__name__} specs; a HiSparse source and indexer are separate groups"
            )
        inner = type(groups[0].inner).merge([spec.inner for spec in groups], layer_names)
        return cls(inner=inner, role=groups[0].role)  # type: ignore[call-arg]

    def is_uniform_with(self, specs: Mapping[str, KVSpec], registry: SpecKinds) -> bool:
        """Uniform with groups of the same role whose wrapped specs are uniform."""
        if not all(
            isinstance(spec, HiSparseGroupSpec) and spec.role == self.role
            for spec in specs.values()
        ):
            return False
        inner = {name: spec.inner for name, spec in specs.items()}  # type: ignore[attr-defined]
        return self.inner.is_uniform_with(inner, registry)
