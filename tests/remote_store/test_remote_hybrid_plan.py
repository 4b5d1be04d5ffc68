"""``plan_remote_fetch`` for full attention + sliding window and full attention + Mamba
hybrids, against first principles (hypothesis; no server: what the store "has" is the
planner's input): the planned hit is one every group can resume from with what is local or
fetched, only blocks that hit needs are fetched (the window's for the sliding group, the
state at the hit for Mamba), and once they are written the lookup finds exactly that hit,
every block it needs held."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvspec_core import FullAttentionSpec, SizingContext
from kvspec_core.runtime import KVCacheAllocator, OffloadTier, Request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from runtime_testkit import mamba, manager_with_families, needed_indices, sliding

BLOCK = 2
WINDOW = 5  # tokens: the 2 blocks of 2 before a hit past the first window (retained 4)
#: Whether the store has a block: mostly, so that long remote runs and windows occur.
HAS = st.sampled_from([True, True, True, False])
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 40, 41], [7] * 10)


def allocator(second: str) -> KVCacheAllocator:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16)
    hybrid = {
        "sliding": ([sliding(BLOCK, WINDOW)], 12, None),
        "mamba": ([mamba(BLOCK)], [12, 8], [0, 1]),
    }
    specs, blocks, pools = hybrid[second]
    return KVCacheAllocator(
        [full, *specs],
        blocks,
        SizingContext(max_model_len=32, max_in_flight_tokens=32, mamba_cache_mode="align"),
        pool_of_group=pools,
        manager=manager_with_families(),
        hash_salt=b"plan",
        offload_tiers=(OffloadTier("host", 64),),
    )


def run(engine: KVCacheAllocator, rid: int, tokens: list[int]) -> None:
    """Admit, confirm every copy, free: the prompt's blocks end up cached somewhere."""
    request = Request(rid, tokens)
    prefix = engine.find_cached_prefix(request)
    if engine.allocate_slots(request, len(tokens) - prefix.num_tokens, prefix=prefix):
        for transfer in engine.take_transfers():
            engine.complete_transfers([transfer.transfer_id])
        engine.free(rid)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    second=st.sampled_from(["sliding", "mamba"]),
    history=st.lists(
        st.tuples(st.sampled_from(range(len(PREFIXES))), st.integers(1, 12)), max_size=5
    ),
    prompt=st.tuples(
        st.sampled_from(range(len(PREFIXES))), st.lists(st.integers(0, 3), max_size=4)
    ),
    remote=st.data(),
)
def test_the_planned_hit_is_resumable_and_fetches_only_what_it_needs(
    second, history, prompt, remote
):
    engine = allocator(second)
    for rid, (which, length) in enumerate(history):
        run(engine, rid, PREFIXES[which][:length] + [99])
    tokens = PREFIXES[prompt[0]] + prompt[1] + [0]
    request = Request("b", tokens)
    local = engine.find_cached_prefix(request).num_tokens
    chains = {gid: engine.block_hashes(request, gid) for gid in (0, 1)}
    available = {
        gid: {h for h in chain if remote.draw(HAS, label=f"store {gid} has")}
        for gid, chain in chains.items()
    }
    hit, wanted = engine.plan_remote_fetch(request, available)

    assert hit >= local
    for gid, hashes in wanted.items():
        assert set(hashes) <= available[gid]
        indices = [chains[gid].index(h) for h in hashes]
        needed = needed_indices(engine.specs[gid], BLOCK, hit)
        assert all(index in needed for index in indices), (gid, indices, hit)
    # Write what was planned, as a fetch would; the lookup then finds exactly that hit.
    need = {gid: chains[gid][: hit // BLOCK] for gid in (0, 1)}
    for gid, hashes in wanted.items():
        for digest in hashes:  # one by one: a window's blocks need not be a run
            reservation = engine.reserve_remote_blocks(gid, [digest], local_hit=need)
            assert reservation is not None and reservation.demotions == ()
            engine.complete_transfers([reservation.transfer.transfer_id])
    engine.check_invariants()
    found = engine.find_cached_prefix(request)
    assert found.num_tokens == hit
    # From first principles: every block each group needs at the hit is held.
    for gid in (0, 1):
        held = engine._tiers.views[gid]
        for index in needed_indices(engine.specs[gid], BLOCK, hit):
            assert chains[gid][index] in held, (gid, index, hit)
