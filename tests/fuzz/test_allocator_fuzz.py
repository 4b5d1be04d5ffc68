"""The differential allocator fuzzer (issue 18): a few seconds of it on the normal build of
the kernels find nothing, and it does find, once each, shrunk and replayable, what a side
that answers differently, crashes, or hits falsely does. CI runs it for minutes under
AddressSanitizer (``.ci/run``, ``scripts/asan-kernels``)."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
from allocator_fuzz import CONFIGS, fuzz, run_in_child
from fuzz_program import TIER_FORGERIES, Side, make_sides, run_program

from kvspec_core.runtime import CachedPrefix, Request
from kvspec_core.runtime.native import native

pytestmark = pytest.mark.skipif(native is None, reason="kvspec_core.runtime._native is not built")


def test_a_few_seconds_of_fuzzing_find_no_difference_between_kernels_and_python() -> None:
    report = fuzz(seconds=6, seed=18)
    assert not report.findings, report.text()
    assert report.ops >= 300, report.text()
    assert set(report.ops_per_config) == set(CONFIGS), report.text()


class FreeForgetsOnPython(Side):
    """A pure-Python side whose free does nothing: the two sides drift apart."""

    def op_free(self, op: dict) -> list[str]:
        if self.kernels:
            return super().op_free(op)
        rid = self.pick(op["target"])
        if rid is None:
            return ["skip"]
        if self.allocator.is_running(rid):
            self.forget(rid)
            return ["None"]
        return super().op_free(op)


def drifting_sides(config: str, eviction: str, events: bool) -> tuple[Side, Side]:
    kernels, _ = make_sides(config, eviction, events)
    return kernels, FreeForgetsOnPython("python", False, config, eviction, events)


def test_a_difference_is_reported_once_shrunk_to_what_it_needs_and_replays() -> None:
    report = fuzz(seconds=3, seed=1, configs=["full"], sides=drifting_sides)
    findings = report.distinct()
    assert len(findings) == 1, report.text()
    (finding,) = findings
    assert finding.key.startswith("state differs after free"), finding.key
    # An admission then the free: nothing else is needed.
    assert [op["op"] for op in finding.ops] == ["admit", "free"], finding.ops
    _, divergence = run_program(finding.setup, finding.ops, sides=drifting_sides)
    assert divergence is not None and divergence.key == finding.key
    assert run_program(finding.setup, finding.ops)[1] is None  # the real sides agree


class CrashesOnQuery(Side):
    def op_query(self, op: dict) -> list[str]:
        os.kill(os.getpid(), signal.SIGSEGV)
        return []


def crashing_sides(config: str, eviction: str, events: bool) -> tuple[Side, Side]:
    _, python = make_sides(config, eviction, events)
    return CrashesOnQuery("kernels", True, config, eviction, events), python


def test_a_crash_is_a_finding_and_the_run_goes_on() -> None:
    report = fuzz(seconds=3, seed=2, configs=["sliding"], sides=crashing_sides)
    findings = report.distinct()
    assert [finding.key for finding in findings] == ["crash: killed by SIGSEGV during query"]
    assert findings[0].ops[-1]["op"] == "query" and len(findings[0].ops) == 1
    outcome = run_in_child(findings[0].setup, findings[0].ops, crashing_sides)
    assert outcome.key == findings[0].key


def test_a_hit_no_earlier_request_of_the_tenant_backs_is_a_false_hit() -> None:
    side = Side("kernels", True, "full", "lru", False)
    side.seen.add(((("str", "a"), None), (1, 2, 3, 4, 5)))
    hit = CachedPrefix(request_id="x", num_tokens=4, block_ids=((1,),), epochs=(0,))
    side.check_hit(Request("x", [1, 2, 3, 4, 9], cache_salt="a"), hit)
    assert side.notes == []
    side.check_hit(Request("y", [1, 2, 3, 4, 9], cache_salt=b"a"), hit)  # another tenant
    side.check_hit(Request("z", [1, 2, 3, 7, 9], cache_salt="a"), hit)  # other tokens
    assert len(side.notes) == 2 and all(note.startswith("false hit") for note in side.notes)


TIERED = [name for name in CONFIGS if "tiers" in name]


def test_tiered_programs_reach_tier_hits_loads_failed_transfers_and_forged_loads() -> None:
    """The tiered configurations are not fuzzed in name only: their programs find prefixes
    in the offload tiers, admit them (loads), take stores and demotions, complete transfers
    confirmed and failed, and the allocator refuses edited tier loads."""
    from allocator_fuzz import episode

    seen: Counter[str] = Counter()

    class Counting(Side):
        def apply(self, op: dict) -> list[str]:
            answers = super().apply(op)
            if self.kernels:
                text = " ".join(answers)
                seen["tier hit"] += text.startswith("tiered")
                seen["load"] += " load " in text
                seen["demotion"] += "1->2" in text
                if op["op"] == "complete" and answers != ["skip"]:
                    seen[f"completed ok={op['ok']}"] += not text.startswith("raise")
                prefix = op.get("prefix")
                if isinstance(prefix, list) and prefix[1] in TIER_FORGERIES:
                    seen["forged load refused"] += answers[1:2] == ["forged"] and (
                        answers[-1].startswith("raise")
                    )
            return answers

    def counting(config: str, eviction: str, events: bool) -> tuple[Side, Side]:
        return (
            Counting("kernels", True, config, eviction, events),
            Counting("python", False, config, eviction, events),
        )

    for number in range(2 * len(TIERED) * 20):
        setup, ops = episode(5, TIERED, number)
        assert run_program(setup, ops, sides=counting)[1] is None
    for what in (
        "tier hit",
        "load",
        "demotion",
        "completed ok=True",
        "completed ok=False",
        "forged load refused",
    ):
        assert seen[what] >= 3, seen
