"""Types of the compiled kernels (``_native_src/``); see :mod:`kvspec_core.runtime.native`."""

from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: 1 when the kernels prefetch the memory of dict lookups in their loops (CPython 3.11 /
#: 3.12 with a table layout matching the one mirrored in ``dict_prefetch.h``), else 0.
dict_prefetch: int

def blake2b(data: bytes, digest_size: int, /) -> bytes: ...
def chain_hashes(
    parent: bytes,
    tokens: list[int],
    start: int,
    stop: int,
    block_tokens: int,
    out: list[bytes],
    /,
) -> None: ...
def release(
    blocks: list[int],
    reverse: bool,
    refs: list[int],
    block_hash: list[bytes | None],
    reused: bytearray,
    fresh: array[int],
    evictable: BlockQueue,
    protected: BlockQueue,
    /,
) -> None: ...
def touch(
    blocks: list[int],
    refs: list[int],
    reused: bytearray,
    evictable: BlockQueue,
    protected: BlockQueue,
    segmented: bool,
    check: bool,
    /,
) -> int: ...
def evict_take(
    count: int,
    out: list[int],
    evictable: BlockQueue,
    caches: dict[int, dict[bytes, int]],
    block_group: array[int],
    block_hash: list[bytes | None],
    refs: list[int],
    groups_out: list[int] | None = None,
    hashes_out: list[bytes] | None = None,
    /,
) -> None: ...
def cache_blocks(
    gid: int,
    digests: list[bytes],
    blocks: list[int],
    cache: dict[bytes, int],
    block_hash: list[bytes | None],
    block_group: array[int] | None,
    move_hash: Callable[[dict[bytes, int], bytes, int, int], None],
    /,
) -> int: ...
def step(
    pairs: Iterable[Any],
    running: dict[Any, Any],
    lookahead: int,
    no_new_blocks: Any,
    allocate_slots: Callable[[Any, int, int], Any],
    one_pair: Callable[[Any, int], Any],
    results: list[Any],
    /,
) -> None: ...
def count_unreferenced(blocks: list[int], refs: list[int], /) -> int: ...
def decode_step(
    request_ids: list[Any] | tuple[Any, ...],
    tokens: list[Any] | tuple[Any, ...],
    running: dict[Any, Any],
    lookahead: int,
    no_new_blocks: Any,
    allocate_slots: Callable[[Any, int, int], Any],
    results: list[Any],
    /,
) -> int: ...
def longest_hit(digests: list[bytes], cache: dict[bytes, int], max_blocks: int, /) -> list[int]: ...
def split_held(
    cache: dict[bytes, int],
    in_flight: dict[bytes, int],
    hashes: list[bytes],
    sources: list[int],
    /,
) -> tuple[list[int], list[bytes], list[int]]: ...
def store_victims(
    pool: Any,
    in_flight: dict[bytes, int],
    hashes: list[bytes],
    sources: list[int],
    out_sources: list[int],
    out_destinations: list[int],
    out_hashes: list[bytes],
    transfer_id: int,
    /,
) -> int: ...
def register_types(
    state_class: type,
    request_class: type,
    allocated_class: type,
    prefix_class: type,
    /,
) -> None: ...
def find_prefix(
    config: tuple[dict[Any, Any], Any, Any, dict[bytes, int], int],
    method: Callable[[Any], Any],
    request: Any,
    /,
) -> Any: ...

class BlockQueue:
    """An insertion-ordered set of block ids ``0 .. capacity - 1`` with the subset of
    ``OrderedDict[int, None]`` the pool uses; 8 bytes per block once used."""

    def __init__(self, capacity: int) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, block: object) -> bool: ...
    def __iter__(self) -> Iterator[int]: ...
    def __getitem__(self, block: int) -> None: ...
    def __setitem__(self, block: int, value: None) -> None: ...
    def __delitem__(self, block: int) -> None: ...
    def popitem(self, last: bool = True) -> tuple[int, None]: ...
    def clear(self) -> None: ...

class SlotsFastPath:
    """``allocate_slots`` of an allocator built with the kernels: decode steps that need no
    block are answered in C; with ``dense`` (``(pool, hasher, block_tokens,
    admission_cap, max_model_len, hash_block_size, cacheable)`` of a one-group
    full-attention allocator) so are most steps that cross a block boundary; with ``groups``
    (``(hasher, max_model_len, hash_block_size, cacheable, num_groups, ((gid, shape,
    block_tokens, admission_cap, retained_tokens, is_state, pool), ...))`` of an allocator
    whose holding groups all have one of the core's parametric rule shapes, shape 0: full
    attention, 1: trailing window, 2: state checkpoints) too; with ``admit`` (``(freed,
    prefix_class, pools, groups)``: the allocator's freed request ids, ``CachedPrefix``, its
    pools and a ``groups`` tuple) most admissions of a request; every other call goes to
    ``general``."""

    __wrapped__: Callable[..., Any]

    def __init__(
        self,
        running: dict[Any, Any],
        no_new_blocks: Any,
        general: Callable[..., Any],
        dense: tuple[Any, Any, int, int, int, int, bool] | None = None,
        groups: tuple[
            Any, int, int, bool, int, tuple[tuple[int, int, int, int, int, bool, Any], ...]
        ]
        | None = None,
        admit: tuple[dict[Any, None], type, tuple[Any, ...], tuple[Any, ...]] | None = None,
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
