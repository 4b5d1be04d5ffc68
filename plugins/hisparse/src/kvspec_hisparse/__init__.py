"""kvspec plugin for HiSparse: host-resident sparse-attention KV with device hot and resident
pages (``hisparse_hot``, ``hisparse_resident``, ``hisparse_group``) and host-pool sizing."""

from kvspec_hisparse.groups import (
    GROUP_ROLES,
    ROLE_INDEXER,
    ROLE_SOURCE,
    HiSparseGroupSpec,
)
from kvspec_hisparse.host_pool import (
    HOST_POOL_EXTRA_BLOCKS,
    HostPoolSizing,
    min_host_blocks,
    size_host_pool,
    size_host_pool_for_specs,
)
from kvspec_hisparse.specs import HiSparseHotSpec, HiSparseResidentSpec, RawPageSpec

__all__ = [
    "GROUP_ROLES",
    "HOST_POOL_EXTRA_BLOCKS",
    "ROLE_INDEXER",
    "ROLE_SOURCE",
    "HiSparseGroupSpec",
    "HiSparseHotSpec",
    "HiSparseResidentSpec",
    "HostPoolSizing",
    "RawPageSpec",
    "min_host_blocks",
    "size_host_pool",
    "size_host_pool_for_specs",
]
