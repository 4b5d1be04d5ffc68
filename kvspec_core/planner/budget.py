"""Splitting a byte budget between pools so that concurrency is as high as it can be.

Pool ``p`` has blocks of ``B_p`` bytes and a demand of ``d_p`` blocks per max-length request.
With concurrency ``C`` it needs ``ceil(C * d_p) + 1`` blocks (one null block). The split takes
the largest ``C`` with ``sum_p (ceil(C * d_p) + 1) * B_p <= budget`` (closed form, then an
integer fix-up), then hands the leftover bytes out, first in proportion to demand, then one
block at a time to the pool that limits concurrency, until no further block fits. With one
pool this is ``budget // B`` blocks, exactly vLLM's count.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from math import ceil, floor


def bytes_for_one_request(demands: Sequence[int], block_bytes: Sequence[int]) -> int:
    """Bytes one max-length request needs, one null block per pool included."""
    return sum((demand + 1) * size for demand, size in zip(demands, block_bytes, strict=True))


def _blocks_at(concurrency: Fraction, demands: Sequence[int]) -> list[int]:
    return [ceil(concurrency * demand) + 1 for demand in demands]


def _cost(blocks: Sequence[int], block_bytes: Sequence[int]) -> int:
    return sum(count * size for count, size in zip(blocks, block_bytes, strict=True))


def split_budget(
    demands: Sequence[int],
    block_bytes: Sequence[int],
    budget: int,
    *,
    require_one_request: bool = True,
) -> list[int] | None:
    """Blocks per pool (null block included), or ``None`` when one request does not fit.

    Without ``require_one_request`` (an offload tier, which caches prefixes of any length)
    a budget below one request is split the same way, at a concurrency below one: ``None``
    only when it cannot hold every pool's null block (a pool may then keep only that)."""
    if not demands:
        return []
    floor_bytes = (
        bytes_for_one_request(demands, block_bytes) if require_one_request else sum(block_bytes)
    )
    if floor_bytes > budget:
        return None
    weighted = sum(demand * size for demand, size in zip(demands, block_bytes, strict=True))
    concurrency = Fraction(budget - sum(block_bytes), weighted)
    blocks = _blocks_at(concurrency, demands)
    while _cost(blocks, block_bytes) > budget:
        # Step down to the highest breakpoint below: there one pool's ceil drops by one.
        concurrency = max(
            Fraction(count - 2, demand) for count, demand in zip(blocks, demands, strict=True)
        )
        blocks = _blocks_at(concurrency, demands)
    leftover = budget - _cost(blocks, block_bytes)
    share = Fraction(leftover, weighted)
    for index, demand in enumerate(demands):
        blocks[index] += floor(share * demand)
    leftover = budget - _cost(blocks, block_bytes)
    return _fill_leftover(blocks, demands, block_bytes, leftover)


def _fill_leftover(
    blocks: list[int], demands: Sequence[int], block_bytes: Sequence[int], leftover: int
) -> list[int]:
    """Give whole blocks to the pool with the lowest concurrency among those that fit."""
    while True:
        fitting = [i for i, size in enumerate(block_bytes) if size <= leftover]
        if not fitting:
            return blocks
        ranked = sorted(fitting, key=lambda i: Fraction(blocks[i] - 1, demands[i]))
        lowest = ranked[0]
        affordable = leftover // block_bytes[lowest]
        if len(ranked) > 1:
            # Give enough blocks to catch up with the next pool, at least one.
            target = Fraction(blocks[ranked[1]] - 1, demands[ranked[1]])
            wanted = ceil(target * demands[lowest]) + 1 - blocks[lowest]
            grant = min(affordable, max(1, wanted))
        else:
            grant = affordable
        blocks[lowest] += grant
        leftover -= grant * block_bytes[lowest]


def concurrency_of(blocks: Sequence[int], demands: Sequence[int]) -> float:
    """Max-length requests admitted at once: the minimum over pools."""
    if not blocks:
        return 0.0
    return float(
        min(Fraction(count - 1, demand) for count, demand in zip(blocks, demands, strict=True))
    )
