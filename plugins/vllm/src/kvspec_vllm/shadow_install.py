"""Attaching shadows (:mod:`kvspec_vllm.shadow`) to vLLM: :func:`shadow_manager` wraps one
``KVCacheManager``'s mirrored methods around a :class:`~kvspec_vllm.shadow_mirror.KVCacheShadow`
over the same groups and blocks (:func:`allocator_for`); :func:`install` makes vLLM's
scheduler wrap every manager it builds (an ``AsyncScheduler``'s excepted, with a warning).
"""

from __future__ import annotations

import contextvars
import logging
import os
from typing import Any

from kvspec_core.context import SizingContext
from kvspec_core.runtime import KVCacheAllocator
from kvspec_vllm.errors import NotRepresentable
from kvspec_vllm.shadow_differences import DifferenceClassifier
from kvspec_vllm.shadow_mirror import KVCacheShadow
from kvspec_vllm.specs import kvspec_spec_of, vllm_module

logger = logging.getLogger("vllm.kvspec.shadow")


def allocator_for(
    manager: Any, ctx: SizingContext, hash_block_size: int, hash_salt: bytes | None = None
) -> KVCacheAllocator:
    """kvspec's allocator over the same groups and blocks as vLLM's ``manager`` (one pool,
    the manager's hash block size and prefix-caching setting; ``hash_salt``: its hashes'
    salt, default the process's)."""
    interface = vllm_module("vllm.v1.kv_cache_interface")
    config = manager.kv_cache_config
    specs = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, interface.UniformTypeKVCacheSpecs):
            raise NotRepresentable(
                "shadow mode mirrors groups of one spec, not uniform-type groups"
            )
        specs.append(kvspec_spec_of(group.layer_names[0], spec))
    return KVCacheAllocator(
        specs,
        config.num_blocks,
        ctx,
        enable_prefix_caching=manager.enable_caching,
        hash_block_size=hash_block_size,
        hash_salt=hash_salt,
    )


def shadow_manager(manager: Any, ctx: SizingContext, hash_block_size: int) -> KVCacheShadow:
    """Mirror every call vLLM's ``manager`` gets into a kvspec allocator (hashing blocks of
    ``hash_block_size`` tokens, the manager's); returns the shadow (its
    :attr:`~KVCacheShadow.report` fills as the engine runs)."""
    # A salt of the shadow's own, so that the classifier can hash as the allocator does.
    salt = os.urandom(32)
    allocator = allocator_for(manager, ctx, hash_block_size, salt)
    shadow = KVCacheShadow(
        allocator,
        manager.block_pool.get_num_free_blocks,
        DifferenceClassifier(manager, allocator, hash_block_size, salt),
    )
    get_computed_blocks = manager.get_computed_blocks
    allocate_slots = manager.allocate_slots
    free = manager.free
    pop_blocks_for_free = manager.pop_blocks_for_free

    def mirrored_get_computed_blocks(request: Any) -> Any:
        result = get_computed_blocks(request)
        shadow.looked_up(request, result[1])
        return result

    def mirrored_allocate_slots(
        request: Any, num_new_tokens: int, *args: Any, **kwargs: Any
    ) -> Any:
        result = allocate_slots(request, num_new_tokens, *args, **kwargs)
        names = (
            "num_new_computed_tokens",
            "new_computed_blocks",
            "num_lookahead_tokens",
            "num_external_computed_tokens",
            "delay_cache_blocks",
        )
        given = dict(zip(names, args, strict=False))  # args may stop early
        given.update((key, kwargs[key]) for key in names if key in kwargs)
        if given.get("num_external_computed_tokens", 0) or given.get("delay_cache_blocks"):
            shadow.leave_out(request, "its tokens come from a KV connector")
            return result
        shadow.allocated(
            request,
            num_new_tokens,
            given.get("num_new_computed_tokens", 0),
            given.get("num_lookahead_tokens", 0),
            result is not None,
        )
        return result

    def mirrored_free(request: Any) -> None:
        free(request)
        shadow.freed(request)

    def mirrored_pop_blocks_for_free(request: Any) -> Any:
        blocks = pop_blocks_for_free(request)
        shadow.leave_out(request, "its blocks are freed later, after a step in flight")
        return blocks

    manager.get_computed_blocks = mirrored_get_computed_blocks
    manager.allocate_slots = mirrored_allocate_slots
    manager.free = mirrored_free
    manager.pop_blocks_for_free = mirrored_pop_blocks_for_free
    manager.kvspec_shadow = shadow
    return shadow


_shadows: list[KVCacheShadow] = []


def shadows() -> list[KVCacheShadow]:
    """The shadows :func:`install` attached in this process, oldest first."""
    return list(_shadows)


#: Why the managers of vLLM's asynchronous scheduler are not mirrored.
ASYNC_SCHEDULING_NOT_MIRRORED = (
    "asynchronous scheduling (AsyncScheduler): vLLM schedules a step before the previous "
    "one's sampled tokens arrive, so a sliding-window group's blocks that leave the window "
    "are freed a step later than the shadow's call-by-call mirror frees them (free-block "
    "differences no policy of kvspec explains); set async_scheduling=False to shadow it "
    "(vLLM 0.32's CPU build always runs synchronously)"
)

#: Set while an ``AsyncScheduler`` builds its manager (see :func:`install`).
_building_async: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvspec_shadow_building_async", default=False
)


def install() -> None:
    """Wrap the ``KVCacheManager`` vLLM's scheduler builds in a shadow (idempotent). The
    manager of an ``AsyncScheduler`` is left unmirrored, with a warning naming
    :data:`ASYNC_SCHEDULING_NOT_MIRRORED`."""
    scheduler = vllm_module("vllm.v1.core.sched.scheduler")
    _mark_async_scheduler_builds()
    manager_cls = scheduler.KVCacheManager
    if getattr(manager_cls, "kvspec_shadowed", False):
        return

    def shadowed_manager(*args: Any, **kwargs: Any) -> Any:
        manager = manager_cls(*args, **kwargs)
        if _building_async.get():
            logger.warning("kvspec shadow: not mirrored: %s", ASYNC_SCHEDULING_NOT_MIRRORED)
            return manager
        ctx = SizingContext(
            max_model_len=kwargs["max_model_len"],
            max_in_flight_tokens=kwargs.get("max_in_flight_tokens") or kwargs["max_model_len"],
            dcp_size=kwargs.get("dcp_world_size", 1),
            prefix_caching=bool(kwargs.get("enable_caching", True)),
        )
        try:
            _shadows.append(shadow_manager(manager, ctx, kwargs["hash_block_size"]))
        except NotRepresentable as refusal:
            logger.warning("kvspec shadow: not mirrored: %s", refusal.reason)
        return manager

    shadowed_manager.kvspec_shadowed = True  # type: ignore[attr-defined]
    shadowed_manager.__wrapped__ = manager_cls  # type: ignore[attr-defined]
    scheduler.KVCacheManager = shadowed_manager


def uninstall() -> None:
    """Let vLLM's scheduler build its plain ``KVCacheManager`` again."""
    scheduler = vllm_module("vllm.v1.core.sched.scheduler")
    if getattr(scheduler.KVCacheManager, "kvspec_shadowed", False):
        scheduler.KVCacheManager = scheduler.KVCacheManager.__wrapped__
    async_scheduler = vllm_module("vllm.v1.core.sched.async_scheduler").AsyncScheduler
    init = async_scheduler.__dict__.get("__init__")
    if getattr(init, "kvspec_shadow_marks", False):
        async_scheduler.__init__ = init.__wrapped__


def _mark_async_scheduler_builds() -> None:
    """Make ``AsyncScheduler.__init__`` (which builds the manager through ``Scheduler``'s)
    set :data:`_building_async` while it runs (idempotent)."""
    async_scheduler = vllm_module("vllm.v1.core.sched.async_scheduler").AsyncScheduler
    init = async_scheduler.__dict__.get("__init__")
    if init is None or getattr(init, "kvspec_shadow_marks", False):
        return

    def marked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        token = _building_async.set(True)
        try:
            init(self, *args, **kwargs)
        finally:
            _building_async.reset(token)

    marked_init.kvspec_shadow_marks = True  # type: ignore[attr-defined]
    marked_init.__wrapped__ = init  # type: ignore[attr-defined]
    async_scheduler.__init__ = marked_init
