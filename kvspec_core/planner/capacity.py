"""Sizing a plan's pools from its budgets: whether one max-length request fits, the largest
max_model_len that does, the :class:`CapacityError` naming both, and each pool's block count
(the split itself is :mod:`kvspec_core.planner.budget`)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvspec_core.byte_sizes import format_size
from kvspec_core.context import SizingContext
from kvspec_core.errors import CapacityError, PlanError
from kvspec_core.planner.budget import bytes_for_one_request, split_budget
from kvspec_core.planner.skeleton import Skeleton, blocks_per_request, fixed_blocks_per_pool


@attrs.frozen
class Residency:
    """The pools of one residency (device or host), their demands and block bytes."""

    host: bool
    pool_ids: list[int]
    demands: list[int]
    block_bytes: list[int]
    #: Of each demand, the blocks a request holds whatever its length.
    fixed: list[int]


def residencies(
    skeleton: Skeleton, per_pool: Sequence[int], fixed: Sequence[int] | None = None
) -> list[Residency]:
    """Device pools, then host pools; a residency without pools is left out."""
    fixed = [0] * len(per_pool) if fixed is None else fixed
    result = []
    for host in (False, True):
        ids = [i for i, pool in enumerate(skeleton.pools) if pool.host_resident == host]
        if ids:
            result.append(
                Residency(
                    host,
                    ids,
                    [per_pool[i] for i in ids],
                    [skeleton.pools[i].block_bytes for i in ids],
                    [fixed[i] for i in ids],
                )
            )
    return result


def fits(skeleton: Skeleton, ctx: SizingContext, budget: int, host_budget: int | None) -> bool:
    """Whether one request of ``ctx.max_model_len`` fits the budgets, null blocks included."""
    _, per_pool = blocks_per_request(skeleton, ctx)
    for residency in residencies(skeleton, per_pool):
        available = host_budget if residency.host else budget
        need = bytes_for_one_request(residency.demands, residency.block_bytes)
        if available is None or need > available:
            return False
    return True


def largest_fitting(
    skeleton: Skeleton, ctx: SizingContext, budget: int, host_budget: int | None, upper: int
) -> int:
    """The largest ``max_model_len`` up to ``upper`` that :func:`fits` (binary search), 0 if
    none does."""
    if not skeleton.pools or fits(
        skeleton, attrs.evolve(ctx, max_model_len=upper), budget, host_budget
    ):
        return upper
    low, high = 0, upper  # fits(low) (0 stands for "none"), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(skeleton, attrs.evolve(ctx, max_model_len=middle), budget, host_budget):
            low = middle
        else:
            high = middle
    return low


def capacity_error(
    skeleton: Skeleton,
    ctx: SizingContext,
    host: bool,
    need: int,
    available: int,
    budget: int,
    host_budget: int | None,
) -> CapacityError:
    """The error for a request needing ``need`` bytes of a budget of ``available``: both
    figures and the largest ``max_model_len`` that fits."""
    largest = (
        largest_fitting(skeleton, ctx, budget, host_budget, ctx.max_model_len - 1)
        if ctx.max_model_len > 1
        else 0
    )
    where = "host budget (host_budget_bytes)" if host else "KV-cache budget"
    fix = (
        (
            f"the largest max_model_len that fits is {largest}; lower max_model_len to it or "
            "raise the budget"
        )
        if largest
        else ("no max_model_len fits; raise the budget, use a smaller KV dtype or more parallelism")
    )
    return CapacityError(
        f"one request of max_model_len={ctx.max_model_len} tokens needs {need} bytes "
        f"({format_size(need)}, one null block per pool included), but the {where} is {available} "
        f"bytes ({format_size(available)}); {fix}"
    )


def check_host_budget_given(skeleton: Skeleton, host_budget: int | None) -> None:
    """Refuse to plan host-resident groups without ``host_budget_bytes``."""
    host_groups = [
        ",".join(d.layers[:2])
        for d, p in zip(skeleton.drafts, skeleton.pool_of_group, strict=True)
        if skeleton.pools[p].host_resident
    ]
    if host_groups and host_budget is None:
        raise PlanError(
            f"groups of layers {'; '.join(host_groups)} are host-resident, so their pool lives "
            "in host memory: pass host_budget_bytes (the HiSparse plugin exports a function "
            "that sizes it)"
        )


def blocks_per_pool(
    skeleton: Skeleton, ctx: SizingContext, budget: int, host_budget: int | None
) -> list[int]:
    """Each pool's block count (null block included): the device budget split between the
    device pools and the host budget between the host pools, so that the most max-length
    requests fit at once; :class:`CapacityError` when one does not."""
    check_host_budget_given(skeleton, host_budget)
    _, per_pool = blocks_per_request(skeleton, ctx)
    fixed = fixed_blocks_per_pool(skeleton, ctx)
    blocks = [0] * len(skeleton.pools)
    for residency in residencies(skeleton, per_pool, fixed):
        available = host_budget if residency.host else budget
        assert available is not None  # check_host_budget_given refused a missing host budget
        split = split_budget(
            residency.demands, residency.block_bytes, available, fixed=residency.fixed
        )
        if split is None:
            need = bytes_for_one_request(residency.demands, residency.block_bytes)
            raise capacity_error(
                skeleton, ctx, residency.host, need, available, budget, host_budget
            )
        for i, count in zip(residency.pool_ids, split, strict=True):
            blocks[i] = count
    return blocks
