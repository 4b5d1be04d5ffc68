"""What every part of :class:`~kvspec_core.runtime.allocator.KVCacheAllocator` reads.

The allocator is one class assembled from one base class per job (admission, growth,
prefix lookup, the compiled fast paths, freeing, the state checks; see the runtime
README). They are base classes, not modules of functions, because their methods must stay
methods of the allocator: the compiled fast paths call them back as bound methods, a
subclass that overrides one of them (tests do, to compare paths) turns the compiled path
off, and tests replace them on an instance. This base declares the attributes
``KVCacheAllocator.__init__`` sets (the kernels read none of them by name: what they need is
handed to them in tuples, see ``fast_paths.py``) and holds the refusals every job shares.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvspec_core.context import SizingContext
from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.coordinator import PrefixCoordinator
from kvspec_core.runtime.events import KVCacheEvent
from kvspec_core.runtime.hashing import PrefixHasher
from kvspec_core.runtime.offloading import TierManager
from kvspec_core.runtime.pool import BlockPool
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.results import (
    NO_FREE_BLOCKS,
    OVER_ADMISSION_CAP,
    Allocated,
    NotNow,
)
from kvspec_core.runtime.rules import FamilyRules, plugin_rules_error
from kvspec_core.runtime.running import _id_error, _is_id, _Running
from kvspec_core.specs.base import KVSpec


class AllocatorBase:
    """The allocator's layout (set by ``KVCacheAllocator.__init__``) and shared refusals."""

    ctx: SizingContext
    specs: tuple[KVSpec, ...]
    max_model_len: int
    enable_prefix_caching: bool
    hash_block_size: int
    pools: list[BlockPool]
    rules: list[FamilyRules]
    admission_caps: list[int]
    _events: list[KVCacheEvent] | None
    _rules_owners: list[tuple[str, str] | None]
    _pool_of: list[int]
    _group_pools: list[BlockPool]
    _holding: list[int]
    _holds_encoder: bool
    _hasher: PrefixHasher
    _block_tokens: list[int]
    _hash_stride: list[int]
    _caches: list[dict[bytes, int]]
    _cacheable: bool
    _coordinator: PrefixCoordinator
    _guarded: list[int]
    _guarded_methods: dict[int, frozenset[str]]
    _is_state_group: list[bool]
    _prompt_only: list[bool]
    _dense: bool
    _single_full: bool
    _hash_finer: bool
    _running: dict[str | int, _Running]
    _freed: OrderedDict[str | int, None]
    _handed_out: dict[str | int, tuple[Any, ...]]
    _no_new_blocks: Allocated
    _tiers: TierManager | None

    def _state(self, request_id: str | int) -> _Running:
        state = self._running.get(request_id) if _is_id(request_id) else None
        if state is None:
            raise AllocatorError(self._not_running_message(request_id))
        return state

    def _not_running_message(self, request_id: str | int) -> str:
        if not _is_id(request_id):
            return _id_error(request_id)
        if request_id in self._freed:
            return f"request {request_id!r} was already freed (double free)"
        return f"request {request_id!r} is unknown to this allocator (never allocated)"

    def _lookup_limit(self, request: Request) -> int:
        """The most tokens a prefix of ``request`` may cover: all but its last (computed,
        for its logits), and, where a group caches only prompt blocks (R-SWA), no more than
        its prompt: past it, the request's own K/V were computed as generated tokens, not as
        the prompt tokens the cached blocks were."""
        limit = len(request.token_ids) - 1
        if any(self._prompt_only[gid] for gid in self._holding):
            limit = min(limit, request.num_prompt_tokens)
        return limit

    def _check_counts(self, request: Request, num_new_tokens: int, lookahead: int) -> None:
        for name, value in (("num_new_tokens", num_new_tokens), ("lookahead", lookahead)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise AllocatorError(
                    f"allocate_slots(request {request.request_id!r}): {name}={value!r} must "
                    "be an int >= 0: pass "
                    + (
                        "the number of tokens to give slots to (1 per decode step; on "
                        "admission the prompt length minus the cached prefix)"
                        if name == "num_new_tokens"
                        else "the speculative slots wanted, or 0"
                    )
                )

    def _over_length(self, request: Request, known: int) -> NotNow:
        return NotNow(
            reason=OVER_ADMISSION_CAP,
            message=(
                f"request {request.request_id!r} would hold {known} tokens, more than "
                f"max_model_len={self.max_model_len} the plan admits; finish or truncate it"
            ),
        )

    def _plugin_error(self, error: Exception) -> Exception:
        """``error`` as a kvspec error naming the plugin when plugin rules raised it (they
        are asked before a step changes anything, so nothing changed), else ``error``."""
        found = plugin_rules_error(error, self.rules, self._rules_owners)
        if found is None:
            raise error
        return found

    def _over_cap(self, request: Request, gid: int, held: int) -> NotNow:
        spec = self.specs[gid]
        return NotNow(
            reason=OVER_ADMISSION_CAP,
            group=gid,
            message=(
                f"request {request.request_id!r} would hold {held} blocks of group {gid} "
                f"({spec.kind}), over its admission cap of {self.admission_caps[gid]} "
                f"(spec.max_blocks_per_request for max_model_len={self.ctx.max_model_len}, "
                f"max_in_flight_tokens={self.ctx.max_in_flight_tokens}); schedule fewer tokens "
                "per step"
            ),
        )

    def _shortfall(self, need: list[int], freed: list[int]) -> NotNow | None:
        for index, pool in enumerate(self.pools):
            available = pool.num_free_blocks + freed[index]
            if need[index] > available:
                return NotNow(
                    reason=NO_FREE_BLOCKS,
                    blocks_needed=need[index],
                    blocks_free=available,
                    message=(
                        f"pool {index} has {available} free blocks, {need[index]} needed; "
                        "retry after a request finishes"
                    ),
                )
        return None
