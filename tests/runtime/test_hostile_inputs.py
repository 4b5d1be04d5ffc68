"""Hostile and careless inputs (issue 18, items 1-3): objects whose ``__hash__``, ``__eq__``
or ``__index__`` run code that changes what a kernel is reading, ids and salts that are
ambiguous, prefixes the allocator did not hand out. The answer is a clean
:class:`AllocatorError` (or what the pure-Python code answers), never a crash, never a
false hit, and both paths (the conftest runs each test with the compiled kernels and with
``KVSPEC_PURE_PYTHON=1``) give the same answer.

The memory-safety cases run in a subprocess: a segfault there fails the test instead of
killing pytest.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest
from runtime_testkit import context, full, make_allocator, mamba, sliding

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import CachedPrefix, NotNow, Request

_HERE = Path(__file__).parent

#: What every subprocess case starts with: the test kit, a report of how the case ended, and
#: a salt and an id whose ``__hash__`` runs ``action`` once (when it is set).
_PRELUDE = """
import sys
sys.path.insert(0, {here!r})
from runtime_testkit import context, full, make_allocator, sliding
from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import Request

def outcome(action):
    try:
        print("answer", action())
    except AllocatorError as error:
        print("AllocatorError", error)

def run_once(owner):
    action, owner.action = owner.action, None
    if action is not None:
        action()

class Salt(str):
    action = None
    def __hash__(self):
        run_once(Salt)
        return 1

class Id:
    action = None
    def __hash__(self):
        run_once(Id)
        return hash("running")
    def __eq__(self, other):
        return False

def replace_tokens():
    request.token_ids = [7]
"""


def run_case(body: str, runtime_kernels: str) -> str:
    """Run ``body`` after the prelude in a fresh interpreter (kernels on or off as this
    test's parametrization says); its output. A crash fails the test."""
    env = dict(os.environ)
    env.pop("KVSPEC_PURE_PYTHON", None)
    if runtime_kernels == "python":
        env["KVSPEC_PURE_PYTHON"] = "1"
    script = _PRELUDE.format(here=str(_HERE)) + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        cwd=_HERE,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"the case exited with {done.returncode} (a negative number is a signal: "
        f"{(done.returncode == -11 and 'SIGSEGV') or ''})\nstdout:\n{done.stdout}\n"
        f"stderr:\n{done.stderr[-3000:]}"
    )
    return done.stdout


# ----------------------------------------------------------------- item 1: memory safety
# Token lists of 100,000 ids live in their own mappings, unmapped when freed: reading one
# after the salt's __hash__ dropped it faults.
_SALT_DROPS_HASHES = """
allocator = make_allocator([full(4)], 64)
request = Request("r", list(range(40)), cache_salt=Salt("tenant"))
Salt.action = lambda: setattr(request, "block_hashes", [])
outcome(lambda: allocator.find_cached_prefix(request))
"""

_SALT_REPLACES_TOKENS_FIND = """
allocator = make_allocator([full(4)], 64)
request = Request("r", list(range(100_000)), cache_salt=Salt("tenant"))
Salt.action = replace_tokens
outcome(lambda: allocator.find_cached_prefix(request))
"""

# The first decode step that completes a block hashes the request for the first time.
_SALT_REPLACES_TOKENS_GROW = """
allocator = make_allocator([full(4)], 64)
request = Request("r", [1, 2], cache_salt=Salt("tenant"))
print("admitted", bool(allocator.allocate_slots(request, 2)))
request.token_ids.extend(range(3, 100_000))
Salt.action = replace_tokens
outcome(lambda: allocator.allocate_slots(request, 2))
print("computed", allocator.num_computed_tokens("r"))
"""

_SALT_REPLACES_TOKENS_ADMIT = """
allocator = make_allocator([sliding(4, 8), full(4)], 256, ctx=context(max_model_len=128))
request = Request("r", list(range(100_000)), cache_salt=Salt("tenant"))
Salt.action = replace_tokens
outcome(lambda: allocator.allocate_slots(request, 16))
print("running", allocator.num_running)
"""

# Its second __hash__ (the admission's lookup) replaces the id while a running request's id
# has the same hash: the lookup compares against a freed object.
_ID_REPLACED_UNDER_COLLISION = """
allocator = make_allocator([full(4)], 64)
allocator.allocate_slots(Request("running", list(range(8))), 8)
request = Request(Id(), list(range(8)))
Id.action = lambda: setattr(Id, "action", lambda: setattr(request, "request_id", "other"))
outcome(lambda: allocator.allocate_slots(request, 8))
print("running", allocator.num_running)
"""

_ID_REPLACES_TOKENS_FIND = """
allocator = make_allocator([full(4)], 64)
request = Request(Id(), list(range(100_000)))
Id.action = replace_tokens
outcome(lambda: allocator.find_cached_prefix(request))
"""


@pytest.mark.parametrize(
    "case",
    [
        _SALT_DROPS_HASHES,
        _SALT_REPLACES_TOKENS_FIND,
        _SALT_REPLACES_TOKENS_GROW,
        _SALT_REPLACES_TOKENS_ADMIT,
        _ID_REPLACED_UNDER_COLLISION,
        _ID_REPLACES_TOKENS_FIND,
    ],
    ids=[
        "salt-drops-hashes",
        "salt-replaces-tokens-find",
        "salt-replaces-tokens-grow",
        "salt-replaces-tokens-admit",
        "id-replaced-under-collision",
        "id-replaces-tokens-find",
    ],
)
def test_code_run_by_a_hash_is_refused_cleanly_not_crashed(case: str, runtime_kernels: str) -> None:
    # Salts and ids of other types than str / bytes / int would run such code in the middle
    # of a step: they are refused before it runs (a clean error, nothing changed).
    output = run_case(case, runtime_kernels)
    assert "AllocatorError" in output, output
    assert "must be" in output, output
    if "running " in output:
        assert output.split("running ")[-1].strip() == ("1" if "Id" in case else "0")
    if "computed " in output:
        assert output.split("computed ")[-1].strip() == "2"  # the refused step changed nothing


def test_a_hash_owner_whose_release_replaces_the_tokens_does_not_crash(
    runtime_kernels: str,
) -> None:
    # A request last hashed by another hasher drops its old owner when this one hashes it:
    # the old owner's __del__ runs then, and here replaces the token list being read.
    output = run_case(
        """
        class Owner:
            def __del__(self):
                request.token_ids = [7]

        allocator = make_allocator([full(4)], 64)
        request = Request("r", list(range(100_000)))
        request._hash_owner = Owner()
        outcome(lambda: allocator.find_cached_prefix(request).num_tokens)
        print("hashes", len(request.block_hashes))
    """,
        runtime_kernels,
    )
    # The replacement is refused (the request is being hashed: a hashed field is fixed), so
    # the hashes are of the list the request still holds, 100,000 tokens (both paths).
    assert output.split() == ["answer", "0", "hashes", "24999"], output


def test_hostile_objects_in_the_pool_kernels_are_refused_not_crashed(runtime_kernels: str) -> None:
    # The pool kernels are public functions of the compiled module: a block id that is no
    # exact int is refused, and a key whose code drops the value a lookup just returned
    # (the digest's __del__, run when the kernel releases it) must not leave the kernel
    # holding freed memory.
    if runtime_kernels == "python":
        pytest.skip("the compiled module's own functions")
    output = run_case(
        """
        from kvspec_core.runtime.native import native as kernels

        class Block:
            def __index__(self):
                return 1

        try:
            kernels.count_unreferenced([Block()], [0] * 8)
        except TypeError as error:
            print("refused", error)

        class Key:
            def __hash__(self):
                return 1
            def __eq__(self, other):
                digests.clear()  # the digest looked up is now held by the kernel only
                return True

        class Digest:
            def __hash__(self):
                return 1
            def __eq__(self, other):
                return NotImplemented
            def __del__(self):
                cache.clear()  # releases the value the lookup just returned

        cache = {Key(): 10**40 + 7}
        digests = [Digest()]
        found = kernels.longest_hit(digests, cache, 4)
        junk = [10**40 + i for i in range(1000)]
        print("hit", found == [10**40 + 7])
    """,
        runtime_kernels,
    )
    assert "refused block ids must be ints" in output and "hit True" in output, output


# ----------------------------------------------------------------- item 2: same answers
class RaisingToken:
    def __index__(self) -> int:
        raise RuntimeError("no index")


class SwappingToken:
    """A token whose ``__index__`` rewrites the list it sits in."""

    def __init__(self, tokens: list[object]) -> None:
        self.tokens = tokens

    def __index__(self) -> int:
        self.tokens[0:4] = [100, 101, 102, 103]
        return 5


class CollidingId:
    """A request id that collides with a running id's hash and whose ``__eq__`` raises."""

    def __init__(self, twin: object) -> None:
        self.twin = twin

    def __hash__(self) -> int:
        return hash(self.twin)

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no eq")


@pytest.mark.parametrize(
    "request_id",
    [math.nan, CollidingId("r0"), ["list"], 1.0, True, b"r"],
    ids=["nan", "eq-raises", "unhashable", "float", "bool", "bytes"],
)
def test_request_ids_other_than_str_and_int_are_refused_before_anything_changes(
    request_id: object,
) -> None:
    allocator = make_allocator([full(4)], 64)
    assert allocator.allocate_slots(Request("r0", list(range(8))), 8)
    before = allocator.usage
    request = Request(request_id, list(range(12)))  # type: ignore[arg-type]
    with pytest.raises(AllocatorError, match=r"request_id=.* must be a str or an int"):
        allocator.find_cached_prefix(request)
    with pytest.raises(AllocatorError, match=r"request_id=.* must be a str or an int"):
        allocator.allocate_slots(request, 12)
    genuine = allocator.find_cached_prefix(Request("x", list(range(12))))
    forged = attrs.evolve(genuine, request_id=request_id)
    with pytest.raises(AllocatorError, match=r"request_id=.* must be a str or an int"):
        allocator.allocate_slots(request, 4, prefix=forged)
    assert allocator.usage == before and allocator.num_running == 1
    allocator.check_invariants()


def test_a_token_whose_index_raises_is_refused_and_nothing_changes() -> None:
    allocator = make_allocator([full(4)], 64)
    request = Request("r", [1, 2, 3, RaisingToken(), 5, 6, 7, 8, 9])  # type: ignore[list-item]
    with pytest.raises(AllocatorError, match=r"token 3 is .* not an int in \[0, 2\*\*32\)"):
        allocator.find_cached_prefix(request)
    with pytest.raises(AllocatorError, match=r"token 3 is .* not an int in \[0, 2\*\*32\)"):
        allocator.allocate_slots(request, 9)
    assert allocator.num_running == 0 and request.block_hashes == []
    assert allocator.usage.used_blocks == 0
    allocator.check_invariants()


def test_a_token_whose_index_rewrites_the_list_never_gives_a_false_hit() -> None:
    allocator = make_allocator([full(4)], 64)
    tokens: list[object] = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    tokens[5] = SwappingToken(tokens)
    request = Request("r", tokens)  # type: ignore[arg-type]
    with pytest.raises(AllocatorError, match="changed while they were hashed"):
        allocator.allocate_slots(request, 9)
    assert allocator.num_running == 0 and request.block_hashes == []
    # Whatever the list holds now, a request with those tokens finds nothing stale.
    twin = Request("twin", [100, 101, 102, 103, 1, 2, 3, 4, 9])
    assert allocator.find_cached_prefix(twin).num_tokens == 0


def test_index_tokens_that_behave_hash_as_their_values() -> None:
    class Token:
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    allocator = make_allocator([full(4)], 64)
    assert allocator.allocate_slots(Request("a", [Token(v) for v in range(9)]), 9)  # type: ignore[misc]
    assert allocator.find_cached_prefix(Request("b", list(range(9)))).num_tokens == 8


# ----------------------------------------------------------------- item 3: tenants
@pytest.mark.parametrize(
    "first, second", [("a", b"a"), (b"a", "a"), ("a", None), ("", None), (b"", None), ("", b"")]
)
def test_salts_of_different_types_never_share_cache_entries(first: object, second: object) -> None:
    allocator = make_allocator([full(4)], 64)
    prompt = list(range(20))
    assert allocator.allocate_slots(Request("a", prompt, cache_salt=first), 20)  # type: ignore[arg-type]
    same = allocator.find_cached_prefix(Request("b", prompt, cache_salt=first))  # type: ignore[arg-type]
    other = allocator.find_cached_prefix(Request("c", prompt, cache_salt=second))  # type: ignore[arg-type]
    assert same.num_tokens == 16
    assert other.num_tokens == 0


def test_bytearray_salts_are_the_bytes_tenant() -> None:
    allocator = make_allocator([full(4)], 64)
    prompt = list(range(20))
    assert allocator.allocate_slots(Request("a", prompt, cache_salt=b"t"), 20)
    found = allocator.find_cached_prefix(Request("b", prompt, cache_salt=bytearray(b"t")))  # type: ignore[arg-type]
    assert found.num_tokens == 16


@pytest.mark.parametrize(
    "field, value",
    [("cache_salt", 7), ("cache_salt", ("a",)), ("lora_name", b"x"), ("lora_name", 3)],
)
def test_salts_and_adapters_of_other_types_are_refused(field: str, value: object) -> None:
    allocator = make_allocator([full(4)], 64)
    request = Request("r", list(range(9)), **{field: value})  # type: ignore[arg-type]
    with pytest.raises(AllocatorError, match=f"{field}=.* must be"):
        allocator.find_cached_prefix(request)
    with pytest.raises(AllocatorError, match=f"{field}=.* must be"):
        allocator.allocate_slots(request, 9)
    assert allocator.num_running == 0 and allocator.usage.used_blocks == 0


def _two_running(specs: list, blocks: int = 128) -> tuple:
    allocator = make_allocator(specs, blocks, ctx=context(64, 64))
    victim = Request("victim", list(range(100, 140)))
    assert allocator.allocate_slots(victim, 40)
    prompt = list(range(40))
    seed = Request("seed", prompt)
    # Two steps: a state group saves a checkpoint where the first ends.
    assert allocator.allocate_slots(seed, 20) and allocator.allocate_slots(seed, 20)
    allocator.free("seed")
    request = Request("r", prompt)
    return allocator, request, allocator.find_cached_prefix(request)


@pytest.mark.parametrize(
    "specs",
    [[full(4)], [sliding(4, 8), full(4)], [mamba(4), full(4)]],
    ids=["full", "swa+full", "mamba+full"],
)
def test_forged_prefixes_are_refused_and_change_nothing(specs: list) -> None:
    allocator, request, genuine = _two_running(specs)
    assert genuine.num_tokens > 0
    victim_table = allocator.block_ids("victim")
    before = (allocator.usage, allocator.block_ids("victim"))
    forgeries = {
        "negative": attrs.evolve(genuine, num_tokens=-16, block_ids=victim_table),
        "another request's blocks": attrs.evolve(
            genuine,
            block_ids=tuple(
                table[: len(mine)]
                for table, mine in zip(victim_table, genuine.block_ids, strict=True)
            ),
        ),
        "more tokens than blocks": attrs.evolve(genuine, num_tokens=genuine.num_tokens + 4),
        "past the prompt": attrs.evolve(genuine, num_tokens=40),
        "out of range ids": attrs.evolve(
            genuine, block_ids=tuple(tuple(10**6 for _ in ids) for ids in genuine.block_ids)
        ),
        "null entries": attrs.evolve(
            genuine, block_ids=tuple(tuple(0 for _ in ids) for ids in genuine.block_ids)
        ),
        "not a prefix": object(),
        "wrong group count": attrs.evolve(genuine, block_ids=genuine.block_ids + ((),)),
        "strings": attrs.evolve(
            genuine, block_ids=tuple(tuple(str(b) for b in ids) for ids in genuine.block_ids)
        ),
    }
    for name, forged in forgeries.items():
        with pytest.raises(AllocatorError, match="prefix"):
            allocator.allocate_slots(request, 4, prefix=forged)
        assert (allocator.usage, allocator.block_ids("victim")) == before, name
        assert not allocator.is_running("r"), name
    allocator.check_invariants()
    assert allocator.allocate_slots(request, 40 - genuine.num_tokens, prefix=genuine)
    allocator.check_invariants()


def test_a_prefix_of_another_allocator_is_refused() -> None:
    first = make_allocator([full(4)], 64)
    second = make_allocator([full(4)], 64)
    prompt = list(range(20))
    assert first.allocate_slots(Request("a", prompt), 20)
    assert second.allocate_slots(Request("x", list(range(50, 70))), 20)
    request = Request("b", prompt)
    found = first.find_cached_prefix(request)
    assert found.num_tokens == 16
    # Its blocks hold other content there (same epochs): refused, never admitted.
    with pytest.raises(AllocatorError, match="prefix"):
        second.allocate_slots(Request("b", prompt), 4, prefix=found)
    assert not second.is_running("b")
    second.check_invariants()


def test_a_stale_prefix_is_still_not_now() -> None:
    allocator = make_allocator([full(4)], 8)
    prompt = list(range(20))
    assert allocator.allocate_slots(Request("a", prompt), 20)
    allocator.free("a")
    request = Request("b", prompt)
    found = allocator.find_cached_prefix(request)
    assert found.num_tokens == 16
    assert allocator.allocate_slots(Request("c", list(range(50, 78))), 28)  # evicts them
    result = allocator.allocate_slots(request, 4, prefix=found)
    assert isinstance(result, NotNow) and result.reason == "stale_prefix"


def test_check_invariants_catches_shared_blocks_of_different_prefixes() -> None:
    allocator = make_allocator([full(4)], 64)
    assert allocator.allocate_slots(Request("a", list(range(20))), 20)
    assert allocator.allocate_slots(Request("b", list(range(50, 70))), 20)
    allocator.check_invariants()
    # What a forged prefix did before: b's table names a's first blocks (counts consistent).
    pool = allocator.pools[0]
    shared = allocator._running["a"].blocks[0][:2]
    table_b = allocator._running["b"].blocks[0]
    own = table_b[:2]
    pool.touch(shared)
    table_b[:2] = shared
    pool._release_unchecked(own)
    pool.check_invariants()
    with pytest.raises(AllocatorError, match="hash"):
        allocator.check_invariants()


@pytest.mark.parametrize("call", ["free", "num_computed_tokens", "block_ids"])
def test_unhashable_ids_in_queries_raise_allocator_error(call: str) -> None:
    allocator = make_allocator([full(4)], 64)
    with pytest.raises(AllocatorError, match="request_id=<a list> must be a str or an int"):
        getattr(allocator, call)([1])


def test_a_prefix_from_an_earlier_lookup_still_works_after_others() -> None:
    # The semantic check accepts every prefix the allocator handed out for the request,
    # not only the latest one.
    allocator = make_allocator([full(4)], 64)
    prompt = list(range(20))
    assert allocator.allocate_slots(Request("a", prompt), 20)
    first = Request("b", prompt)
    found = allocator.find_cached_prefix(first)
    allocator.find_cached_prefix(Request("c", prompt))
    assert allocator.allocate_slots(first, 4, prefix=found)
    assert allocator.block_ids("b")[0][:4] == allocator.block_ids("a")[0][:4]
    allocator.check_invariants()


def test_prefix_type_check_names_what_was_passed() -> None:
    allocator = make_allocator([full(4)], 64)
    with pytest.raises(AllocatorError, match="CachedPrefix"):
        allocator.allocate_slots(Request("r", [1, 2]), 2, prefix=("not", "a", "prefix"))  # type: ignore[arg-type]
    assert isinstance(CachedPrefix, type)


# ----------------------------------------------------------------- found by the fuzzer
def test_another_request_object_with_a_running_id_never_caches_its_tokens() -> None:
    # The step is the running request's (its own token list), on both paths: the kernels
    # hashed and cached the passed object's tokens in its blocks, a false hit.
    allocator = make_allocator([full(4)], 64)
    assert allocator.allocate_slots(Request("a", [1, 2, 3]), 3)
    impostor = Request("a", list(range(50, 58)))
    allocator.allocate_slots(impostor, 5)
    allocator.check_invariants()
    assert allocator.find_cached_prefix(Request("x", list(range(50, 60)))).num_tokens == 0


@pytest.mark.parametrize("count", [2**62, 2**63 - 1])
def test_counts_past_any_length_are_not_now_not_a_negative_count(count: int) -> None:
    allocator = make_allocator([full(4)], 64)
    request = Request("r", [1, 2, 3])
    assert allocator.allocate_slots(request, 3)
    result = allocator.allocate_slots(request, count)
    assert isinstance(result, NotNow) and result.reason == "over_admission_cap"
    [stepped] = allocator.allocate_step([(request, count)])
    assert isinstance(stepped, NotNow) and stepped.reason == "over_admission_cap"
    assert allocator.num_computed_tokens("r") == 3


@pytest.mark.parametrize("lookahead", [2**63, 2**70])
def test_a_lookahead_past_any_length_reaches_max_model_len_on_both_paths(lookahead: int) -> None:
    allocator = make_allocator([full(4)], 64, ctx=context(32, 64))
    request = Request("r", [1, 2, 3])
    assert allocator.allocate_slots(request, 3)
    [decoded] = allocator.decode_step(["r"], [4], lookahead)
    assert decoded and len(allocator.block_ids("r")[0]) == 8  # max_model_len 32, blocks of 4
    [stepped] = allocator.allocate_step([request], lookahead)
    assert stepped is allocator.no_new_blocks


def test_decode_step_reads_its_lists_once() -> None:
    # A sampled token whose __index__ (run when its block is hashed) empties the list of
    # sampled tokens: the step goes on with what it was given.
    allocator = make_allocator([full(4)], 64)
    first, second = Request("a", [1, 2, 3]), Request("b", [5, 6, 7])
    assert allocator.allocate_slots(first, 3) and allocator.allocate_slots(second, 3)
    sampled: list[object] = []

    class Clears:
        def __index__(self) -> int:
            sampled.clear()
            return 4

    sampled += [Clears(), 8]
    results = allocator.decode_step(["a", "b"], sampled)  # type: ignore[arg-type]
    assert len(results) == 2 and second.token_ids == [5, 6, 7, 8]
    assert allocator.num_computed_tokens("a") == allocator.num_computed_tokens("b") == 4


def test_a_token_whose_index_rewrites_tokens_hashed_earlier_never_gives_a_false_hit() -> None:
    # The lookup hashed the first blocks; the admission hashes the block holding the token,
    # whose __index__ rewrites those first tokens: their hashes no longer describe the list.
    allocator = make_allocator([full(4)], 64)
    prompt: list[object] = list(range(1, 18))
    prompt += [SwappingToken(prompt), 19, 20]
    request = Request("r", prompt)  # type: ignore[arg-type]
    found = allocator.find_cached_prefix(request)
    with pytest.raises(AllocatorError, match="changed while they were hashed"):
        allocator.allocate_slots(request, 20, prefix=found)
    assert allocator.num_running == 0
    assert allocator.find_cached_prefix(Request("x", list(range(1, 21)))).num_tokens == 0


def test_a_handed_out_prefix_changed_in_place_is_checked_block_by_block() -> None:
    # An admission trusts a prefix it handed out only while it is the very object, each
    # field the very object find_cached_prefix put there: a field replaced in place (past
    # the frozen class) gets the full check, and is refused.
    allocator, request, genuine = _two_running([full(4)])
    victim_table = allocator.block_ids("victim")[0]
    object.__setattr__(genuine, "block_ids", (victim_table[: len(genuine.block_ids[0])],))
    with pytest.raises(AllocatorError, match="not one this allocator handed out"):
        allocator.allocate_slots(request, 4, prefix=genuine)
    assert not allocator.is_running("r")
    allocator.check_invariants()
