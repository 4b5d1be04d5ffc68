"""Replicas sharing prefix blocks through a Redis/Valkey server: the engine's remote tier.

``TransformersEngine(..., host_offload_bytes=..., remote=RemoteOptions(...))`` publishes the
blocks its device writes back to the host tier, and before each request's lookup fetches
the blocks after its local hit that another replica published (into the host tier, from
where the lookup loads them like any tier hit). The runtime's
:class:`~kvspec_core.runtime.remote_tier.RemoteTier` does the work; this module builds it
for an engine:

* **What is shared, under which keys.** One store per caching group, its namespace made
  of what fixes a block's bytes: the plan's checksums of ``layout``, ``memoryless_layers``
  and the group's ``layers`` and ``spec``, the context fields that change what a block
  holds (``PAGE_CONTEXT_FIELDS``: decode-context-parallel size, Mamba cache mode, encoder
  tokens), the group, its pool, and ``weights_id``. Not the budgets, block counts,
  ``max_model_len`` or batched-token budget: replicas differing only there store the same
  bytes and share them. The plan only knows shapes: two models of one architecture with
  other weights compute other K/V for the same tokens, so ``weights_id`` is required and
  must name everything else that changes K/V: the checkpoint and its revision, and any
  config override that changes what the layers compute (RoPE scaling, compute dtype,
  quantization).
* **Hashes.** Every replica's allocator hashes with ``hash_salt`` (the default salt is
  random per process, so nothing would be shared).
* **Failures.** Each store call ends by its deadline (``RemoteStoreConfig``: connect and
  reply timeouts plus the time its bytes take at ``min_bytes_per_s``) and the breaker
  stops calling a failing server (one breaker for all the groups' stores, which share the
  server: its ``failures_to_open`` failed calls are counted over all of them); a server
  down costs misses (counted), never an error in ``generate``; a corrupt value is a miss.
  ``generate`` fetches once per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.remote_misses import DEFAULT_MISS_TTL_S
from kvspec_core.runtime.remote_store import (
    BlockNamespace,
    RemoteBlockStore,
    RemoteServer,
    RemoteStoreConfig,
)
from kvspec_core.runtime.remote_tier import DEFAULT_MAX_FETCH_BLOCKS, RemoteTier
from kvspec_transformers.errors import EngineError

if TYPE_CHECKING:
    from kvspec_core.planner.plan import KVCachePlan
    from kvspec_core.runtime import KVCacheAllocator
    from kvspec_core.runtime.tier_copy import TransferRunner

#: The plan's checksums that say what a block's bytes mean (the others are budgets).
SHARED_CHECKSUMS = ("layout", "memoryless_layers")
#: The plan's ``SizingContext`` fields that change what a block holds (``max_model_len``,
#: ``max_in_flight_tokens`` and ``prefix_caching`` do not).
PAGE_CONTEXT_FIELDS = ("dcp_size", "mamba_cache_mode", "max_encoder_tokens")


@attrs.frozen
class RemoteOptions:
    """How an engine shares prefix blocks with other replicas (see the module docstring).

    Attributes:
        store: where the server is and how long a call may wait.
        weights_id: names the model's weights (e.g. ``"meta-llama/Llama-3.1-8B@<rev>"``)
            and every config override that changes its K/V (RoPE scaling, compute dtype,
            quantization); replicas share blocks only under the same one.
        hash_salt: the fleet's prefix-hash salt, the same bytes on every replica.
        max_fetch_blocks / miss_ttl_s: as :class:`RemoteTier`'s.
    """

    store: RemoteStoreConfig
    weights_id: str
    hash_salt: bytes
    max_fetch_blocks: int = DEFAULT_MAX_FETCH_BLOCKS
    miss_ttl_s: float = DEFAULT_MISS_TTL_S

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.store, RemoteStoreConfig):
            raise EngineError(
                f"RemoteOptions.store must be a RemoteStoreConfig, not {type(self.store).__name__}"
            )
        if not isinstance(self.weights_id, str) or not self.weights_id.strip():
            raise EngineError(
                "RemoteOptions.weights_id must name the model's weights (checkpoint and "
                "revision): the plan only knows shapes, and replicas of other weights must "
                "never read each other's blocks"
            )
        if not isinstance(self.hash_salt, bytes) or not self.hash_salt:
            raise EngineError(
                "RemoteOptions.hash_salt must be non-empty bytes, the same on every replica"
            )


def remote_tier(
    options: RemoteOptions,
    plan: KVCachePlan,
    allocator: KVCacheAllocator,
    runner: TransferRunner,
) -> RemoteTier:
    """The remote tier of an engine's allocator: one store per caching group, all on one
    ``RemoteServer`` (one breaker and one connection pool: a server that is down costs the
    engine ``failures_to_open`` failed calls, not that many per group)."""
    server = RemoteServer(options.store)
    checksums = plan.to_dict()["input_checksums"]
    context = {f"context_{name}": getattr(plan.context, name) for name in PAGE_CONTEXT_FIELDS}
    groups = {group.id: group for group in plan.groups}
    caching = [gid for gid, cap in enumerate(allocator.admission_caps) if cap > 0]
    stores = {}
    for gid in caching:
        group = groups[gid]
        shared = {
            name: checksums[name]
            for name in (*SHARED_CHECKSUMS, f"groups[{gid}].layers", f"groups[{gid}].spec")
            if name in checksums
        }
        namespace = BlockNamespace.from_checksums(
            shared,
            **context,
            weights_id=options.weights_id,
            group=gid,
            pool=group.pool,
            tp_rank=0,
        )
        stores[gid] = RemoteBlockStore(namespace, server)
    try:
        return RemoteTier(
            allocator,
            runner,
            stores[caching[0]] if len(caching) == 1 else stores,
            max_fetch_blocks=options.max_fetch_blocks,
            miss_ttl_s=options.miss_ttl_s,
        )
    except AllocatorError as error:
        raise EngineError(f"remote tier refused for this model: {error}") from None
