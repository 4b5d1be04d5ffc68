"""Types of the compiled kernels (``_native.c``); see :mod:`kvspec_core.runtime.native`."""

from collections import OrderedDict
from collections.abc import Callable, Iterable
from array import array
from typing import Any

def blake2b(data: bytes, digest_size: int, /) -> bytes: ...
def chain_hashes(
    parent: bytes, tokens: list[int], start: int, stop: int, block_tokens: int,
    out: list[bytes], /,
) -> None: ...
def release(
    blocks: list[int], reverse: bool, refs: list[int], block_hash: list[bytes | None],
    reused: bytearray, fresh: array[int], evictable: OrderedDict[int, None],
    protected: OrderedDict[int, None], /,
) -> None: ...
def touch(
    blocks: list[int], refs: list[int], reused: bytearray, evictable: OrderedDict[int, None],
    protected: OrderedDict[int, None], segmented: bool, check: bool, /,
) -> int: ...
def evict_take(
    count: int, out: list[int], evictable: OrderedDict[int, None],
    caches: dict[int, dict[bytes, int]], block_group: array[int],
    block_hash: list[bytes | None], refs: list[int], /,
) -> None: ...
def cache_blocks(
    gid: int, digests: list[bytes], blocks: list[int], cache: dict[bytes, int],
    block_hash: list[bytes | None], block_group: array[int] | None,
    move_hash: Callable[[dict[bytes, int], bytes, int, int], None], /,
) -> int: ...
def step(
    pairs: Iterable[Any], running: dict[Any, Any], lookahead: int, no_new_blocks: Any,
    allocate_slots: Callable[[Any, int, int], Any], one_pair: Callable[[Any, int], Any],
    results: list[Any], /,
) -> None: ...
def longest_hit(digests: list[bytes], cache: dict[bytes, int], max_blocks: int, /) -> list[int]: ...
def register_state_type(cls: type, /) -> None: ...
