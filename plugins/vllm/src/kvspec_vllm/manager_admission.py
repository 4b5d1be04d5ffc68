"""How kvspec's manager behind vLLM's scheduler (:mod:`kvspec_vllm.manager`) admits a
request: the cached prefix it is admitted with, and vLLM's full-sequence admission gate
(``scheduler_reserve_full_isl``) counted on kvspec's pool.
"""

from __future__ import annotations

from typing import Any

from kvspec_core.arithmetic import cdiv
from kvspec_core.runtime import CachedPrefix, KVCacheAllocator
from kvspec_vllm.errors import KVSpecVLLMError
from kvspec_vllm.manager_views import not_covered


def admission_prefix(
    allocator: KVCacheAllocator,
    request: Any,
    num_new_computed_tokens: int,
    found: CachedPrefix | None,
    num_groups: int,
) -> CachedPrefix:
    """The prefix a request not running is admitted with: ``found``, the one its lookup
    found (the scheduler must have taken that hit whole), or none."""
    rid = request.request_id
    if request.num_computed_tokens:
        not_covered(
            f"allocate_slots of request {rid!r} with {request.num_computed_tokens} tokens "
            "computed elsewhere",
            "a KV connector",
        )
    if num_new_computed_tokens == 0:
        # An explicit empty prefix: also re-admits a preempted request from token 0.
        epochs = tuple(pool.epoch for pool in allocator.pools)
        empty = tuple(() for _ in range(num_groups))
        return CachedPrefix(request_id=rid, num_tokens=0, block_ids=empty, epochs=epochs)
    if found is None or found.num_tokens != num_new_computed_tokens:
        hit = found.num_tokens if found is not None else 0
        raise KVSpecVLLMError(
            f"kvspec-vllm: request {rid!r} admitted with {num_new_computed_tokens} cached "
            f"tokens, but kvspec's lookup found {hit}: the scheduler changed the hit "
            "(a KV connector or prefix replay), which kvspec's allocator does not follow"
        )
    return found


def full_sequence_fits(
    allocator: KVCacheAllocator,
    request: Any,
    prefix: CachedPrefix | None,
    max_model_len: int,
) -> bool:
    """vLLM's admission gate (``scheduler_reserve_full_isl``) on kvspec's pool: the
    blocks the whole known sequence needs past the hit (at most a group's admission cap,
    so a sliding window counts its window), plus the hit blocks no request holds (a hit
    revives them out of the free blocks), fit in the free blocks. ``prefix`` ``None``:
    the request holds blocks already; past its table, as vLLM counts a known request."""
    full = min(request.num_tokens, max_model_len)
    pool = allocator.pools[0]
    held = allocator.block_ids(request.request_id) if prefix is None else ()
    need = 0
    for gid, rules in enumerate(allocator.rules):
        cap = allocator.admission_caps[gid]
        if cap <= 0:
            continue
        tokens = rules.block_tokens
        wanted = min(cdiv(full, tokens), cap)
        if prefix is None:
            need += max(wanted - len(held[gid]), 0)
            continue
        table = list(prefix.block_ids[gid])
        skipped = rules.skipped_tokens(prefix.num_tokens) // tokens
        need += max(wanted - max(skipped, len(table)), 0)
        need += pool.num_unreferenced(table[skipped:])
    return need <= allocator.usage.free_blocks
