"""Sizing the offload tiers of a plan: host DRAM and a local disk beside the device pools.

Each tier's budget is split between the device pools by the device split itself
(:func:`~kvspec_core.planner.budget.split_budget`, demand-weighted), so a pool's tier blocks
hold tokens in the same proportion as its device blocks. Host-resident pools (HiSparse's,
sized from ``host_budget_bytes``) already live on the host and get no tier blocks; the host
tier's budget is separate from ``host_budget_bytes``, so the host memory a plan takes is
``host_bytes_allocated`` plus the host tier's ``bytes_allocated``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import attrs

from kvspec_core.byte_sizes import format_size
from kvspec_core.errors import ConfigError, InvalidFieldError, InvalidFieldTypeError
from kvspec_core.planner.budget import split_budget
from kvspec_core.planner.plan_parts import PlannedTier, Pool

#: Largest tier budget accepted (bytes): far above any machine, far below int64 overflow.
MAX_TIER_BYTES = 1 << 60


class OffloadTierError(ConfigError):
    """A tier budget too small to hold one block of some pool beside its null block.

    ``tier`` is the tier's name, ``budget`` its bytes and ``needed`` the least budget that
    holds one usable block of every device pool (callers name their own option)."""

    def __init__(self, message: str, *, tier: str, budget: int, needed: int) -> None:
        super().__init__(message)
        self.tier = tier
        self.budget = budget
        self.needed = needed


@attrs.frozen
class TierRequest:
    """The tiers a caller asks for, checked: budgets in bytes (``None``: no such tier)."""

    host_bytes: int | None = None
    disk_bytes: int | None = None
    disk_path: str | None = None


def _check_bytes(owner: str, name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldTypeError(owner, name, value, "expected an int of bytes or None")
    if not 1 <= value <= MAX_TIER_BYTES:
        raise InvalidFieldError(
            owner,
            name,
            value,
            f"must be an int of bytes in [1, {MAX_TIER_BYTES}]; pass None for no such tier",
        )
    return value


def check_disk_directory(owner: str, name: str, path: str) -> None:
    """Refuse ``path`` unless it is an existing directory this process may create files in."""
    if not os.path.isdir(path):
        raise InvalidFieldError(
            owner,
            name,
            path,
            "must be an existing directory for the disk tier's files; create it first",
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidFieldError(
            owner,
            name,
            path,
            "must be a directory this process can write to; fix its permissions or choose another",
        )


def check_tier_request(
    owner: str,
    host_offload_bytes: object,
    disk_offload_bytes: object,
    disk_path: object,
    *,
    check_directory: bool = True,
) -> TierRequest:
    """The tier arguments of ``owner``, refused naming the argument and the fix. The disk
    tier needs both its budget and its directory (made absolute, so a plan read elsewhere
    names the same place); ``check_directory`` also requires that directory to exist and
    be writable (not when a written plan is read back on another machine)."""
    host = _check_bytes(owner, "host_offload_bytes", host_offload_bytes)
    disk = _check_bytes(owner, "disk_offload_bytes", disk_offload_bytes)
    if disk_path is not None and (not isinstance(disk_path, str) or not disk_path):
        raise InvalidFieldTypeError(
            owner, "disk_path", disk_path, "expected the disk tier's directory as a str"
        )
    if disk is not None and disk_path is None:
        raise InvalidFieldError(
            owner, "disk_path", None, "is needed with disk_offload_bytes: the disk tier's directory"
        )
    if disk_path is not None and disk is None:
        raise InvalidFieldError(
            owner,
            "disk_offload_bytes",
            None,
            "is needed with disk_path: the bytes the disk tier may use",
        )
    if disk_path is not None:
        assert isinstance(disk_path, str)  # checked above; narrows for the type checker
        if check_directory:
            check_disk_directory(owner, "disk_path", disk_path)
        disk_path = os.path.abspath(disk_path)
    return TierRequest(host, disk, disk_path)


def request_of(tiers: Sequence[PlannedTier]) -> TierRequest:
    """The request a plan's ``tiers`` were sized from."""
    by_name = {tier.name: tier for tier in tiers}
    host, disk = by_name.get("host"), by_name.get("disk")
    return TierRequest(
        None if host is None else host.budget_bytes,
        None if disk is None else disk.budget_bytes,
        None if disk is None else disk.path,
    )


def size_tiers(pools: Sequence[Pool], request: TierRequest) -> tuple[PlannedTier, ...]:
    """The tiers ``request`` asks for over ``pools``: host, then disk."""
    wanted = (
        ("host", request.host_bytes, None, "host_offload_bytes"),
        ("disk", request.disk_bytes, request.disk_path, "disk_offload_bytes"),
    )
    return tuple(
        _size_tier(pools, name, budget, path, argument)
        for name, budget, path, argument in wanted
        if budget is not None
    )


def _size_tier(
    pools: Sequence[Pool], name: str, budget: int, path: str | None, argument: str
) -> PlannedTier:
    offloaded = [pool for pool in pools if not pool.host_resident]
    block_bytes = [pool.block_bytes for pool in offloaded]
    split = split_budget(
        [pool.blocks_per_request for pool in offloaded],
        block_bytes,
        budget,
        require_one_request=False,
    )
    # One usable block beside the null block of each pool; with less some pool could
    # offload nothing, and a hybrid prefix needs every pool's blocks to be a hit.
    needed = 2 * sum(block_bytes)
    if split is None or any(count < 2 for count in split):
        counts_or_none = split or [0] * len(offloaded)
        short = [
            pool.id for pool, count in zip(offloaded, counts_or_none, strict=True) if count < 2
        ]
        raise OffloadTierError(
            f"the {name} offload tier ({argument}) of {budget} bytes ({format_size(budget)}) "
            f"cannot hold one block beside the null block of pool {short[0]} (every device "
            f"pool needs two blocks in the tier: {needed} bytes, {format_size(needed)}, in "
            f"all); raise it to at least {needed} bytes or leave the tier out",
            tier=name,
            budget=budget,
            needed=needed,
        )
    counts = dict(zip((pool.id for pool in offloaded), split, strict=True))
    blocks = tuple(counts.get(pool.id, 0) for pool in pools)
    return PlannedTier(
        name=name,
        budget_bytes=budget,
        path=path,
        blocks_per_pool=blocks,
        bytes_allocated=sum(
            count * pool.block_bytes for count, pool in zip(blocks, pools, strict=True)
        ),
    )
