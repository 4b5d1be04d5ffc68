"""Shadow mode: vLLM's own KV-cache manager runs the engine, and every call the scheduler
makes to it is mirrored into kvspec's :class:`~kvspec_core.runtime.KVCacheAllocator`, which
answers independently; any difference in prefix hits, admissions or free blocks is
reported. A conformance tool for engine builders: it shows where kvspec's allocator would
decide as vLLM's does on a real workload, and where not, without touching the engine's
outputs (vLLM's answers are the ones returned).

Switched on with ``KVSPEC_VLLM_SHADOW=1`` (the plugin wraps the ``KVCacheManager`` vLLM's
scheduler builds), or by hand with :func:`shadow_manager`. Mirrored: ``get_computed_blocks``
(kvspec's ``find_cached_prefix`` on the same tokens: equal hit tokens?),
``allocate_slots`` (the same span of tokens: both admit or both refuse? then equal free
blocks?) and ``free`` / ``pop_blocks_for_free``. Requests whose tokens come from a KV
connector (external tokens, delayed caching) are not mirrored; a request vLLM admitted and
kvspec refused is left out from then on (both counted as differences). The manager of an
``AsyncScheduler`` is not mirrored at all, with a warning
(:data:`ASYNC_SCHEDULING_NOT_MIRRORED`).

Each difference is classified (:mod:`kvspec_vllm.shadow_differences`): *expected* ones come
from policies where vLLM 0.32 and kvspec differ and both are right (copies of a recomputed
cached block, vLLM's sparse sliding-window retention, and what follows from them), are
counted per reason and logged at INFO; the others are *divergences*, logged as warnings and
kept in :attr:`ShadowReport.differences`.
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import Callable
from typing import Any

import attrs

from kvspec_core.context import SizingContext
from kvspec_core.runtime import CachedPrefix, KVCacheAllocator, Request
from kvspec_vllm.errors import NotRepresentable
from kvspec_vllm.shadow_differences import (
    DIVERGENCE,
    FOLLOWS,
    DifferenceClassifier,
    Verdict,
)
from kvspec_vllm.specs import kvspec_spec_of, vllm_module

logger = logging.getLogger("vllm.kvspec.shadow")

#: Differences kept in a report (counted beyond that), and logged as warnings.
MAX_KEPT_DIFFERENCES = 100
MAX_LOGGED_DIFFERENCES = 10


@attrs.define
class ShadowReport:
    """Counts of mirrored calls and of those where kvspec answered as vLLM did.

    ``num_differences`` / ``differences``: the divergences (differences no known policy
    explains); ``num_expected_differences``, ``expected_reasons`` (count per reason, see
    :data:`~kvspec_vllm.shadow_differences.EXPECTED_REASONS`) and ``expected_differences``
    (the first ones, with their reason): the differences two correct policies explain.
    """

    lookups: int = 0
    equal_hits: int = 0
    allocations: int = 0
    equal_admissions: int = 0
    free_checks: int = 0
    equal_free_blocks: int = 0
    frees: int = 0
    hit_tokens_vllm: int = 0
    hit_tokens_kvspec: int = 0
    skipped_requests: int = 0
    num_differences: int = 0
    differences: list[str] = attrs.Factory(list)
    num_expected_differences: int = 0
    expected_reasons: dict[str, int] = attrs.Factory(dict)
    expected_differences: list[str] = attrs.Factory(list)

    @property
    def agrees(self) -> bool:
        """Whether no mirrored call diverged (expected differences aside)."""
        return self.num_differences == 0

    @property
    def identical(self) -> bool:
        """Whether every mirrored call got kvspec's answer equal to vLLM's."""
        return self.num_differences == 0 and self.num_expected_differences == 0


class KVCacheShadow:
    """kvspec's allocator fed the calls one vLLM ``KVCacheManager`` receives."""

    def __init__(
        self,
        allocator: KVCacheAllocator,
        free_blocks: Callable[[], int],
        classifier: DifferenceClassifier | None = None,
    ) -> None:
        self.classifier = classifier
        self.allocator = allocator
        self.report = ShadowReport()
        self._vllm_free_blocks = free_blocks
        self._requests: dict[str, Request] = {}
        self._prefixes: dict[str, CachedPrefix] = {}
        self._left_out: set[str] = set()
        # vLLM's request objects of the mirrored requests, while both sides run them.
        self._vllm_requests: dict[str, Any] = {}
        # Requests whose last lookup differed for an expected reason, and for none.
        self._hit_differed: set[str] = set()
        self._hit_diverged: set[str] = set()
        # How the last free-block comparison went: None equal, else whether expected.
        self._free_differed: bool | None = None
        # Requests vLLM runs and kvspec does not: vLLM's request, whether left out for an
        # expected reason.
        self._left_out_held: dict[str, tuple[Any, bool]] = {}

    @property
    def allocator(self) -> KVCacheAllocator:
        """kvspec's allocator the calls go to (replaceable: the classifier follows)."""
        return self._allocator

    @allocator.setter
    def allocator(self, allocator: KVCacheAllocator) -> None:
        self._allocator = allocator
        if self.classifier is not None:
            self.classifier.allocator = allocator

    # ----------------------------------------------------------------- mirrored calls
    def looked_up(self, request: Any, vllm_hit_tokens: int) -> None:
        rid = request.request_id
        if self.allocator.is_running(rid) or rid in self._left_out:
            return
        mirror = self._new_request(request)
        prefix = self.allocator.find_cached_prefix(mirror)
        self._requests[rid] = mirror
        self._prefixes[rid] = prefix
        report = self.report
        report.lookups += 1
        report.hit_tokens_vllm += vllm_hit_tokens
        report.hit_tokens_kvspec += prefix.num_tokens
        if prefix.num_tokens == vllm_hit_tokens:
            report.equal_hits += 1
            self._hit_differed.discard(rid)
            self._hit_diverged.discard(rid)
        else:
            verdict = (
                self.classifier.hit(request, mirror, vllm_hit_tokens, prefix)
                if self.classifier is not None
                else Verdict(DIVERGENCE, "not classified")
            )
            (self._hit_differed if verdict.expected else self._hit_diverged).add(rid)
            (self._hit_diverged if verdict.expected else self._hit_differed).discard(rid)
            self._differ(
                f"request {rid!r} ({len(mirror.token_ids)} tokens): vLLM hits "
                f"{vllm_hit_tokens} tokens, kvspec {prefix.num_tokens}",
                verdict,
            )

    def allocated(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        num_lookahead_tokens: int,
        admitted: bool,
    ) -> None:
        rid = request.request_id
        if rid in self._left_out:
            return
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        allocator = self.allocator
        if allocator.is_running(rid):
            mirror = self._requests[rid]
            mirror.token_ids.extend(request.all_token_ids[len(mirror.token_ids) :])
            start = allocator.num_computed_tokens(rid)
            result = allocator.allocate_slots(mirror, end - start, num_lookahead_tokens)
        else:
            mirror = self._requests.get(rid) or self._new_request(request)
            self._requests[rid] = mirror
            prefix = self._prefixes.pop(rid, None)
            start = prefix.num_tokens if prefix is not None else 0
            result = allocator.allocate_slots(
                mirror, end - start, num_lookahead_tokens, prefix=prefix
            )
        report = self.report
        report.allocations += 1
        if bool(result) == admitted:
            report.equal_admissions += 1
            if result:
                self._vllm_requests[rid] = request
                if self.classifier is not None:
                    self.classifier.note_cached(request)
        else:
            if rid in self._hit_diverged or self._free_differed is False:
                verdict = Verdict(DIVERGENCE, "after a divergence in the hit or free blocks")
            elif self._free_differed or rid in self._hit_differed:
                verdict = Verdict(FOLLOWS, "free blocks or the request's hit differed before")
            else:
                verdict = Verdict(DIVERGENCE, "with equal free blocks and hit")
            self._differ(
                f"request {rid!r}: vLLM {'allocated' if admitted else 'refused'} slots up to "
                f"token {end}, kvspec {'allocated' if result else 'refused'}",
                verdict,
            )
            if result:
                allocator.free(rid)
            self._leave_out(rid)
            # vLLM holds its blocks until it frees it (a refused running request: when the
            # scheduler preempts it).
            self._left_out_held[rid] = (request, verdict.expected)
        self._compare_free_blocks(f"after allocate_slots of {rid!r}")

    def freed(self, request: Any) -> None:
        rid = request.request_id
        self._prefixes.pop(rid, None)
        self._requests.pop(rid, None)
        self._forget_running(rid)
        self._left_out.discard(rid)
        self._left_out_held.pop(rid, None)
        if self.allocator.is_running(rid):
            self.allocator.free(rid)
            self.report.frees += 1
            self._compare_free_blocks(f"after free of {rid!r}")
            if self.allocator.num_running == 0:
                self.log_summary()

    def log_summary(self) -> None:
        """Log the counts so far (the shadow does when the last running request ends)."""
        report = self.report
        logger.info(
            "kvspec shadow: %d lookups (%d equal hits: vLLM %d hit tokens, kvspec %d), %d "
            "allocations (%d equal admissions), %d free-block checks (%d equal), %d "
            "divergences, %d expected differences %s, %d requests not mirrored",
            report.lookups,
            report.equal_hits,
            report.hit_tokens_vllm,
            report.hit_tokens_kvspec,
            report.allocations,
            report.equal_admissions,
            report.free_checks,
            report.equal_free_blocks,
            report.num_differences,
            report.num_expected_differences,
            report.expected_reasons,
            report.skipped_requests,
        )

    def leave_out(self, request: Any, why: str) -> None:
        """Stop mirroring ``request`` (a KV connector supplies its tokens)."""
        rid = request.request_id
        if rid not in self._left_out:
            self.report.skipped_requests += 1
            logger.info("kvspec shadow: request %r not mirrored: %s", rid, why)
        if self.allocator.is_running(rid):
            self.allocator.free(rid)
        self._leave_out(rid)
        # Not mirrored by design: the blocks vLLM holds for it are expected.
        self._left_out_held[rid] = (request, True)

    # ----------------------------------------------------------------- helpers
    def _new_request(self, request: Any) -> Request:
        salt = getattr(request, "cache_salt", None)
        return Request(request.request_id, list(request.all_token_ids), cache_salt=salt)

    def _leave_out(self, rid: str) -> None:
        self._left_out.add(rid)
        self._requests.pop(rid, None)
        self._prefixes.pop(rid, None)
        self._forget_running(rid)

    def _forget_running(self, rid: str) -> None:
        self._vllm_requests.pop(rid, None)
        self._hit_differed.discard(rid)
        self._hit_diverged.discard(rid)
        if self.classifier is not None:
            self.classifier.forget(rid)

    def _compare_free_blocks(self, when: str) -> None:
        report = self.report
        report.free_checks += 1
        vllm_free = self._vllm_free_blocks()
        kvspec_free = self.allocator.usage.free_blocks
        if vllm_free == kvspec_free:
            report.equal_free_blocks += 1
            self._free_differed = None
            return
        verdict = (
            self.classifier.free_blocks(
                vllm_free,
                kvspec_free,
                self._vllm_requests,
                self._hit_differed,
                self._left_out_held,
            )
            if self.classifier is not None
            else Verdict(DIVERGENCE, "not classified")
        )
        diverged = sorted(self._hit_diverged.intersection(self._vllm_requests))
        if verdict.expected and diverged:
            # Explained by the tables, but the tables follow hits no policy explains.
            verdict = Verdict(
                DIVERGENCE, f"{verdict.detail}; requests {diverged} were admitted on diverging hits"
            )
        self._free_differed = verdict.expected
        self._differ(f"{when}: vLLM has {vllm_free} free blocks, kvspec {kvspec_free}", verdict)

    def _differ(self, difference: str, verdict: Verdict) -> None:
        report = self.report
        described = f"{difference} [{verdict.reason}: {verdict.detail}]"
        if verdict.expected:
            report.num_expected_differences += 1
            reasons = report.expected_reasons
            reasons[verdict.reason] = reasons.get(verdict.reason, 0) + 1
            if len(report.expected_differences) < MAX_KEPT_DIFFERENCES:
                report.expected_differences.append(described)
            if report.num_expected_differences <= MAX_LOGGED_DIFFERENCES:
                logger.info("kvspec shadow: expected difference: %s", described)
            return
        report.num_differences += 1
        if len(report.differences) < MAX_KEPT_DIFFERENCES:
            report.differences.append(described)
        if report.num_differences <= MAX_LOGGED_DIFFERENCES:
            logger.warning("kvspec shadow: %s", described)


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
