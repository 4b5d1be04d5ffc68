"""A hostile key in a pool's ``__dict__`` cannot make a kernel read freed memory (found by
review: ``kv_pool_cache``, ``kv_pool_release``, the compiled admission's hit checks held
attributes borrowed across the next attribute lookup, whose key comparison can run Python
code that replaces an attribute already read; AddressSanitizer saw the freed dict read).

Here each such key, when compared with the name it collides with, replaces another of the
pool's attributes by a copy (same content, new object: the old one is freed unless a kernel
holds it). The workload must run to its end (a step may raise: the hostile code split the pool's
state); what it catches it catches under ``scripts/asan-kernels`` (``.ci/run`` runs this
file there), where reading freed memory aborts the process."""

from __future__ import annotations

import copy

import pytest
from runtime_testkit import full, make_allocator

from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.runtime.native import native

#: The pool attributes the kernels read through its __dict__ (pool_access.c's names).
POOL_NAMES = (
    "_fresh",
    "ref_counts",
    "_evictable",
    "_protected",
    "caches",
    "_block_hash",
    "_reused",
    "epoch",
)


class Replacer:
    """A dict key hashing like ``trigger`` that, compared with it while armed, replaces
    ``victim`` in ``namespace`` by a copy."""

    def __init__(self, namespace: dict, trigger: str, victim: str) -> None:
        self.namespace, self.trigger, self.victim = namespace, trigger, victim
        self.armed = False
        self.fired = 0

    def __hash__(self) -> int:
        return hash(self.trigger)

    def __eq__(self, other: object) -> bool:
        if self.armed and other == self.trigger:
            self.fired += 1
            value = self.namespace[self.victim]
            self.namespace[self.victim] = (
                {key: dict(inner) for key, inner in value.items()}
                if self.victim == "caches"
                else copy.copy(value)
            )
            # Fill the dict and list free lists first, so the old object goes back to the
            # allocator (where AddressSanitizer sees it freed), not to a free list.
            filler = [({}, []) for _ in range(200)]
            del filler, value
        return False


def workload(allocator: KVCacheAllocator, keys: list[Replacer]) -> int:
    """Admissions with and without hits, decodes across block boundaries, frees; how many
    steps raised. A replaced attribute splits the pool's state (what a kernel or method
    wrote to the old object is not in the new one), so a step may raise (a Python
    exception: the hostile code broke the pool); it must not crash or read freed memory."""
    prompts = ([1, 2, 3, 4, 5], [1, 2, 3, 4, 9], [7, 7, 7, 7], [1, 2, 3, 4, 5, 6])
    raised = 0
    for round_ in range(3):
        for number, tokens in enumerate(prompts):
            request = Request(f"r{round_}-{number}", list(tokens))
            for key in keys:
                key.armed = True
            try:
                prefix = allocator.find_cached_prefix(request)
                if allocator.allocate_slots(
                    request, len(tokens) - prefix.num_tokens, prefix=prefix
                ):
                    for token in (11, 12, 13):
                        request.append_token(token)
                        allocator.allocate_slots(request, 1)
                    allocator.free(request.request_id)
            except Exception:
                raised += 1
            finally:
                for key in keys:
                    key.armed = False
    return raised


@pytest.mark.skipif(native is None, reason="the compiled kernels are not built")
@pytest.mark.both_kernels  # the compiled kernels only: their memory safety is the subject
@pytest.mark.parametrize("trigger", POOL_NAMES)
def test_a_hostile_pool_dict_key_frees_nothing_a_kernel_still_reads(trigger: str) -> None:
    allocator = make_allocator([full(2)], 12)
    pool = allocator.pools[0]
    namespace = dict(pool.__dict__)
    keys = [Replacer(namespace, trigger, victim) for victim in POOL_NAMES if victim != trigger]
    # The keys first: a lookup of ``trigger`` compares with them before its own entry.
    hostile = {key: None for key in keys}
    hostile.update(namespace)
    pool.__dict__ = hostile
    for key in keys:
        key.namespace = pool.__dict__
    raised = workload(allocator, keys)
    assert any(key.fired for key in keys)
    assert raised < 12  # some steps ran through the hostile lookups
