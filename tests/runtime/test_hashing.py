"""Prefix hashes: chained, salted per process and per tenant, adapters and images mixed in."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import MultiModalInput, PrefixHasher, Request
from kvspec_core.runtime.hashing import DIGEST_SIZE, PROCESS_SALT


def hashes(tokens: list[int], hasher: PrefixHasher | None = None, **request: object) -> list:
    hasher = hasher or PrefixHasher(4, salt=b"s")
    return list(hasher.hashes(Request("r", list(tokens), **request), len(tokens)))  # type: ignore[arg-type]


@settings(max_examples=40)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(0, 40))
def test_hashes_are_chained_over_full_blocks_only(tokens: list[int], cut: int) -> None:
    full = hashes(tokens)
    assert len(full) == len(tokens) // 4
    assert all(len(digest) == DIGEST_SIZE for digest in full)
    # A prefix hashes to a prefix; hashing in steps equals hashing at once.
    assert hashes(tokens[:cut]) == full[: min(cut, len(tokens)) // 4]
    hasher = PrefixHasher(4, salt=b"s")
    request = Request("r", list(tokens))
    hasher.hashes(request, cut)
    assert list(hasher.hashes(request, len(tokens))) == full


def test_one_changed_token_changes_its_block_and_every_later_one() -> None:
    base = hashes(list(range(16)))
    changed = hashes(list(range(5)) + [99] + list(range(6, 16)))
    assert changed[0] == base[0]
    assert all(a != b for a, b in zip(changed[1:], base[1:], strict=True))


def test_salts_separate_processes_tenants_and_adapters() -> None:
    tokens = list(range(8))
    assert hashes(tokens) != hashes(tokens, PrefixHasher(4, salt=b"t"))
    assert hashes(tokens, cache_salt="tenant-a") != hashes(tokens, cache_salt="tenant-b")
    assert hashes(tokens, cache_salt="tenant-a") != hashes(tokens)
    assert hashes(tokens, lora_name="adapter") != hashes(tokens)
    # No ambiguity between fields: the tenant and the adapter are length-prefixed apart.
    assert hashes(tokens, cache_salt="ab", lora_name=None) != hashes(
        tokens, cache_salt="a", lora_name="b"
    )


def test_default_salt_is_random_per_process_and_shared_inside_it() -> None:
    assert len(PROCESS_SALT) == 32
    assert hashes(list(range(8)), PrefixHasher(4)) == hashes(list(range(8)), PrefixHasher(4))


def test_images_change_the_blocks_they_overlap_and_all_later_ones() -> None:
    tokens = [0] * 16
    cat = hashes(tokens, mm_inputs=[MultiModalInput(offset=5, length=2, identifier="cat")])
    dog = hashes(tokens, mm_inputs=[MultiModalInput(offset=5, length=2, identifier="dog")])
    plain = hashes(tokens)
    assert cat[0] == dog[0] == plain[0]
    assert cat[1] != dog[1] and cat[1] != plain[1]
    assert cat[3] != dog[3]


@pytest.mark.parametrize("bad", [-1, 2**32, "7", 1.5])
def test_tokens_that_cannot_be_packed_are_refused(bad: object) -> None:
    with pytest.raises(AllocatorError, match="token ids"):
        hashes([1, 2, 3, bad])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("tokens", "named"),
    [
        # Found by review: the pure-Python twin read every token's int before checking any
        # range, so it named a later token of another type than the compiled kernel.
        ([-1, 1.5, 0, 0], "token 0 is -1"),
        ([2**40, "x", 0, 0], "token 0 is 1099511627776"),
        ([0, 0, 0, Decimal(1)], "token 3 is <a Decimal>"),
    ],
)
def test_the_first_bad_token_is_named(tokens: list[object], named: str) -> None:
    with pytest.raises(AllocatorError, match=named):
        hashes(tokens)  # type: ignore[arg-type]


def test_a_request_hashed_by_another_hasher_is_rehashed() -> None:
    request = Request("r", list(range(8)))
    first = list(PrefixHasher(4, salt=b"a").hashes(request, 8))
    second = list(PrefixHasher(4, salt=b"b").hashes(request, 8))
    assert first != second and len(second) == 2


def test_invalid_requests_and_multimodal_inputs_are_refused() -> None:
    with pytest.raises(AllocatorError, match="token_ids must be a list"):
        Request("r", (1, 2))  # type: ignore[arg-type]
    with pytest.raises(AllocatorError, match="length=0"):
        MultiModalInput(offset=0, length=0, identifier="x")
    with pytest.raises(AllocatorError, match="hash_block_size"):
        PrefixHasher(0)
    for bad in (-1, 3, True, 1.0):
        with pytest.raises(AllocatorError, match="num_prompt_tokens="):
            Request("r", [1, 2], num_prompt_tokens=bad)  # type: ignore[arg-type]
    assert Request("r", [1, 2]).num_prompt_tokens == 2
    assert Request("r", [1, 2], num_prompt_tokens=1).num_prompt_tokens == 1


def test_a_hasher_remembers_roots_per_tenant_and_adapter_without_mixing_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvspec_core.runtime import hashing

    monkeypatch.setattr(hashing, "_ROOTS_KEPT", 2)  # forgetting is exercised too
    shared = PrefixHasher(4, salt=b"s")
    tokens = list(range(8))
    for salt, lora in [
        ("a", None),
        ("b", None),
        ("a", None),
        (None, "x"),
        (None, None),
        (b"a", None),
        (bytearray(b"a"), None),
        ("a", "x"),
        ("a", None),
    ]:
        assert hashes(tokens, shared, cache_salt=salt, lora_name=lora) == hashes(
            tokens, cache_salt=salt, lora_name=lora
        )
    assert len(shared._roots) <= 2
