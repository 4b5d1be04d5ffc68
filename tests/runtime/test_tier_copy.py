"""The torch transfer helper: exact round trips device <-> host <-> file on CPU tensors,
driven by a real allocator's transfers."""

from __future__ import annotations

import pytest
import torch
from runtime_testkit import full, make_allocator

from kvspec_core.errors import AllocatorError
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
    runner = TransferRunner(
        {0: [ExplodingStorage([torch.zeros(4, 3)])], 1: [ExplodingStorage([torch.zeros(9, 3)])]}
    )
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


# ------------------------------------------------------------------ found by review
def planned_views(dtype, kernel_block_sizes=None):
    """Two full-attention layers planned with a host tier and materialised: an allocator
    of the plan, and the runner over its device and host views."""
    from kvspec_core import FullAttentionSpec, PluginManager, SizingContext
    from kvspec_core.planner import materialize, plan_kv_cache
    from kvspec_core.runtime import KVCacheAllocator, tiers_from_plan

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=dtype)
    page = spec.page_size_bytes
    context = SizingContext(max_model_len=64, max_in_flight_tokens=64)
    plan = plan_kv_cache(
        {"l0": spec, "l1": spec},
        9 * 2 * page,
        context,
        PluginManager(),
        host_offload_bytes=40 * 2 * page,
    )
    buffers = materialize(plan, kernel_block_sizes=kernel_block_sizes)
    device = [buffers.views[name] for name in ("l0", "l1")]
    host = [buffers.tiers["host"].views[name] for name in ("l0", "l1")]
    allocator = KVCacheAllocator.from_plan(
        plan, PluginManager(), offload_tiers=tiers_from_plan(plan), hash_salt=b"x"
    )
    return allocator, TransferRunner({0: {0: device}, 1: {0: host}}), device


def serve_with_bytes(allocator, runner, device, rows_per_block) -> int:
    """Four prompts twice (the second round loads them back from the host): each block a
    forward writes gets bytes derived from the tokens it covers; every block of a hit must
    hold its own. Returns the hit tokens of the second round."""

    def content(tokens, index):
        seed = hash(tuple(tokens[: (index + 1) * 16])) % 2**31
        rows = torch.randint(
            0,
            255,
            (rows_per_block, *device[0].shape[1:]),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(seed),
        )
        return (
            rows.view(device[0].dtype)
            if device[0].element_size() == 1
            else rows.to(device[0].dtype)
        )

    hits = 0
    for round_ in range(2):
        for start in (0, 100, 200, 300):
            tokens = [start + offset for offset in range(33)]
            prefix, table = admit_and_transfer(allocator, runner, f"{round_}-{start}", tokens)
            for index, block in enumerate(table[: len(tokens) // 16]):
                rows = range(block * rows_per_block, (block + 1) * rows_per_block)
                for view in device:
                    want = content(tokens, index)
                    if index < prefix.num_tokens // 16:
                        assert torch.equal(view[rows].view(torch.uint8), want.view(torch.uint8)), (
                            f"round {round_}, prompt {start}: hit block {index} holds other bytes"
                        )
                    else:
                        view[rows] = want
            allocator.free(f"{round_}-{start}")
            hits += prefix.num_tokens * round_
    return hits


def test_kernel_block_views_move_whole_blocks() -> None:
    """``materialize(kernel_block_sizes=...)`` views hold k rows per block: the runner
    learns k from the allocator and moves every row of a block (before: one kernel block,
    half of another, each load reported ok)."""
    allocator, runner, device = planned_views(torch.float16, {0: 8})
    assert device[0].shape[0] == 2 * allocator.pools[0].num_blocks
    assert serve_with_bytes(allocator, runner, device, 2) == 4 * 32
    assert runner.rows_per_block == {(0, 0): 2, (1, 0): 2}


def test_views_that_index_no_whole_blocks_are_refused(tmp_path) -> None:
    allocator, _, device = planned_views(torch.float16)
    runner = TransferRunner({0: {0: [view[:-1] for view in device]}})
    with pytest.raises(AllocatorError, match=r"tier 0, pool 0 has 9 blocks, but its tensors"):
        runner.check_storage(allocator)
    small = BlockFile(str(tmp_path / "host.kvblocks"), 1024, 10)
    with pytest.raises(AllocatorError, match=r"fewer than the pool's 40; .*num_blocks=40"):
        TransferRunner({1: {0: small}}).check_storage(allocator)


def test_fp8_views_are_copied_as_bytes() -> None:
    """``index_copy_`` has no fp8 kernel on the CPU: the copies move the bytes (before:
    every transfer of an fp8 cache failed, so nothing was ever offloaded)."""
    allocator, runner, device = planned_views(torch.float8_e4m3fn)
    assert device[0].dtype == torch.float8_e4m3fn
    assert serve_with_bytes(allocator, runner, device, 1) == 4 * 32


def test_one_row_lands_whatever_its_tensors_alignment(tmp_path) -> None:
    """A block of 3 fp16 then 2 int32 values (14 bytes): one row's int32 part sits at an
    offset int32 cannot view in place; it is copied first (before: one block failed where
    two worked)."""
    device = [
        torch.arange(24).reshape(8, 3).to(torch.float16),
        torch.arange(16, dtype=torch.int32).reshape(8, 2) + 1000,
    ]
    disk = BlockFile(str(tmp_path / "pool0.kvblocks"), 14, 8)
    runner = TransferRunner({0: [device], 2: [disk]})
    assert runner.run([transfer(1, 0, 2, [3], [3])]) == ([1], [])
    expected = [tensor[3].clone() for tensor in device]
    for tensor in device:
        tensor.zero_()
    assert runner.run([transfer(2, 2, 0, [3], [5])]) == ([2], [])
    assert all(torch.equal(tensor[5], want) for tensor, want in zip(device, expected, strict=True))
    runner.write_blocks(0, 0, [6], runner.read_blocks(0, 0, [5]))
    assert all(torch.equal(tensor[6], want) for tensor, want in zip(device, expected, strict=True))


def test_rows_that_are_not_bytes_are_refused(tmp_path) -> None:
    device = layer_views(4, 1)
    block_bytes = sum(tensor[0].numel() * tensor.element_size() for tensor in device)
    runner = TransferRunner({0: [device], 2: [BlockFile(str(tmp_path / "f"), block_bytes, 4)]})
    rows = runner.read_blocks(0, 0, [1])
    for tier in (0, 2):
        with pytest.raises(AllocatorError, match=r"2-d torch\.uint8 tensor"):
            runner.write_blocks(tier, 0, [2], rows.to(torch.int16))
    runner.write_blocks(2, 0, [2], rows)
    assert torch.equal(runner.read_blocks(2, 0, [2]), rows)
