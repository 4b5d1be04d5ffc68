"""The engine with offload tiers: a real model's prefix blocks go from a small device pool to
host memory (and on to a disk file) and come back for a later request.

Set-up: a device pool of 9 usable blocks of 16 tokens. Request A (48 shared tokens + 9)
caches its blocks; two (or, to reach the disk, four) requests of unrelated prompts then
evict them from the device (write-back to the host tier; a small host tier demotes them to
disk). Request B (the 48 + 10) finds its 48-token prefix in a tier only: the engine loads it
back before B's forward. B's greedy tokens must equal transformers' own ``generate``; noise
written into the tier copies of exactly the blocks B loads must change them; a load that
fails must leave no hit and the same tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers_testkit import (
    NEW_TOKENS,
    PROMPT_A,
    PROMPT_B,
    SHARED_PREFIX,
    forward_lengths,
    model_case,
    token_ids,
)

from kvspec_core.errors import InvalidFieldError
from kvspec_core.runtime import Request
from kvspec_core.runtime.tier_copy import TransferRunner
from kvspec_core.runtime.tiers import LOAD, STORE, TieredPrefix, Transfer
from kvspec_transformers import EngineError, TransformersEngine

#: Bytes of one block (16 tokens, every layer) of the shrunk models' pool.
BLOCK_BYTES = {"llama": 8192, "gemma2": 16384}
#: Device blocks (the null block included): about one request of max_model_len (Gemma 2's
#: sliding and full groups share its pool), so A's blocks do not outlive a few others.
DEVICE_BLOCKS = {"llama": 10, "gemma2": 15}
#: A roomy host tier, and a small one that demotes A's blocks to disk. Not smaller: the
#: runtime drops a store when every host slot is held by a copy still in flight, and one
#: Gemma 2 step evicts more blocks than 4 slots (A's prefix then is lost, not demoted).
LARGE_HOST_BLOCKS = 40
SMALL_HOST_BLOCKS = {"llama": 5, "gemma2": 8}
DISK_BLOCKS = 40


def tiered_engine(name: str, host_blocks: int, disk_dir: Path | None = None) -> TransformersEngine:
    case = model_case(name)
    block = BLOCK_BYTES[name]
    engine = TransformersEngine(
        case.model,
        kvspec_config=case.config,
        max_model_len=96,
        budget_bytes=DEVICE_BLOCKS[name] * block,
        host_offload_bytes=host_blocks * block,
        disk_offload_bytes=None if disk_dir is None else DISK_BLOCKS * block,
        disk_path=None if disk_dir is None else str(disk_dir),
    )
    assert [pool.num_blocks for pool in engine.plan.pools] == [DEVICE_BLOCKS[name]]
    assert engine.plan.tier("host").blocks_per_pool == (host_blocks,)
    return engine


def evict_prefix_of_a(engine: TransformersEngine, fillers: int) -> TieredPrefix:
    """Run A, then ``fillers`` unrelated requests; the prefix B would find afterwards."""
    first = engine.generate(PROMPT_A, NEW_TOKENS, request_id="A")
    assert first.cached_tokens == 0
    for seed in range(fillers):
        engine.generate(token_ids(57, seed=100 + seed), NEW_TOKENS)
    hit = engine.allocator.find_cached_prefix(Request("probe", list(PROMPT_B)))
    assert isinstance(hit, TieredPrefix)
    assert hit.num_tokens == SHARED_PREFIX
    engine.allocator.check_invariants()
    return hit


def loaded_slots(hit: TieredPrefix, tier: int) -> list[tuple[int, int]]:
    """``(group, slot)`` of every block B loads from ``tier``."""
    return [
        (group, slot)
        for group, loads in enumerate(hit.loads)
        for _, from_tier, slot in loads
        if from_tier == tier
    ]


# --------------------------------------------------------------------------- loaded back
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_a_prefix_evicted_to_host_is_loaded_back_and_the_output_holds(name: str) -> None:
    engine = tiered_engine(name, LARGE_HOST_BLOCKS)
    hit = evict_prefix_of_a(engine, fillers=3)
    assert hit.tokens_by_tier == (0, SHARED_PREFIX)  # nothing left on the device
    stored = engine.transfers.completed
    assert stored > 0 and engine.transfers.failed == 0
    with forward_lengths(engine.model) as forwards:
        result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens_by_tier == {"device": 0, "host": SHARED_PREFIX}
    assert result.cached_tokens == SHARED_PREFIX
    assert forwards == [10] + [1] * (NEW_TOKENS - 1)  # the 48 tokens were not recomputed
    assert result.token_ids == model_case(name).reference["b"]
    assert engine.transfers.completed > stored and engine.transfers.failed == 0
    engine.allocator.check_invariants()


def test_a_prefix_partly_on_the_device_partly_on_the_host() -> None:
    """After two fillers the device still holds A's first block: 16 tokens come from the
    device, 32 are loaded from the host, and the output holds."""
    engine = tiered_engine("llama", LARGE_HOST_BLOCKS)
    hit = evict_prefix_of_a(engine, fillers=2)
    assert hit.block_ids[0][0] != 0 and [index for index, _, _ in hit.loads[0]] == [1, 2]
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens_by_tier == {"device": 16, "host": 32}
    assert result.token_ids == model_case("llama").reference["b"]
    engine.allocator.check_invariants()


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_a_prefix_demoted_to_disk_is_loaded_back_and_the_output_holds(
    name: str, tmp_path: Path
) -> None:
    engine = tiered_engine(name, SMALL_HOST_BLOCKS[name], tmp_path)
    assert engine.plan.tier("disk").blocks_per_pool == (DISK_BLOCKS,)
    hit = evict_prefix_of_a(engine, fillers=4)
    assert hit.tokens_by_tier == (0, 0, SHARED_PREFIX)
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": SHARED_PREFIX}
    assert result.token_ids == model_case(name).reference["b"]
    engine.allocator.check_invariants()
    # the pool's file is where the disk tier's blocks are; close() removes it
    files = list(engine.buffers.tiers["disk"].files.values())
    assert [os.path.dirname(path) for path in files] == [str(tmp_path)]
    engine.close()
    assert not any(os.path.exists(path) for path in files)


def test_without_tiers_the_evicted_prefix_is_recomputed() -> None:
    """The control: the same requests on the same device pool without a tier get no hit."""
    case = model_case("llama")
    engine = TransformersEngine(
        case.model,
        kvspec_config=case.config,
        max_model_len=96,
        budget_bytes=DEVICE_BLOCKS["llama"] * BLOCK_BYTES["llama"],
    )
    engine.generate(PROMPT_A, NEW_TOKENS)
    for seed in range(3):
        engine.generate(token_ids(57, seed=100 + seed), NEW_TOKENS)
    result = engine.generate(PROMPT_B, NEW_TOKENS)
    assert result.cached_tokens_by_tier == {"device": 0}
    assert result.token_ids == case.reference["b"]


# --------------------------------------------------------------------------- really used
def noise_like(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * 10


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_corrupting_the_host_copy_changes_the_output(name: str) -> None:
    engine = tiered_engine(name, LARGE_HOST_BLOCKS)
    hit = evict_prefix_of_a(engine, fillers=3)
    slots = loaded_slots(hit, tier=1)
    assert slots
    host = engine.buffers.tiers["host"]
    for group, slot in slots:
        for layer in engine.plan.groups[group].layers:
            view = host.views[layer]
            view[slot] = noise_like(view[slot], seed=slot)
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens_by_tier["host"] == SHARED_PREFIX
    assert result.token_ids != model_case(name).reference["b"]


def test_corrupting_the_disk_file_changes_the_output(tmp_path: Path) -> None:
    """Random bytes written into the pool's file (plain pwrite, not through the tensors),
    at the byte ranges of exactly the blocks B loads from disk."""
    engine = tiered_engine("llama", SMALL_HOST_BLOCKS["llama"], tmp_path)
    hit = evict_prefix_of_a(engine, fillers=4)
    slots = loaded_slots(hit, tier=2)
    assert slots
    disk = engine.buffers.tiers["disk"]
    generator = torch.Generator().manual_seed(7)
    for group, slot in slots:
        pool = engine.plan.groups[group].pool
        fd = os.open(disk.files[pool], os.O_WRONLY)
        try:
            for offset, length in disk.block_byte_ranges(pool, slot):
                noise = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=generator)
                assert os.pwrite(fd, noise.numpy().tobytes(), offset) == length
        finally:
            os.close(fd)
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens_by_tier["disk"] == SHARED_PREFIX
    assert result.token_ids != model_case("llama").reference["b"]


# --------------------------------------------------------------------------- failures
class FailingRunner(TransferRunner):
    """Transfers of ``kind`` fail like a torn read: the destination gets garbage, then the
    copy raises ``OSError`` (the runner fails that transfer only)."""

    def __init__(self, storage: Any, kind: str) -> None:
        super().__init__(storage)
        self.kind = kind
        self.failures = 0

    def copy(self, transfer: Transfer) -> None:
        if transfer.kind != self.kind:
            super().copy(transfer)
            return
        self.failures += 1
        ids = torch.tensor(transfer.destination_blocks, dtype=torch.long)
        for tensor in self._at(transfer.destination_tier, transfer.pool):
            tensor.index_copy_(0, ids, noise_like(tensor.index_select(0, ids), seed=3))
        raise OSError("injected: the tier's read failed")


def test_a_failed_load_leaves_no_hit_and_the_output_holds() -> None:
    engine = tiered_engine("llama", LARGE_HOST_BLOCKS)
    evict_prefix_of_a(engine, fillers=3)
    runner = FailingRunner(engine.transfers.runner.storage, LOAD)
    engine.transfers.runner = runner
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert runner.failures >= 1 and engine.transfers.failed == runner.failures
    # re-admitted: the failed copy left its tier, so B computed its whole prompt
    assert result.cached_tokens_by_tier == {"device": 0, "host": 0}
    assert result.prefill_tokens == len(PROMPT_B)
    assert result.token_ids == model_case("llama").reference["b"]
    engine.allocator.check_invariants()
    assert engine.allocator.num_running == 0
    # B's own blocks, computed, are now the prefix's: a real hit, on the device
    engine.transfers.runner = TransferRunner(runner.storage)
    again = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B2")
    assert again.cached_tokens_by_tier == {"device": SHARED_PREFIX, "host": 0}
    assert again.token_ids == model_case("llama").reference["b"]


def test_a_failed_load_keeps_the_device_part_of_the_hit() -> None:
    """The hit is 16 device + 32 host tokens; the host load fails: re-admitted, B resumes
    from the 16 device tokens only and computes the rest, with transformers' tokens."""
    engine = tiered_engine("llama", LARGE_HOST_BLOCKS)
    hit = evict_prefix_of_a(engine, fillers=2)
    assert hit.tokens_by_tier == (16, 32)
    runner = FailingRunner(engine.transfers.runner.storage, LOAD)
    engine.transfers.runner = runner
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert runner.failures == 1
    assert result.cached_tokens_by_tier == {"device": 16, "host": 0}
    assert result.prefill_tokens == len(PROMPT_B) - 16
    assert result.token_ids == model_case("llama").reference["b"]
    engine.allocator.check_invariants()


def test_failed_stores_lose_the_prefix_not_the_output() -> None:
    engine = tiered_engine("llama", LARGE_HOST_BLOCKS)
    runner = FailingRunner(engine.transfers.runner.storage, STORE)
    engine.transfers.runner = runner
    engine.generate(PROMPT_A, NEW_TOKENS, request_id="A")
    for seed in range(3):
        engine.generate(token_ids(57, seed=100 + seed), NEW_TOKENS)
    assert runner.failures >= 1
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens == 0
    assert result.token_ids == model_case("llama").reference["b"]
    engine.allocator.check_invariants()


def test_an_interrupted_transfer_leaves_nothing_pending() -> None:
    """KeyboardInterrupt while loading: every transfer taken is failed, the request freed;
    the engine then answers B correctly."""
    engine = tiered_engine("llama", LARGE_HOST_BLOCKS)
    evict_prefix_of_a(engine, fillers=3)
    storage = engine.transfers.runner.storage

    class Interrupted(TransferRunner):
        def copy(self, transfer: Transfer) -> None:
            raise KeyboardInterrupt

    engine.transfers.runner = Interrupted(storage)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert engine.allocator.num_running == 0
    engine.allocator.check_invariants()
    engine.transfers.runner = TransferRunner(storage)
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.token_ids == model_case("llama").reference["b"]


# --------------------------------------------------------------------------- bad arguments
def test_tiers_without_prefix_caching_are_refused() -> None:
    case = model_case("llama")
    with pytest.raises(EngineError, match="enable_prefix_caching=False"):
        TransformersEngine(
            case.model,
            kvspec_config=case.config,
            enable_prefix_caching=False,
            host_offload_bytes=1 << 20,
        )


def test_a_disk_tier_needs_its_size_and_directory(tmp_path: Path) -> None:
    case = model_case("llama")
    with pytest.raises(InvalidFieldError, match="disk_offload_bytes"):
        TransformersEngine(case.model, kvspec_config=case.config, disk_path=str(tmp_path))
    with pytest.raises(InvalidFieldError, match="disk_path"):
        TransformersEngine(case.model, kvspec_config=case.config, disk_offload_bytes=1 << 20)


def test_a_refused_engine_leaves_no_disk_files_behind(tmp_path: Path) -> None:
    """A check that refuses the model after the disk tier's files were made (here: the
    remote tier of a model with chunked local attention) removes them, so the directory
    serves the next engine (before, the next one was refused: the files existed)."""
    from transformers_testkit import INITIALIZER_RANGE

    from kvspec_core.models.catalog import load_preset
    from kvspec_core.runtime.remote_store import RemoteStoreConfig
    from kvspec_transformers import RemoteOptions, build_model, shrink_config

    config = {**shrink_config(load_preset("llama-4-scout")), "initializer_range": INITIALIZER_RANGE}
    model = build_model(config, seed=0)
    options = dict(
        kvspec_config=config,
        max_model_len=64,
        budget_bytes=1 << 20,
        host_offload_bytes=1 << 19,
        disk_offload_bytes=1 << 20,
        disk_path=str(tmp_path),
    )
    remote = RemoteOptions(store=RemoteStoreConfig(port=1), weights_id="w", hash_salt=b"s")
    with pytest.raises(EngineError, match="remote tier refused"):
        TransformersEngine(model, remote=remote, **options)
    assert os.listdir(tmp_path) == []
    engine = TransformersEngine(model, **options)
    assert os.listdir(tmp_path)
    engine.close()
    assert os.listdir(tmp_path) == []


def test_an_engine_dropped_without_close_removes_its_disk_files(tmp_path: Path) -> None:
    """Found in review: an engine garbage-collected without close() left its disk tier's
    files, and the next engine on the directory was refused. Collection now removes them."""
    import gc

    case = model_case("llama")
    options: dict[str, Any] = dict(
        kvspec_config=case.config,
        max_model_len=96,
        host_offload_bytes=1 << 20,
        disk_offload_bytes=1 << 20,
        disk_path=str(tmp_path),
    )
    engine = TransformersEngine(case.model, **options)
    engine.generate(PROMPT_A, 2)
    assert os.listdir(tmp_path)
    del engine
    gc.collect()
    assert os.listdir(tmp_path) == []
    # The directory serves the next engine; leaving a ``with`` block releases it too.
    with TransformersEngine(case.model, **options) as engine:
        assert engine.generate(PROMPT_B, NEW_TOKENS).token_ids == model_case("llama").reference["b"]
        assert os.listdir(tmp_path)
    assert os.listdir(tmp_path) == []
    engine.close()  # idempotent
