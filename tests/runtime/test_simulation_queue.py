"""The simulator's queue: a request waiting for admission, or preempted, generates nothing.
The fixed trace keeps sending its decodes; they are dropped and counted, never appended to
a prompt the request would then be re-admitted with (found in review: those tokens were
prefilled as if generated, and counted as prompt tokens). A re-admission's hit tokens are
reported apart."""

from __future__ import annotations

from runtime_testkit import context, full, make_allocator, sliding

from kvspec_core.runtime.simulation import simulate


def test_decodes_of_a_request_waiting_for_admission_are_dropped() -> None:
    allocator = make_allocator([full(4)], 6)  # 5 usable blocks
    events = [
        ("admit", "a", list(range(16))),  # 4 blocks
        ("admit", "b", list(range(100, 108))),  # 2 blocks: waits
        ("decode", "b", 200),
        ("decode", "b", 201),
        ("decode", "a", 300),  # a's fifth block
        ("finish", "a"),  # b is admitted with its 8 prompt tokens
        ("decode", "b", 202),
        ("finish", "b"),
    ]
    report = simulate(allocator, events)
    assert (report.admitted, report.waited_admissions, report.preemptions) == (2, 1, 0)
    assert report.dropped_decodes == 2
    assert report.prompt_tokens == 16 + 8
    assert report.longest_request_tokens == 17


def test_a_preempted_request_is_readmitted_with_the_tokens_it_had() -> None:
    allocator = make_allocator([full(4)], 6)
    events = [
        ("admit", "a", list(range(16))),  # 4 blocks
        ("admit", "b", list(range(100, 104))),  # the fifth
        ("decode", "a", 300),  # needs a block: a is preempted, holding 17 tokens
        ("decode", "a", 301),  # queued: dropped
        ("finish", "b"),  # a is admitted again with its 17 tokens
        ("decode", "a", 302),
        ("finish", "a"),
    ]
    report = simulate(allocator, events)
    assert (report.preemptions, report.readmissions, report.dropped_decodes) == (1, 1, 1)
    assert report.prompt_tokens == 16 + 4 + 17
    assert report.longest_request_tokens == 18
    # Its own four blocks, still cached: a hit, reported apart from reuse across requests.
    assert report.hit_tokens == report.readmission_hit_tokens == 16


def test_a_preempted_request_past_the_cap_stops_counted_once() -> None:
    """Found in review: a preempted request whose tokens had grown past its group's
    admission cap was refused on re-admission and counted in ``rejected`` too, though it
    was admitted: ``never_admitted`` came out negative. It stops, as at max_model_len."""
    # A window of 4 over 4-token blocks, 8 in-flight tokens: at most 4 blocks per step.
    allocator = make_allocator([sliding(4, 4)], 3, ctx=context(64, 8))
    events = [("admit", "a", list(range(8)))]
    events += [("decode", "a", 100 + i) for i in range(12)]  # a holds 20 tokens
    events += [("admit", "b", [200]), ("decode", "a", 400)]  # no block: a is preempted
    # b's decodes evict a's cached blocks; then a retries with 21 tokens to compute in one
    # step: over the cap.
    events += [("decode", "b", 300 + i) for i in range(8)]
    events += [("finish", "b"), ("decode", "a", 401), ("finish", "a")]
    report = simulate(allocator, events)
    assert (report.admitted, report.preemptions) == (2, 1)
    assert (report.rejected, report.truncated, report.never_admitted) == (0, 1, 0)
