"""A deterministic request trace for benchmarking and simulating KV-cache block allocators.

Copied, behaviour unchanged, from the project's shared benchmark generator
(``shared/bench/request_trace.py``) so that the package works without that folder; the same
seed yields exactly the same events in both.

Events::

    ("admit", request_id, prompt_tokens)   a request arrives with its whole prompt
    ("decode", request_id, token)          one generated token is appended to a running request
    ("finish", request_id)                 the request ends; its blocks are freed

Scheduling is a simple round loop: admit requests until ``max_running`` run, then every
running request decodes one token per round, and a request finishes once it has produced its
output length. 60% of prompts start with one of ``num_prefixes`` shared system prompts (so a
prefix cache has real hits); the rest are unique. All randomness comes from
``random.Random(seed)``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

#: Token ids are drawn from ``range(VOCAB)``.
VOCAB = 151_936


def make_trace(
    seed: int = 0,
    num_requests: int = 2000,
    max_running: int = 64,
    num_prefixes: int = 20,
    shared_fraction: float = 0.6,
) -> Iterator[tuple]:
    """Yield the trace's events in order (see the module docstring)."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(VOCAB) for _ in range(rng.randint(256, 4096))] for _ in range(num_prefixes)
    ]
    running: dict[int, int] = {}  # request id -> output tokens still to produce
    next_id = 0
    while next_id < num_requests or running:
        while next_id < num_requests and len(running) < max_running:
            if rng.random() < shared_fraction:
                prompt = list(rng.choice(prefixes))
                prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(64, 2048))]
            else:
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(128, 4096))]
            running[next_id] = rng.randint(32, 256)
            yield ("admit", next_id, prompt)
            next_id += 1
        for rid in list(running):
            yield ("decode", rid, rng.randrange(VOCAB))
            running[rid] -= 1
            if running[rid] == 0:
                del running[rid]
                yield ("finish", rid)
