"""The torch transfer helper: exact round trips device <-> host <-> file on CPU tensors,
driven by a real allocator's transfers."""

from __future__ import annotations

import torch
from runtime_testkit import full, make_allocator

from kvspec_core.runtime import Request
from kvspec_core.runtime.tier_copy import BlockFile, TransferRunner
from kvspec_core.runtime.tiers import OffloadTier, Transfer


def layer_views(num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Two layer views of one pool, of different dtypes and shapes, block dim first (the
    second strided, as a layer-outer layout's view is)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_blocks, 2, 3, 4, generator=generator).to(torch.float16)
    wide = torch.randint(-(2**30), 2**30, (3, num_blocks, 5), generator=generator)
    return [keys, wide.to(torch.int32).transpose(0, 1)]  # [blocks, 3, 5], not contiguous


def transfer(tid, src_tier, dst_tier, src, dst) -> Transfer:
    return Transfer(
        transfer_id=tid,
        kind="store",
        group=0,
        pool=0,
        source_tier=src_tier,
        destination_tier=dst_tier,
        source_blocks=tuple(src),
        destination_blocks=tuple(dst),
    )


def admit_and_transfer(allocator, runner: TransferRunner, rid: str, tokens: list[int]):
    """Admit a prompt with its cached prefix and run the step's transfers, as an engine
    does before the forward: (the prefix, group 0's block table)."""
    request = Request(rid, tokens)
    prefix = allocator.find_cached_prefix(request)
    assert allocator.allocate_slots(request, len(tokens) - prefix.num_tokens, prefix=prefix)
    assert runner.run_pending(allocator) == ()
    return prefix, allocator.block_ids(rid)[0]


def test_blocks_round_trip_exactly_through_host_and_file(tmp_path) -> None:
    device = layer_views(8, 1)
    original = [tensor.clone() for tensor in device]
    host = [torch.zeros_like(tensor) for tensor in layer_views(6, 2)]
    block_bytes = sum(tensor[0].numel() * tensor.element_size() for tensor in device)
    disk = BlockFile(str(tmp_path / "pool0.kvblocks"), block_bytes, 10)
    runner = TransferRunner({0: [device], 1: [host], 2: [disk]})
    done, failed = runner.run(
        [
            transfer(1, 0, 1, [5, 2, 7], [1, 2, 3]),  # device -> host
            transfer(2, 1, 2, [1, 2, 3], [9, 4, 1]),  # host -> file
        ]
    )
    assert (done, failed) == ([1, 2], [])
    for tensor in device:
        tensor.zero_()
    done, failed = runner.run(
        [
            transfer(3, 2, 0, [9, 4, 1], [5, 2, 7]),  # file -> device
            transfer(4, 2, 1, [4], [5]),  # file -> host
        ]
    )
    assert failed == []
    for got, want in zip(device, original, strict=True):
        for block in (5, 2, 7):
            assert torch.equal(got[block], want[block])
        assert not got[0].any()
    assert torch.equal(host[1][5], original[1][2]) and torch.equal(host[0][5], original[0][2])


def test_a_failed_copy_fails_that_transfer_only(tmp_path) -> None:
    device = layer_views(4, 3)
    disk = BlockFile(str(tmp_path / "f"), 4, 2)  # wrong block size for these tensors
    host = [torch.zeros_like(tensor) for tensor in device]
    runner = TransferRunner({0: [device], 1: [host], 2: [disk]})
    done, failed = runner.run(
        [transfer(1, 0, 2, [1], [1]), transfer(2, 0, 1, [1], [1]), transfer(3, 0, 5, [1], [1])]
    )
    assert (done, failed) == ([2], [1, 3])


def test_an_engine_loop_over_a_tiered_allocator_reads_back_what_it_wrote(tmp_path) -> None:
    """The allocator's transfers run by the helper: a prefix computed once, evicted to the
    host and to the file, loads back bit for bit."""
    allocator = make_allocator(
        [full(2)], 6, offload_tiers=(OffloadTier("host", 5), OffloadTier("disk", 17))
    )
    device = [torch.zeros(6, 2, 8, dtype=torch.float16)]
    host = [torch.zeros(5, 2, 8, dtype=torch.float16)]
    disk = BlockFile(str(tmp_path / "disk"), 2 * 8 * 2, 17)
    runner = TransferRunner({0: [device], 1: [host], 2: [disk]})

    def content(tokens: list[int], index: int) -> torch.Tensor:
        # What a forward writes into block ``index``: a function of its prefix.
        seed = hash(tuple(tokens[: (index + 1) * 2])) % 2**31
        return torch.randn(2, 8, generator=torch.Generator().manual_seed(seed)).half()

    def serve(rid: str, tokens: list[int]) -> int:
        prefix, table = admit_and_transfer(allocator, runner, rid, tokens)
        for index in range(prefix.num_tokens // 2):  # the hit: must hold this prefix
            assert torch.equal(device[0][table[index]], content(tokens, index)), index
        for index in range(prefix.num_tokens // 2, len(table)):  # the forward
            device[0][table[index]] = content(tokens, index)
        allocator.free(rid)
        return prefix.num_tokens

    prompts = [list(range(start, start + 9)) for start in (0, 100, 200, 300)]
    for round_ in range(3):
        for number, prompt in enumerate(prompts):
            hit = serve(f"{round_}-{number}", prompt)
            assert hit == (8 if round_ else 0), (round_, number)
    allocator.check_invariants()


def test_a_plans_materialized_tiers_carry_blocks_through_the_allocators_transfers(
    tmp_path,
) -> None:
    """from_plan with the plan's tiers, and the helper over materialize()'s views: a
    prefix evicted to the host and then to disk files loads back bit for bit."""
    from kvspec_core import PluginManager, SizingContext
    from kvspec_core.planner import materialize, plan_kv_cache
    from kvspec_core.planner.layer_views import plan_layer_views
    from kvspec_core.runtime import KVCacheAllocator, tiers_from_plan

    ctx = SizingContext(max_model_len=256, max_in_flight_tokens=64)
    specs = {f"layer{index}": full(16) for index in range(2)}
    plan = plan_kv_cache(
        specs,
        18 * 1024,
        ctx,
        PluginManager(),
        host_offload_bytes=20 * 1024,
        disk_offload_bytes=80 * 1024,
        disk_path=str(tmp_path),
    )
    buffers = materialize(plan)
    layers_of = {}
    for view in plan_layer_views(plan, None):
        layers_of.setdefault(view.pool, []).append(view.layer)
    storage = {
        0: {pool: [buffers.views[name] for name in names] for pool, names in layers_of.items()}
    }
    for number, tier in enumerate(plan.tiers, 1):
        views = buffers.tiers[tier.name].views
        storage[number] = {
            pool: [views[name] for name in names] for pool, names in layers_of.items()
        }
    allocator = KVCacheAllocator.from_plan(
        plan, PluginManager(), offload_tiers=tiers_from_plan(plan), hash_salt=b"t"
    )
    assert [tier.name for tier in allocator._tiers.tiers] == ["host", "disk"]
    runner = TransferRunner(storage)
    device = storage[0][0]
    generator = torch.Generator().manual_seed(7)
    written: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def serve(rid: str, tokens: list[int]) -> int:
        prefix, table = admit_and_transfer(allocator, runner, rid, tokens)
        for index, block in enumerate(table):
            key = tuple(tokens[: (index + 1) * 16])
            if index < prefix.num_tokens // 16:
                assert all(
                    torch.equal(view[block], want)
                    for view, want in zip(device, written[key], strict=True)
                )
            else:
                written[key] = [
                    torch.randn(view[block].shape, generator=generator).to(view.dtype)
                    for view in device
                ]
                for view, data in zip(device, written[key], strict=True):
                    view[block] = data
        allocator.free(rid)
        return prefix.num_tokens

    prompts = [[start + step for step in range(65)] for start in range(0, 1000, 100)]
    for round_ in range(2):
        hits = [serve(f"{round_}-{number}", prompt) for number, prompt in enumerate(prompts)]
        if round_:
            assert sum(hits) > 0
    moved = allocator._tiers.blocks_moved
    assert moved.get((0, 1)) and moved.get((1, 2)) and moved.get((2, 0)), moved


def test_a_copy_into_host_memory_is_blocking(monkeypatch) -> None:
    # non_blocking into (pinned) host memory returns before the bytes arrive; the CPU's
    # index_copy_ would then cache stale bytes as the block (review of issue 20: a CUDA ->
    # host store did that). Only a copy to a GPU may be asynchronous. Recorded on CPU here.
    calls: list[tuple[str, bool]] = []
    real_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        calls.append((str(device), bool(kwargs.get("non_blocking", False))))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    device = layer_views(4, 5)
    host = [torch.zeros_like(tensor) for tensor in device]
    runner = TransferRunner({0: [device], 1: [host]})
    assert runner.run([transfer(1, 0, 1, [1, 3], [2, 1])]) == ([1], [])
    moves = [call for call in calls if call[0] == "cpu"]
    assert moves and not any(non_blocking for _, non_blocking in moves)


class ExplodingStorage(list):
    """Storage whose length check raises what run() does not catch."""

    def __len__(self) -> int:
        raise TypeError("not a storage")


def test_an_unexpected_error_while_copying_leaves_no_transfer_pending(tmp_path) -> None:
    allocator = make_allocator([full(2)], 4, offload_tiers=(OffloadTier("host", 9),))
    runner = TransferRunner({0: [ExplodingStorage()], 1: [ExplodingStorage()]})
    good = TransferRunner(
        {0: [[torch.zeros(4, 3)]], 1: [[torch.zeros(9, 3)]]}  # type: ignore[list-item]
    )
    for number in range(4):  # fill the device; the next admissions evict -> stores
        admit_and_transfer(
            allocator, good, f"warm-{number}", list(range(number * 10, number * 10 + 3))
        )
        allocator.free(f"warm-{number}")
    request = Request("r", list(range(500, 505)))
    assert allocator.allocate_slots(request, 5, prefix=allocator.find_cached_prefix(request))
    try:
        runner.run_pending(allocator)
    except TypeError:
        pass
    else:
        raise AssertionError("the storage's TypeError was swallowed")
    assert allocator.take_transfers() == []
    assert allocator._tiers.num_pending() == 0  # every taken transfer was failed, none dangles
    allocator.check_invariants()
