"""The Python twins of the kernels that sort and store a batch of evicted blocks into an
offload tier (``native.split_held``, ``native.store_victims``: same answers, same errors), and
the refresh of a tier's entries for victims it holds already. Used by
:class:`~kvspec_core.runtime.tier_storing.TierStoring` where the kernels are not built or
do not apply."""

from __future__ import annotations

from itertools import compress, repeat
from typing import Any

from kvspec_core.runtime.native import native
from kvspec_core.runtime.pool import BlockPool

#: What ``split_held`` reads for a hash its cache does not hold.
_ABSENT: Any = object()


def split_held(
    cache: dict[bytes, int], in_flight: dict[bytes, int], hashes: list[bytes], sources: list[int]
) -> tuple[list[int], list[bytes], list[int]]:
    """One group's victims (``hashes``, copied from ``sources``) sorted for a tier store:
    the slots ``cache`` (the tier's ``hash -> slot``) holds some of them in, in order
    (repeats included; those become its most recently used entries instead of a copy),
    then the hashes to copy with their sources: those it does not hold, less those in flight
    to it (``in_flight``) and any repeat of an earlier one (a hash evicted twice since the
    last take, cached again in between: stored once, its first eviction).
    ``native.split_held`` in Python (the compiled one makes the lookups of a batch of
    hundreds of victims in one C loop)."""
    containers = ((cache, dict), (in_flight, dict), (hashes, list), (sources, list))
    if any(type(value) is not kind for value, kind in containers):
        raise TypeError("split_held: cache and in_flight must be dicts, hashes and sources lists")
    if len(hashes) != len(sources):
        raise ValueError("split_held: hashes and sources differ in length")
    # A sentinel, not None: a slot the cache maps to None is held, as the kernel counts it.
    found: list[Any] = list(map(cache.get, hashes, repeat(_ABSENT)))
    held: list[int] = []
    if found.count(_ABSENT) != len(found):
        absent = [slot is _ABSENT for slot in found]
        hashes = list(compress(hashes, absent))
        sources = list(compress(sources, absent))
        held = [slot for slot in found if slot is not _ABSENT]
    if (in_flight and not in_flight.keys().isdisjoint(hashes)) or len(set(hashes)) != len(hashes):
        seen: set[bytes] = set()
        kept_hashes: list[bytes] = []
        kept_sources: list[int] = []
        for digest, source in zip(hashes, sources, strict=True):
            if digest not in in_flight and digest not in seen:
                seen.add(digest)
                kept_hashes.append(digest)
                kept_sources.append(source)
        hashes, sources = kept_hashes, kept_sources
    return held, hashes, sources


def store_victims(
    pool: BlockPool,
    in_flight: dict[bytes, int],
    hashes: list[bytes],
    sources: list[int],
    out_sources: list[int],
    out_destinations: list[int],
    out_hashes: list[bytes],
    transfer_id: int,
) -> int:
    """Store one group's victims (``hashes``, copied from ``sources``) into ``pool``, an
    offload tier's pool of that one group, as one transfer: the hashes its cache holds
    become its most recently used entries (each once, in order of first sight), those in
    flight to it (``in_flight``: hash -> transfer id) and repeats are skipped, and the rest,
    the newest as many as it has free slots for, get slots (``pool.take``: free ones, then
    its oldest entries), appended to ``out_sources`` / ``out_destinations`` / ``out_hashes``
    (the transfer's lists), their hashes in flight to ``transfer_id``. Returns how many.
    Refuses, changing nothing, other containers than dicts and lists, hashes that are not
    bytes, sources that are not ints, lists of different lengths, a pool of several groups
    or one recording events, and a cache naming no slot of the pool.
    ``native.store_victims`` in Python (the compiled one does it in one C call)."""
    containers = (hashes, sources, out_sources, out_destinations, out_hashes)
    if (
        type(in_flight) is not dict
        or any(type(value) is not list for value in containers)
        or type(transfer_id) is not int
    ):
        raise TypeError(
            "store_victims: in_flight must be a dict, hashes, sources and the three outputs "
            "lists, transfer_id an int"
        )
    if len(hashes) != len(sources):
        raise ValueError("store_victims: hashes and sources differ in length")
    if any(type(digest) is not bytes for digest in hashes) or any(
        type(source) is not int for source in sources
    ):
        raise TypeError("store_victims: hashes must be bytes and sources ints")
    refs = pool.ref_counts
    if type(refs) is not list:
        raise TypeError("store_victims: the pool's ref_counts must be a list")
    size = len(refs)
    if pool._events is not None:
        raise ValueError("store_victims: the pool records events (a tier pool records none)")
    caches = pool.caches
    if type(caches) is not dict or len(caches) != 1 or type(_only(caches)) is not dict:
        raise TypeError("store_victims: the pool must serve one group (its caches: one dict)")
    # The kernel works on a pool built with it (its eviction orders are BlockQueues) and
    # refuses another before changing anything: so does this, where the kernels are built.
    orders = (pool._evictable, pool._protected)
    if native is not None and any(type(order) is not native.BlockQueue for order in orders):
        raise TypeError(
            "store_victims: the pool's eviction orders must be its BlockQueues (a pool built "
            "with the compiled kernels)"
        )
    held, kept_hashes, kept_sources = split_held(_only(caches), in_flight, hashes, sources)
    if any(type(slot) is not int or not 1 <= slot < size for slot in held):
        raise ValueError(
            "store_victims: the tier's cache maps a hash to a value that is no slot of its pool"
        )
    refresh_held(pool, held)
    room = pool.num_free_blocks
    if len(kept_hashes) > room:
        kept_hashes = kept_hashes[len(kept_hashes) - room :]
        kept_sources = kept_sources[len(kept_sources) - room :]
    if not kept_hashes:
        return 0
    taken = pool.take(len(kept_hashes))
    if type(taken) is not list:
        raise TypeError("BlockPool.take must return a list")
    if len(taken) != len(kept_hashes):
        raise RuntimeError("store_victims: the pool handed out a wrong count")
    # Counted before the outputs grow: an output list may be the caller's victim list too.
    stored = len(kept_hashes)
    in_flight.update(dict.fromkeys(kept_hashes, transfer_id))
    out_sources.extend(kept_sources)
    out_destinations.extend(taken)
    out_hashes.extend(kept_hashes)
    return stored


def refresh_held(pool: BlockPool, held: list[int]) -> None:
    """The slots ``held`` (a tier's entries for victims it holds already; repeats allowed)
    become ``pool``'s most recently used entries, each once, in order of first sight (one in
    use keeps its count)."""
    if held:
        refresh = list(dict.fromkeys(held)) if len(held) > 1 else held
        pool.touch(refresh, known_cached=True)
        pool._release_unchecked(refresh)


def _only(caches: dict[int, dict[bytes, int]]) -> dict[bytes, int]:
    return next(iter(caches.values()))
