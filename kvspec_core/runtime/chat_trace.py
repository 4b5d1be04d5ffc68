"""A deterministic multi-turn chat trace for benchmarking KV-cache block allocators.

Copied, behaviour unchanged, from the project's shared benchmark generator
(``shared/bench/chat_trace.py``) so that the package and its tests work without that folder;
the same seed yields exactly the same events in both. Same event format and
``make_trace(seed=..., num_requests=...)`` entry point as :mod:`kvspec_core.runtime.trace`::

    ("admit", request_id, prompt_tokens)   a request arrives with its whole prompt
    ("decode", request_id, token)          one generated token is appended to a running request
    ("finish", request_id)                 the request ends; its blocks are freed

Workload: chat conversations interleaved in time. A conversation opens with one of 20 system
prompts (100-600 tokens, Zipf popularity), plans 1-12 turns; turn k's prompt is the whole
conversation so far (system prompt, earlier user messages, earlier outputs exactly as decoded)
plus a new user message of 20-400 tokens, and generates 20-500 tokens. Between turns the user
"thinks" for 10-300 rounds (~64 decode events each); ~64 requests run at once. A turn whose
prompt would exceed 7,000 tokens ends the conversation. Seed 0, 3,000 requests: 777,420
events, 6,511,839 prompt tokens, ideal reusable 5,886,542 tokens (5,863,616 at 16-token
blocks).

:func:`trace_stats` works on any trace of this event format (the request trace too): for
each prompt, the longest prefix already seen as a prefix of an earlier prompt or of an
earlier request's prompt + output (capped at prompt length - 1, since the last prompt token
is always computed), also floored to whole blocks: what a block-granular prefix cache can
reach at best.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

VOCAB = 151_936


class _Conversation:
    __slots__ = ("history", "next_user_len", "turns_left")

    def __init__(self, history: list[int], turns: int, user_len: int) -> None:
        self.history = history
        self.turns_left = turns
        self.next_user_len = user_len


def make_trace(
    seed: int = 0,
    num_requests: int = 3000,
    max_running: int = 64,
    num_system_prompts: int = 20,
    system_tokens: tuple[int, int] = (100, 600),
    zipf_s: float = 1.0,
    turns: tuple[int, int] = (1, 12),
    user_tokens: tuple[int, int] = (20, 400),
    output_tokens: tuple[int, int] = (20, 500),
    think_rounds: tuple[int, int] = (10, 300),
    max_prompt_tokens: int = 7000,
) -> Iterator[tuple]:
    """Yield the trace's events in order (see the module docstring)."""
    rng = random.Random(seed)
    randint = rng.randint
    randrange = rng.randrange
    systems = [
        [randrange(VOCAB) for _ in range(randint(*system_tokens))]
        for _ in range(num_system_prompts)
    ]
    cum_weights = list(
        itertools.accumulate(1.0 / (rank + 1) ** zipf_s for rank in range(num_system_prompts))
    )
    running: dict[int, tuple[_Conversation, int]] = {}  # rid -> (conversation, tokens left)
    thinking: list[tuple[int, int, _Conversation]] = []  # (ready round, tie-break, conv)
    ready: deque[_Conversation] = deque()
    tie = itertools.count()
    next_id = 0
    round_no = 0
    while next_id < num_requests or running:
        while thinking and thinking[0][0] <= round_no:
            ready.append(heapq.heappop(thinking)[2])
        while next_id < num_requests and len(running) < max_running:
            if ready:
                conv = ready.popleft()
            else:
                system = rng.choices(range(num_system_prompts), cum_weights=cum_weights)[0]
                conv = _Conversation(list(systems[system]), randint(*turns), randint(*user_tokens))
            prompt = conv.history + [randrange(VOCAB) for _ in range(conv.next_user_len)]
            conv.history = prompt.copy()  # decode tokens are appended to the history only
            running[next_id] = (conv, randint(*output_tokens))
            yield ("admit", next_id, prompt)
            next_id += 1
        for rid in list(running):
            conv, left = running[rid]
            token = randrange(VOCAB)
            conv.history.append(token)
            yield ("decode", rid, token)
            if left > 1:
                running[rid] = (conv, left - 1)
                continue
            del running[rid]
            yield ("finish", rid)
            conv.turns_left -= 1
            if conv.turns_left <= 0:
                continue
            conv.next_user_len = randint(*user_tokens)
            if len(conv.history) + conv.next_user_len > max_prompt_tokens:
                continue  # the next prompt would not fit: the conversation ends
            heapq.heappush(thinking, (round_no + randint(*think_rounds), next(tie), conv))
        round_no += 1


# ----------------------------------------------------------------------------- statistics
def _common_length(a: Sequence[int], ai: int, b: Sequence[int], bi: int, n: int) -> int:
    """Length of the longest common run of ``a[ai:ai+n]`` and ``b[bi:bi+n]``."""
    if a[ai : ai + n] == b[bi : bi + n]:
        return n
    lo, hi = 0, n  # a common run of lo tokens exists, one of hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[ai : ai + mid] == b[bi : bi + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _RadixTree:
    """Token sequences seen so far; answers the longest prefix of a query seen before."""

    def __init__(self) -> None:
        self.root: dict[int, list] = {}  # first token -> [sequence, start, end, child edges]

    def longest_prefix(self, seq: Sequence[int]) -> int:
        edges, i, n = self.root, 0, len(seq)
        while i < n:
            edge = edges.get(seq[i])
            if edge is None:
                return i
            label, start, end, child = edge
            length = end - start
            matched = _common_length(seq, i, label, start, min(length, n - i))
            i += matched
            if matched < length:
                return i
            edges = child
        return i

    def insert(self, seq: Sequence[int]) -> None:
        edges, i, n = self.root, 0, len(seq)
        while i < n:
            edge = edges.get(seq[i])
            if edge is None:
                edges[seq[i]] = [seq, i, n, {}]
                return
            label, start, end, child = edge
            length = end - start
            matched = _common_length(seq, i, label, start, min(length, n - i))
            if matched == length:
                edges, i = child, i + length
                continue
            split = start + matched  # the edge's label diverges (or seq ends) here
            edge[2], edge[3] = split, {label[split]: [label, split, end, child]}
            i += matched
            if i < n:
                edge[3][seq[i]] = [seq, i, n, {}]
            return


def trace_stats(events: Iterable[tuple], block_sizes: Sequence[int] = (16, 80)) -> dict:
    """Counts and ideal reuse of a trace (see the module docstring)."""
    counts = {"admit": 0, "decode": 0, "finish": 0}
    prompt_tokens = output_tokens = ideal = longest = 0
    ideal_floored = dict.fromkeys(block_sizes, 0)
    seen = _RadixTree()
    prompts: dict[object, list[int]] = {}
    outputs: dict[object, list[int]] = {}
    for event in events:
        kind = event[0]
        counts[kind] += 1
        if kind == "decode":
            outputs[event[1]].append(event[2])
        elif kind == "admit":
            prompt = list(event[2])
            prompt_tokens += len(prompt)
            longest = max(longest, len(prompt))
            reusable = min(seen.longest_prefix(prompt), len(prompt) - 1)
            ideal += reusable
            for size in block_sizes:
                ideal_floored[size] += reusable // size * size
            seen.insert(prompt)
            prompts[event[1]] = prompt
            outputs[event[1]] = []
        else:
            rid = event[1]
            output = outputs.pop(rid)
            output_tokens += len(output)
            seen.insert(prompts.pop(rid) + output)
    return {
        "requests": counts["admit"],
        "events": sum(counts.values()),
        "event_counts": counts,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "longest_prompt": longest,
        "ideal_reusable_prefix_tokens": ideal,
        "ideal_reusable_fraction": ideal / prompt_tokens if prompt_tokens else 0.0,
        **{f"ideal_reusable_at_block_{size}": value for size, value in ideal_floored.items()},
    }
