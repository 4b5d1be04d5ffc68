"""Runtime allocator rules of the HiSparse kinds.

* ``hisparse_hot``: ``blocks_per_request`` blocks taken at admission and kept for the
  request's life (the kernel addresses them itself); never prefix cached.
* ``hisparse_group``: the wrapped spec's rules as the core resolves them (full attention's
  for MLA layers); plugin-registered rules of the wrapped kind are not reachable from a rules
  factory, so a wrapped attention kind gets full attention's. A wrapped spec that is not
  attention (a Mamba state) is refused: full attention's rules would cache every block as if
  it held the state at its end, though a state is written only where a step ends (a false
  prefix hit). So is one sized for fewer blocks than those rules keep (a sliding window or
  a chunked local spec; the core's ``rules_for`` refuses it): every request longer than its
  window would be over its admission cap.
* ``hisparse_resident``: the pages of tokens not yet computed are held; once a token is
  computed its KV is backed by the host, so every block entirely below the computed length
  is reclaimed and a request keeps only its in-flight window (one partial tail block at
  decode). A step whose start is not block-aligned needs one block more than the admission
  cap ``cdiv(min(in_flight, max_model_len), block)`` and is answered ``NotNow``.
"""

from __future__ import annotations

from kvspec_core.context import SizingContext
from kvspec_core.errors import AllocatorError, RulesSizingError
from kvspec_core.plugins.contract import hookimpl
from kvspec_core.plugins.hookspecs import RegisterRuntimeRules
from kvspec_core.runtime import NEVER, FamilyRules, FullAttentionRules, rules_for
from kvspec_core.specs.attention import AttentionSpec
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.uniform import UniformTypeSpecs
from kvspec_hisparse.groups import HiSparseGroupSpec
from kvspec_hisparse.specs import HiSparseHotSpec, HiSparseResidentSpec


class HotCacheRules(FullAttentionRules):
    """A fixed set of blocks per request, allocated once: what the admission cap says."""

    def __init__(self, spec: HiSparseHotSpec, ctx: SizingContext) -> None:
        super().__init__(spec, ctx)
        self.prefix_cacheable = False
        self.blocks_per_request = spec.blocks_per_request

    def blocks_needed(
        self, num_existing: int, num_known: int, num_total: int, num_encoder_tokens: int
    ) -> tuple[int, int]:
        return 0, max(0, self.blocks_per_request - num_existing)

    def next_allocation_end(self, num_existing: int) -> int:
        return NEVER if num_existing >= self.blocks_per_request else 1

    def cache_range(self, num_cached: int, num_known: int) -> tuple[int, int]:
        return num_cached, num_cached


class ResidentRules(FullAttentionRules):
    """Device pages of the tokens in flight; computed tokens' pages are host-backed."""

    def __init__(self, spec: HiSparseResidentSpec, ctx: SizingContext) -> None:
        super().__init__(spec, ctx)
        self.prefix_cacheable = False

    def skipped_tokens(self, num_computed: int) -> int:
        return num_computed

    def next_skip_position(self, num_skipped_blocks: int) -> int:
        return (num_skipped_blocks + 1) * self.block_tokens

    def cache_range(self, num_cached: int, num_known: int) -> tuple[int, int]:
        return num_cached, num_cached


def group_rules(spec: KVSpec, ctx: SizingContext) -> FamilyRules:
    """The rules of a HiSparse source or indexer group: its wrapped spec's (see the module
    docstring; a wrapped spec that is not attention is refused)."""
    inner = spec.inner if isinstance(spec, HiSparseGroupSpec) else spec
    # A uniform-type group of layers: its layers' family decides, as in rules_for.
    layers = inner.first_spec if isinstance(inner, UniformTypeSpecs) else inner
    if not isinstance(layers, AttentionSpec):
        raise AllocatorError(
            f"a HiSparse group wraps {type(layers).__name__} (kind {layers.kind!r}), which is "
            "not attention: its family's runtime rules are not reachable from the HiSparse "
            "group, and full attention's would give false prefix hits on its states; wrap "
            "attention specs only (MLA latents, indexer keys)"
        )
    try:
        return rules_for(inner, ctx, None)
    except RulesSizingError as error:
        # A wrapped spec sized for fewer blocks than the core's rules keep (a window under
        # full attention's): rules_for's fix (register rules) does not apply here.
        raise AllocatorError(
            f"a HiSparse group wraps {type(layers).__name__} (kind {layers.kind!r}), but it "
            "gets the core's runtime rules for it (a plugin's rules for the wrapped kind are "
            f"not reachable from a HiSparse group): {error.shortfall}. Wrap "
            "full-attention-shaped specs only (MLA latents, indexer keys)"
        ) from None


@hookimpl
def kvspec_register_runtime_rules(register: RegisterRuntimeRules) -> None:
    register("hisparse_hot", HotCacheRules)
    register("hisparse_resident", ResidentRules)
    register("hisparse_group", group_rules)
