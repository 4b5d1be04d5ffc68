"""Host memory of an empty block pool, measured with tracemalloc.

    python benchmarks/pool_memory.py [--blocks 1000000] [--json]

Builds a one-group :class:`kvspec_core.runtime.KVCacheAllocator` over ``--blocks`` blocks and
reports the bytes tracemalloc attributes to it (ref counts, free stack, hash slots, group
ids, reuse flags, per-group maps), per block.
"""

from __future__ import annotations

import argparse
import gc
import json
import tracemalloc

import torch

from kvspec_core import FullAttentionSpec, PluginManager, SizingContext
from kvspec_core.runtime import KVCacheAllocator


def measure(num_blocks: int) -> dict[str, float | int]:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    ctx = SizingContext(max_model_len=8192)
    manager = PluginManager()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    allocator = KVCacheAllocator([spec], num_blocks, ctx, manager=manager)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    total = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert allocator.usage.free_blocks == num_blocks - 1
    return {
        "blocks": num_blocks,
        "host_bytes": total,
        "host_bytes_per_block": total / num_blocks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    figures = measure(args.blocks)
    if args.json:
        print(json.dumps(figures))
    else:
        print(
            f"empty pool of {figures['blocks']:,} blocks: {figures['host_bytes']:,} bytes = "
            f"{figures['host_bytes_per_block']:.1f} bytes per block"
        )


if __name__ == "__main__":
    main()
