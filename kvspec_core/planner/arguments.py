"""Checking what callers pass the planner's entry points, before anything is planned: the
budgets, context, manager and layout every entry point takes, the ``upper`` bound of
``largest_fitting_max_model_len`` and the block counts ``rebuild_with_blocks`` gives a plan.
Each refusal names the entry point or pool and the field."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvspec_core.context import SizingContext
from kvspec_core.errors import CapacityError, InvalidFieldError, InvalidFieldTypeError, PlanError
from kvspec_core.planner.layouts import KVCacheLayout, get_layout
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.validation import MAX_FIELD_VALUE

#: Largest budget accepted (bytes): far above any machine, far below overflow of int64 views.
MAX_BUDGET_BYTES = 1 << 60


def _check_budget(value: object, owner: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldTypeError(owner, name, value, "expected an int of bytes")
    if not 0 <= value <= MAX_BUDGET_BYTES:
        raise InvalidFieldError(
            owner, name, value, f"must be an int of bytes in [0, {MAX_BUDGET_BYTES}]"
        )
    return value


@attrs.frozen
class PlannerArguments:
    """The arguments every planner entry point shares, checked."""

    budget: int
    host_budget: int | None
    ctx: SizingContext
    layout: KVCacheLayout


def check_arguments(
    owner: str,
    budget_bytes: object,
    host_budget_bytes: object,
    ctx: object,
    manager: object,
    layout: str,
) -> PlannerArguments:
    """The arguments every planner entry point shares, refused naming ``owner`` and field."""
    budget = _check_budget(budget_bytes, owner, "budget_bytes")
    host_budget = (
        None
        if host_budget_bytes is None
        else _check_budget(host_budget_bytes, owner, "host_budget_bytes")
    )
    if not isinstance(ctx, SizingContext):
        raise InvalidFieldTypeError(owner, "ctx", ctx, "expected a SizingContext")
    if not isinstance(manager, PluginManager):
        raise InvalidFieldTypeError(
            owner, "manager", manager, "expected a PluginManager (kvspec_core.load_plugins())"
        )
    return PlannerArguments(budget, host_budget, ctx, get_layout(layout))


def check_upper(upper: object) -> int:
    """``largest_fitting_max_model_len``'s ``upper``: an int of tokens in range."""
    if isinstance(upper, bool) or not isinstance(upper, int):
        raise InvalidFieldTypeError(
            "largest_fitting_max_model_len", "upper", upper, "expected an int of tokens"
        )
    if not 1 <= upper <= MAX_FIELD_VALUE:
        raise InvalidFieldError(
            "largest_fitting_max_model_len",
            "upper",
            upper,
            f"must be an int in [1, {MAX_FIELD_VALUE}]",
        )
    return upper


def check_block_counts(
    plan: KVCachePlan, blocks: Sequence[int], budget: int, host_budget: int | None
) -> None:
    """Refuse ``blocks`` for ``plan``'s pools unless one int per pool, each at least one
    request's worth, and the device and host pools they make fit their budgets."""
    if len(blocks) != len(plan.pools):
        raise PlanError(
            f"the plan has {len(plan.pools)} pools but got {len(blocks)} block "
            "counts; pass one count per pool"
        )
    for pool, count in zip(plan.pools, blocks, strict=True):
        if isinstance(count, bool) or not isinstance(count, int):
            raise PlanError(f"block count of pool {pool.id} is {count!r}; expected an int")
        if count < pool.blocks_per_request + 1:
            raise CapacityError(
                f"pool {pool.id} would get {count} blocks, fewer than one request's "
                f"{pool.blocks_per_request} plus the null block"
            )
    for host, available in ((False, budget), (True, host_budget)):
        used = sum(
            count * pool.block_bytes
            for pool, count in zip(plan.pools, blocks, strict=True)
            if pool.host_resident == host
        )
        if used and (available is None or used > available):
            raise CapacityError(
                f"{'host' if host else 'device'} pools would take {used} bytes, more than "
                f"the budget of {available} bytes"
            )
