"""Splitting a byte budget between pools so that concurrency is as high as it can be.

Pool ``p`` has blocks of ``B_p`` bytes and a demand of ``d_p`` blocks per max-length request,
``f_p`` of them *fixed*: blocks a request holds whatever its length (a Mamba state, a
cross-attention cache of the encoder's tokens); the other ``d_p - f_p`` grow with its
length. Concurrency ``C = n + x`` (``n`` whole, ``0 <= x < 1``) means ``n`` max-length
requests and one of ``x`` times that length: its fixed blocks are all there, so the pool
needs ``ceil(C * (d_p - f_p)) + ceil(C) * f_p + 1`` blocks (one null block). Sized at
``ceil(C * d_p)`` instead, a state pool would hold the fraction of a request's states, which
no request can use, and the attention pools' room for it would idle.

The split takes the largest ``C`` whose blocks fit the budget (closed form, then down the
breakpoints), then hands the leftover bytes out, first in proportion to demand, then to the
pool that limits concurrency, until no further block fits. With one pool this is
``budget // B`` blocks, exactly vLLM's count.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from math import ceil, floor


def bytes_for_one_request(demands: Sequence[int], block_bytes: Sequence[int]) -> int:
    """Bytes one max-length request needs, one null block per pool included."""
    return sum((demand + 1) * size for demand, size in zip(demands, block_bytes, strict=True))


def blocks_for(concurrency: Fraction, demand: int, fixed: int) -> int:
    """Blocks (null block included) a pool of ``demand`` blocks per max-length request,
    ``fixed`` of them whatever the length, needs at ``concurrency``."""
    return ceil(concurrency * (demand - fixed)) + ceil(concurrency) * fixed + 1


def pool_concurrency(blocks: int, demand: int, fixed: int) -> Fraction:
    """The highest concurrency ``blocks`` (null block included) hold: the inverse of
    :func:`blocks_for`."""
    usable = blocks - 1
    growing = demand - fixed
    if not growing:
        return Fraction(usable // demand)
    if not fixed:
        return Fraction(usable, growing)
    # With k requests begun (k = ceil(C)), C <= k and C * growing <= usable - k * fixed.
    best = Fraction(0)
    for whole in range(usable // demand, usable // fixed + 1):
        reach = min(Fraction(whole + 1), Fraction(usable - (whole + 1) * fixed, growing))
        if reach > whole:
            best = max(best, reach)
        else:
            best = max(best, Fraction(whole))
            break
    return best


def _blocks_at(concurrency: Fraction, demands: Sequence[int], fixed: Sequence[int]) -> list[int]:
    return [blocks_for(concurrency, d, f) for d, f in zip(demands, fixed, strict=True)]


def _cost(blocks: Sequence[int], block_bytes: Sequence[int]) -> int:
    return sum(count * size for count, size in zip(blocks, block_bytes, strict=True))


def split_budget(
    demands: Sequence[int],
    block_bytes: Sequence[int],
    budget: int,
    *,
    require_one_request: bool = True,
    fixed: Sequence[int] | None = None,
) -> list[int] | None:
    """Blocks per pool (null block included), or ``None`` when one request does not fit.

    ``fixed``: of each pool's demand, the blocks a request holds whatever its length (see
    the module docstring; None: none). Without ``require_one_request`` (an offload tier,
    which caches prefixes of any length) a budget below one request is split the same way,
    at a concurrency below one: ``None`` only when it cannot hold every pool's null block
    (a pool may then keep only that)."""
    if not demands:
        return []
    fixed = [0] * len(demands) if fixed is None else list(fixed)
    floor_bytes = (
        bytes_for_one_request(demands, block_bytes) if require_one_request else sum(block_bytes)
    )
    if floor_bytes > budget:
        return None
    concurrency = _largest_concurrency(demands, fixed, block_bytes, budget)
    blocks = _blocks_at(concurrency, demands, fixed)
    leftover = budget - _cost(blocks, block_bytes)
    # The leftover raises the growing parts (a fixed part gains nothing below a request).
    growing_weight = sum(
        (d - f) * size for d, f, size in zip(demands, fixed, block_bytes, strict=True)
    )
    if growing_weight:
        share = Fraction(leftover, growing_weight)
        for index, (demand, pool_fixed) in enumerate(zip(demands, fixed, strict=True)):
            blocks[index] += floor(share * (demand - pool_fixed))
    leftover = budget - _cost(blocks, block_bytes)
    return _fill_leftover(blocks, demands, fixed, block_bytes, leftover)


def _largest_concurrency(
    demands: Sequence[int], fixed: Sequence[int], block_bytes: Sequence[int], budget: int
) -> Fraction:
    """The largest concurrency whose blocks fit ``budget``: for each count ``k`` of requests
    begun (``ceil(C)``), from the bound every pool's ``C * d_p + 1`` blocks give down, the
    fixed parts' cost is known and the growing parts take the rest (closed form, then down
    their breakpoints, one pool's block at a time: a few steps)."""
    weighted = sum(demand * size for demand, size in zip(demands, block_bytes, strict=True))
    growing = [demand - part for demand, part in zip(demands, fixed, strict=True)]
    growing_weight = sum(g * size for g, size in zip(growing, block_bytes, strict=True))
    bound = Fraction(budget - sum(block_bytes), weighted)
    begun = ceil(bound) if any(fixed) else None
    while True:
        # Bytes left for the growing parts once the null blocks (and, with k requests
        # begun, their fixed blocks) are paid.
        paid = sum(block_bytes) + (begun or 0) * sum(
            part * size for part, size in zip(fixed, block_bytes, strict=True)
        )
        room = budget - paid
        if room >= 0:
            level = bound if begun is None else Fraction(begun)
            if growing_weight:
                level = min(level, Fraction(room, growing_weight))
            while _cost([ceil(level * g) for g in growing], block_bytes) > room:
                # The highest breakpoint below: there one growing part drops a block.
                level = max(Fraction(ceil(level * g) - 1, g) for g in growing if g)
            if begun is None or level > begun - 1 or begun == 0:
                return level
        assert begun is not None  # without fixed parts the first room is >= 0
        begun -= 1


def _fill_leftover(
    blocks: list[int],
    demands: Sequence[int],
    fixed: Sequence[int],
    block_bytes: Sequence[int],
    leftover: int,
) -> list[int]:
    """Give the pool with the lowest concurrency the blocks to catch up with the next one
    (or to its next breakpoint), while they fit."""
    while True:
        levels = [pool_concurrency(*pool) for pool in zip(blocks, demands, fixed, strict=True)]
        ranked = sorted(range(len(blocks)), key=lambda i: levels[i])
        granted = False
        for lowest in ranked:
            demand, pool_fixed = demands[lowest], fixed[lowest]
            # Blocks to this pool's next breakpoint: one more request's growing block, or
            # a whole request's fixed ones.
            step = blocks_for(_next_level(levels[lowest], demand, pool_fixed), demand, pool_fixed)
            wanted = step - blocks[lowest]
            if len(ranked) > 1 and lowest == ranked[0]:
                target = levels[ranked[1]]
                if target > levels[lowest]:
                    wanted = max(wanted, blocks_for(target, demand, pool_fixed) - blocks[lowest])
            cost = wanted * block_bytes[lowest]
            if cost > leftover:
                wanted = leftover // block_bytes[lowest]
                if step > blocks[lowest] + wanted:
                    continue  # cannot reach its next level: its blocks would idle
            if wanted <= 0:
                continue
            blocks[lowest] += wanted
            leftover -= wanted * block_bytes[lowest]
            granted = True
            break
        if not granted:
            return blocks


def _next_level(level: Fraction, demand: int, fixed: int) -> Fraction:
    """The lowest concurrency above ``level`` that needs more blocks than ``level``."""
    growing = demand - fixed
    candidates = []
    if growing:
        candidates.append(Fraction(floor(level * growing) + 1, growing))
    if fixed:
        candidates.append(Fraction(floor(level) + 1))
    return min(candidates)


def concurrency_of(
    blocks: Sequence[int], demands: Sequence[int], fixed: Sequence[int] | None = None
) -> float:
    """Max-length requests admitted at once: the minimum over pools (``fixed`` as in
    :func:`split_budget`)."""
    if not blocks:
        return 0.0
    fixed = [0] * len(demands) if fixed is None else fixed
    return float(min(pool_concurrency(*pool) for pool in zip(blocks, demands, fixed, strict=True)))
