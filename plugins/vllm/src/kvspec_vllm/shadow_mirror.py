"""The mirror of shadow mode (:mod:`kvspec_vllm.shadow`): :class:`KVCacheShadow` feeds
kvspec's allocator the calls one vLLM ``KVCacheManager`` receives, compares each answer
(hit tokens, admission, free blocks) with vLLM's, and records every difference in its
:class:`~kvspec_vllm.shadow_report.ShadowReport` as the
:class:`~kvspec_vllm.shadow_differences.DifferenceClassifier` classifies it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvspec_core.runtime import CachedPrefix, KVCacheAllocator, Request
from kvspec_vllm.shadow_differences import (
    DIVERGENCE,
    FOLLOWS,
    DifferenceClassifier,
    Verdict,
)
from kvspec_vllm.shadow_report import ShadowReport, log_counts, record_difference

logger = logging.getLogger("vllm.kvspec.shadow")


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
            record_difference(
                report,
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
        result: object
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
            # kvspec's hit may reach past the chunk vLLM computes (vLLM hit less: a window's
            # blocks it did not retain): kvspec cannot take this step as vLLM does, so the
            # admissions differ (recorded below), never an error inside vLLM's schedule().
            result = (
                allocator.allocate_slots(mirror, end - start, num_lookahead_tokens, prefix=prefix)
                if end >= start
                else False
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
            record_difference(
                report,
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
        log_counts(self.report)

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
        # A resumed request's token ids hold its output: its prompt is vLLM's count.
        return Request(
            request.request_id,
            list(request.all_token_ids),
            cache_salt=salt,
            num_prompt_tokens=request.num_prompt_tokens,
        )

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
        record_difference(
            report, f"{when}: vLLM has {vllm_free} free blocks, kvspec {kvspec_free}", verdict
        )
