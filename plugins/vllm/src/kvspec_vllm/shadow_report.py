"""What a shadow (:mod:`kvspec_vllm.shadow`) reports: :class:`ShadowReport`'s counts of
mirrored calls and of equal answers, and each difference recorded in it (kept, counted per
reason, logged) as its :class:`~kvspec_vllm.shadow_differences.Verdict` classifies it.
"""

from __future__ import annotations

import logging

import attrs

from kvspec_vllm.shadow_differences import Verdict

# Every shadow module logs to this one logger.
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


def record_difference(report: ShadowReport, difference: str, verdict: Verdict) -> None:
    """Count ``difference`` in ``report`` as ``verdict`` classifies it: an expected one per
    reason, logged at INFO; a divergence logged as a warning (the first ones of each kept)."""
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


def log_counts(report: ShadowReport) -> None:
    """Log ``report``'s counts at INFO."""
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
