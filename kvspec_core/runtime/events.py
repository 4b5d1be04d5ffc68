"""KV-cache events an engine can forward (e.g. to a KV-aware router): what entered or left
the prefix cache, per group."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class BlockStored:
    """Full blocks of ``group`` entered the prefix cache, in prefix order."""

    group: int
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    block_size: int
    token_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class BlockRemoved:
    """Blocks of ``group`` were evicted from the prefix cache."""

    group: int
    block_hashes: tuple[bytes, ...]


@attrs.frozen(kw_only=True)
class AllBlocksCleared:
    """The prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
