"""``kvspec simulate --trace``: which request trace is replayed, and its events.

A built-in name (``shared``: :mod:`kvspec_core.runtime.trace`; ``chat``:
:mod:`kvspec_core.runtime.chat_trace`) is generated from ``--seed``; anything else is a
Mooncake-format JSONL file (:mod:`kvspec_core.runtime.mooncake_trace`), read and checked
before the model is planned, whose prompts must then fit the plan's max_model_len.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import attrs

from kvspec_core.errors import KVSpecError
from kvspec_core.runtime import chat_trace, trace
from kvspec_core.runtime.mooncake_trace import (
    DEFAULT_OUTPUT_CAP,
    MooncakeRequest,
    count_events,
    read_mooncake_trace,
    trace_events,
)

#: ``--trace`` names of the built-in generated traces -> (generator, default requests).
BUILT_IN_TRACES: dict[str, tuple[Callable[..., Iterator[tuple]], int]] = {
    "shared": (trace.make_trace, 2000),
    "chat": (chat_trace.make_trace, 3000),
}


class TraceOptionError(KVSpecError, ValueError):
    """``--trace`` and the options around it do not fit together."""


@attrs.frozen
class TraceReplay:
    """The events of the trace to replay, and how the output names it."""

    #: A fresh iterator over the events each call (``--plot`` replays them again).
    make_events: Callable[[], Iterable[tuple]]
    #: Events in all, for the progress bar; ``None`` for a streamed built-in trace.
    total_events: int | None
    #: The built-in trace's seed; ``None`` for a file.
    seed: int | None
    #: A file's requests left out by ``--skip-too-long``.
    skipped: int
    #: The ``trace`` row of the human output.
    label: str


def read_trace_file(args: argparse.Namespace) -> list[MooncakeRequest] | None:
    """The requests of ``--trace FILE`` (``None`` for a built-in trace); options that only
    fit the other kind of trace are refused."""
    if args.trace in BUILT_IN_TRACES:
        if Path(args.trace).exists():
            raise TraceOptionError(
                f"--trace {args.trace} names the built-in {args.trace!r} trace, and a file "
                f"{args.trace!r} exists here too: write ./{args.trace} for the file"
            )
        if args.skip_too_long:
            raise TraceOptionError(
                "--skip-too-long applies to a trace file; a built-in trace's requests over "
                "max_model_len are replayed and counted as 'over the admission cap'"
            )
        return None
    if args.seed is not None:
        raise TraceOptionError(
            f"--seed applies to the built-in traces (shared, chat); the trace file "
            f"{args.trace!r} is replayed as written: drop --seed"
        )
    return read_mooncake_trace(args.trace, args.requests)


def fitting_requests(
    args: argparse.Namespace,
    requests: list[MooncakeRequest],
    max_model_len: int,
    trained_length: int | None = None,
) -> list[MooncakeRequest]:
    """``requests`` whose prompts fit ``max_model_len``: those that do not are refused, or
    left out with ``--skip-too-long``. ``trained_length``: the longest request the model
    was built for (a suggested length past it names ``--allow-long-max-model-len`` too)."""
    too_long = [request for request in requests if request.input_length > max_model_len]
    if not too_long:
        return requests
    if not args.skip_too_long:
        longest = max(too_long, key=lambda request: request.input_length)
        fits = max(
            request.input_length + request.decode_tokens(DEFAULT_OUTPUT_CAP) for request in requests
        )
        # Past the model's length, the suggested option alone would be refused next.
        untrained = (
            trained_length is not None
            and fits > trained_length
            and not args.allow_long_max_model_len
        )
        raise TraceOptionError(
            f"trace {args.trace!r}: {len(too_long):,} of the {len(requests):,} requests taken "
            f"have prompts longer than max_model_len={max_model_len:,} and could never run "
            f"(the longest: line {longest.line}, {longest.input_length:,} tokens). Give "
            f"--max-model-len {fits} (every request then also decodes its output"
            + (
                f"; past the {trained_length:,} tokens the model was built for, so add "
                "--allow-long-max-model-len"
                if untrained
                else ""
            )
            + "), take fewer with --requests, or leave them out with --skip-too-long"
        )
    kept = [request for request in requests if request.input_length <= max_model_len]
    if not kept:
        raise TraceOptionError(
            f"trace {args.trace!r}: all {len(requests):,} requests taken have prompts longer "
            f"than max_model_len={max_model_len:,}; nothing is left to replay: give a larger "
            "--max-model-len"
        )
    return kept


def trace_replay(
    args: argparse.Namespace,
    file_requests: list[MooncakeRequest] | None,
    max_model_len: int,
    trained_length: int | None = None,
) -> TraceReplay:
    """The events to replay: the built-in ``--trace`` (``file_requests`` is ``None``) or the
    file's requests that fit ``max_model_len`` (:func:`fitting_requests`; ``trained_length``
    as there)."""
    if file_requests is None:
        make_trace, default_requests = BUILT_IN_TRACES[args.trace]
        trace_seed = 0 if args.seed is None else args.seed
        num_requests = args.requests or default_requests
        # Streamed, so any --requests fits in memory; the bar counts events as they come.
        return TraceReplay(
            make_events=lambda: make_trace(seed=trace_seed, num_requests=num_requests),
            total_events=None,
            seed=trace_seed,
            skipped=0,
            label=f"{args.trace} (seed {trace_seed})",
        )
    kept = fitting_requests(args, file_requests, max_model_len, trained_length)
    skipped = len(file_requests) - len(kept)
    return TraceReplay(
        make_events=lambda: trace_events(kept),
        total_events=count_events(kept),
        seed=None,
        skipped=skipped,
        label=f"{args.trace} (Mooncake format)"
        + (f", {skipped:,} left out: prompt over max_model_len" if skipped else ""),
    )
