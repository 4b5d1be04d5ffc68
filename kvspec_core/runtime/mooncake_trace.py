"""Mooncake-format request traces (JSONL) as allocator events.

Mooncake's traces (kvcache-ai/Mooncake, ``FAST25-release/traces``: the synthetic,
conversation and tool-agent traces) hold one request per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``hash_ids`` name the prompt's 512-token blocks (:data:`HASH_BLOCK_TOKENS`, the traces' own
block size): equal ids are equal blocks, so two prompts share a prefix exactly as far as
their ids agree. Only the last block may be partial.

:func:`make_trace` turns such a file into the event format of :mod:`kvspec_core.runtime.trace`
(the same events as the project's ``shared/bench/mooncake_trace.py`` for the same file)::

    ("admit", request_id, prompt_tokens)   request_id: the row's 0-based index in the file
    ("decode", request_id, token)
    ("finish", request_id)

Tokens: block id ``h`` at position ``i`` is token ``h * 512 + i`` (distinct blocks never share
a token run); the last block takes the first ``input_length - 512 * (len(hash_ids) - 1)``
tokens of its id. Decode tokens are fresh ids above every prompt token, never reused (the
trace's next turn names its own blocks). The runtime hashes token ids below ``2**32``: a
file whose ids would make larger ones (ids of 8,388,607 and up, or near it with the decode
tokens above them) has its ids renumbered ``0, 1, 2, ...`` in order of first appearance
first. Ids are only labels, so every prompt shares what it shared before.

Requests arrive in timestamp order (ties in file order); a round loop admits while fewer
than ``max_running`` run, then every running request decodes one token. A request decodes
``min(output_cap, output_length)`` tokens, at least one (an engine's prefill samples the
first token).

Every row is checked before any event is made: a malformed line, a missing or ill-typed
field, or an ``input_length`` that its ``hash_ids`` cannot hold is a :class:`TraceFormatError`
naming the file, the line, the field and the fix. Nothing is skipped.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from kvspec_core.errors import KVSpecError

#: Tokens per ``hash_ids`` block in Mooncake's traces.
HASH_BLOCK_TOKENS = 512
#: Requests running at once in the round loop (as the project's shared Mooncake replay).
DEFAULT_MAX_RUNNING = 32
#: Output tokens per request at most (the traces average a few hundred).
DEFAULT_OUTPUT_CAP = 200
#: Token ids the runtime hashes are below this (``PrefixHasher``: 32-bit tokens).
TOKEN_ID_LIMIT = 2**32


class TraceFormatError(KVSpecError, ValueError):
    """A trace file cannot be read as a Mooncake-format trace; the message names the file,
    the line, the field and the fix."""


@attrs.frozen
class MooncakeRequest:
    """One validated row of a Mooncake-format trace (``line``: its 1-based line number)."""

    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def prompt_tokens(self) -> list[int]:
        """The prompt's token ids (see the module docstring)."""
        tokens: list[int] = []
        last = len(self.hash_ids) - 1
        for position, block_id in enumerate(self.hash_ids):
            take = (
                HASH_BLOCK_TOKENS
                if position < last
                else self.input_length - HASH_BLOCK_TOKENS * last
            )
            base = block_id * HASH_BLOCK_TOKENS
            tokens.extend(range(base, base + take))
        return tokens

    def decode_tokens(self, output_cap: int) -> int:
        """Tokens this request decodes under ``output_cap``."""
        return max(1, min(output_cap, self.output_length))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_row(text: str, where: str, line: int) -> MooncakeRequest:
    if not text.strip():
        raise TraceFormatError(
            f"{where}: the line is empty; a Mooncake trace has one JSON object per line: "
            "remove the empty line"
        )
    try:
        row: Any = json.loads(text)
    except json.JSONDecodeError as error:
        raise TraceFormatError(
            f"{where}: not valid JSON ({error.msg} at column {error.colno}); each line must be "
            'one JSON object such as {"timestamp": 0, "input_length": 600, '
            '"output_length": 20, "hash_ids": [0, 1]}'
        ) from None
    if not isinstance(row, dict):
        raise TraceFormatError(
            f"{where}: the line holds a JSON {type(row).__name__}, not an object; write one "
            "object per line with the fields timestamp, input_length, output_length, hash_ids"
        )

    def field(name: str, allowed: str) -> Any:
        if name not in row:
            raise TraceFormatError(f"{where}: field {name!r} is missing; add it ({allowed})")
        return row[name]

    def bad(name: str, allowed: str) -> TraceFormatError:
        return TraceFormatError(f"{where}: field {name!r}={row[name]!r} is invalid: {allowed}")

    timestamp = field("timestamp", "the arrival time, a number")
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
        raise bad("timestamp", "the arrival time must be a number")
    if not math.isfinite(timestamp):
        raise bad("timestamp", "the arrival time must be a finite number")
    input_length = field("input_length", "the prompt's length in tokens, an int >= 1")
    if not _is_int(input_length) or input_length < 1:
        raise bad("input_length", "the prompt's length in tokens must be an int >= 1")
    output_length = field("output_length", "the output's length in tokens, an int >= 0")
    if not _is_int(output_length) or output_length < 0:
        raise bad("output_length", "the output's length in tokens must be an int >= 0")
    hash_ids = field(
        "hash_ids", f"the ids of the prompt's {HASH_BLOCK_TOKENS}-token blocks, a list of ints"
    )
    allowed = f"a list of ints >= 0, the ids of the prompt's {HASH_BLOCK_TOKENS}-token blocks"
    if not isinstance(hash_ids, list):
        raise bad("hash_ids", f"it must be {allowed}")
    wrong = next(
        (index for index, block in enumerate(hash_ids) if not (_is_int(block) and block >= 0)),
        None,
    )
    if wrong is not None:
        # The list may hold thousands of ids: name the first bad one only.
        raise TraceFormatError(
            f"{where}: field 'hash_ids' is invalid: hash_ids[{wrong}]={hash_ids[wrong]!r}; it "
            f"must be {allowed}"
        )
    blocks = len(hash_ids)
    if not blocks:
        raise bad("hash_ids", "a prompt has at least one block: list the ids of its blocks")
    low, high = HASH_BLOCK_TOKENS * (blocks - 1) + 1, HASH_BLOCK_TOKENS * blocks
    if not low <= input_length <= high:
        need = -(-input_length // HASH_BLOCK_TOKENS)
        raise TraceFormatError(
            f"{where}: input_length={input_length} does not match the {blocks} hash_ids: "
            f"{blocks} blocks of {HASH_BLOCK_TOKENS} tokens hold {low} to {high} tokens "
            f"(only the last block may be partial); give {need} hash_ids or correct "
            "input_length"
        )
    return MooncakeRequest(
        line=line,
        timestamp=timestamp,
        input_length=input_length,
        output_length=output_length,
        hash_ids=tuple(hash_ids),
    )


def read_mooncake_trace(
    path: str | os.PathLike[str], num_requests: int | None = None
) -> list[MooncakeRequest]:
    """The first ``num_requests`` rows of the trace at ``path`` (all when ``None``), each
    validated (see the module docstring); lines after those are not read."""
    if num_requests is not None and num_requests < 1:
        raise TraceFormatError(f"num_requests={num_requests!r} must be >= 1 (or None for all)")
    requests: list[MooncakeRequest] = []
    try:
        with open(path, encoding="utf-8") as file:
            for number, text in enumerate(file, start=1):
                if num_requests is not None and len(requests) == num_requests:
                    break
                where = f"trace {os.fspath(path)!r}, line {number}"
                requests.append(_parse_row(text, where, number))
    except UnicodeDecodeError as error:
        raise TraceFormatError(
            f"trace {os.fspath(path)!r} is not UTF-8 text ({error.reason}); a Mooncake trace "
            "is JSONL, one JSON object per line"
        ) from None
    except OSError as error:
        raise TraceFormatError(
            f"trace {os.fspath(path)!r} cannot be read: {error.strerror or error}; give the "
            "path of a Mooncake-format JSONL file"
        ) from None
    if not requests:
        raise TraceFormatError(
            f"trace {os.fspath(path)!r} is empty; a Mooncake trace has one request per line"
        )
    return requests


def count_events(requests: Sequence[MooncakeRequest], output_cap: int = DEFAULT_OUTPUT_CAP) -> int:
    """How many events :func:`trace_events` yields for ``requests`` (for a progress bar)."""
    return sum(2 + request.decode_tokens(output_cap) for request in requests)


def trace_events(
    requests: Sequence[MooncakeRequest],
    *,
    max_running: int = DEFAULT_MAX_RUNNING,
    output_cap: int = DEFAULT_OUTPUT_CAP,
) -> Iterator[tuple]:
    """Yield the events of ``requests`` (see the module docstring); request ids are indices
    into ``requests``."""
    if not _is_int(max_running) or max_running < 1:
        raise TraceFormatError(f"max_running={max_running!r} must be an int >= 1")
    if not _is_int(output_cap) or output_cap < 1:
        raise TraceFormatError(f"output_cap={output_cap!r} must be an int >= 1")
    return _round_loop(_with_token_ids_in_range(requests, output_cap), max_running, output_cap)


def _with_token_ids_in_range(
    requests: Sequence[MooncakeRequest], output_cap: int
) -> Sequence[MooncakeRequest]:
    """``requests``, their ids renumbered in order of first appearance where the tokens
    they make (prompts, then the decode tokens above them) would reach TOKEN_ID_LIMIT."""
    if not requests:
        return requests
    top_block = max(max(request.hash_ids) for request in requests)
    decoded = sum(request.decode_tokens(output_cap) for request in requests)
    if (top_block + 2) * HASH_BLOCK_TOKENS + decoded <= TOKEN_ID_LIMIT:
        return requests
    renumbered: dict[int, int] = {}
    for request in requests:
        for block_id in request.hash_ids:
            renumbered.setdefault(block_id, len(renumbered))
    if (len(renumbered) + 1) * HASH_BLOCK_TOKENS + decoded > TOKEN_ID_LIMIT:
        raise TraceFormatError(
            f"the trace's {len(renumbered):,} distinct hash_ids and {decoded:,} decode tokens "
            f"need token ids beyond 2**32; take fewer requests"
        )
    return [
        attrs.evolve(request, hash_ids=tuple(renumbered[b] for b in request.hash_ids))
        for request in requests
    ]


def _round_loop(
    requests: Sequence[MooncakeRequest], max_running: int, output_cap: int
) -> Iterator[tuple]:
    if not requests:
        return
    top_block = max((max(request.hash_ids) for request in requests), default=0) + 1
    fresh = (top_block + 1) * HASH_BLOCK_TOKENS  # above every prompt token
    arrivals = deque(
        sorted(range(len(requests)), key=lambda index: (requests[index].timestamp, index))
    )
    running: dict[int, int] = {}  # request id -> tokens still to decode
    while arrivals or running:
        while arrivals and len(running) < max_running:
            index = arrivals.popleft()
            yield ("admit", index, requests[index].prompt_tokens())
            running[index] = requests[index].decode_tokens(output_cap)
        for rid in list(running):
            yield ("decode", rid, fresh)
            fresh += 1
            running[rid] -= 1
            if running[rid] == 0:
                del running[rid]
                yield ("finish", rid)


def make_trace(
    path: str | os.PathLike[str],
    num_requests: int | None = None,
    *,
    max_running: int = DEFAULT_MAX_RUNNING,
    output_cap: int = DEFAULT_OUTPUT_CAP,
) -> Iterator[tuple]:
    """The events of the first ``num_requests`` requests of the trace at ``path`` (all when
    ``None``); every row taken is validated before the first event."""
    requests = read_mooncake_trace(path, num_requests)
    return trace_events(requests, max_running=max_running, output_cap=output_cap)
