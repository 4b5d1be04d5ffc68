"""The runtime block allocator: prefix caching that is safe on hybrid models.

Public API::

    from kvspec_core.runtime import KVCacheAllocator, Request
    allocator = KVCacheAllocator.from_plan(plan, manager)       # or KVCacheAllocator(specs, ...)
    prefix = allocator.find_cached_prefix(request)
    result = allocator.allocate_slots(request, n, prefix=prefix)  # Allocated | NotNow (falsy)
    allocator.free(request.request_id); allocator.usage; allocator.reset_prefix_cache()

Family behaviour comes from :mod:`kvspec_core.runtime.rules` (plugins register their own).
"""

from kvspec_core.runtime.allocator import KVCacheAllocator
from kvspec_core.runtime.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvspec_core.runtime.hashing import PrefixHasher
from kvspec_core.runtime.pool import NULL_BLOCK, BlockPool
from kvspec_core.runtime.remote_store import (
    BlockNamespace,
    RemoteBlockStore,
    RemoteServer,
    RemoteStoreConfig,
)
from kvspec_core.runtime.remote_tier import RemoteTier
from kvspec_core.runtime.request import MultiModalInput, Request
from kvspec_core.runtime.results import (
    NO_FREE_BLOCKS,
    OVER_ADMISSION_CAP,
    STALE_PREFIX,
    Allocated,
    CachedPrefix,
    NotNow,
    Usage,
)
from kvspec_core.runtime.rules import (
    NEVER,
    CrossAttentionRules,
    FamilyRules,
    FullAttentionRules,
    RulesFactory,
    SingleBlockRules,
    StateCheckpointRules,
    TrailingWindowRules,
    block_tokens_of,
    rules_for,
)
from kvspec_core.runtime.simulation import SimulationReport, TierTraffic, simulate
from kvspec_core.runtime.tier_copy import BlockFile, TransferRunner
from kvspec_core.runtime.tiers import OffloadTier, TieredPrefix, Transfer, tiers_from_plan

__all__ = [
    "NEVER",
    "NO_FREE_BLOCKS",
    "NULL_BLOCK",
    "OVER_ADMISSION_CAP",
    "STALE_PREFIX",
    "AllBlocksCleared",
    "Allocated",
    "BlockFile",
    "BlockNamespace",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CachedPrefix",
    "CrossAttentionRules",
    "FamilyRules",
    "FullAttentionRules",
    "KVCacheAllocator",
    "KVCacheEvent",
    "MultiModalInput",
    "NotNow",
    "OffloadTier",
    "PrefixHasher",
    "RemoteBlockStore",
    "RemoteServer",
    "RemoteStoreConfig",
    "RemoteTier",
    "Request",
    "RulesFactory",
    "SimulationReport",
    "SingleBlockRules",
    "StateCheckpointRules",
    "TierTraffic",
    "TieredPrefix",
    "TrailingWindowRules",
    "Transfer",
    "TransferRunner",
    "Usage",
    "block_tokens_of",
    "rules_for",
    "simulate",
    "tiers_from_plan",
]
