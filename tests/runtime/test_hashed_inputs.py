"""What a prefix hit is keyed by is checked, so that no two requests whose K/V differ can
share blocks (found by review: each case below was a false prefix hit, in both twins)."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from runtime_testkit import full, make_allocator

from kvspec_core.context import SizingContext
from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import KVCacheAllocator, MultiModalInput, PrefixHasher, Request
from kvspec_core.specs.encoder import CrossAttentionSpec

TOKENS = list(range(100, 117))


def served(allocator: KVCacheAllocator, request: Request) -> int:
    """Admit ``request`` whole after its lookup; its hit tokens."""
    prefix = allocator.find_cached_prefix(request)
    assert allocator.allocate_slots(
        request, len(request.token_ids) - prefix.num_tokens, prefix=prefix
    )
    return prefix.num_tokens


@pytest.mark.parametrize("identifier", [3, 0, False, None, [104, 105], 1.5, -7])
def test_an_identifier_that_is_no_str_or_bytes_is_refused(identifier: object) -> None:
    # 3 hashed as b"\0\0\0", False as b"", [104, 105] as b"hi": other images, one hash.
    with pytest.raises(AllocatorError, match=r"identifier is of type .* must be a str or bytes"):
        MultiModalInput(offset=0, length=4, identifier=identifier)  # type: ignore[arg-type]


@pytest.mark.parametrize(("offset", "length"), [(0.0, 4), (0, 4.0), (2**64, 4), (0, 0), (-1, 4)])
def test_a_placeholder_range_that_is_no_int_range_is_refused(
    offset: object, length: object
) -> None:
    with pytest.raises(AllocatorError, match="offset must be an int >= 0 and length an int > 0"):
        MultiModalInput(offset=offset, length=length, identifier="cat")  # type: ignore[arg-type]


def test_inputs_that_are_no_multimodal_input_are_refused() -> None:
    # A duck-typed item of length 0 left its image out of the hash.
    duck = types.SimpleNamespace(offset=0, length=0, identifier="cat")
    with pytest.raises(AllocatorError, match="mm_inputs holds a SimpleNamespace"):
        Request("r", list(TOKENS), mm_inputs=[duck])  # type: ignore[list-item]

    class Subclass(str):
        def encode(self, *args: object, **kwargs: object) -> bytes:
            return b"same for every image"

    with pytest.raises(AllocatorError, match="identifier is of type Subclass"):
        MultiModalInput(offset=0, length=4, identifier=Subclass("cat"))


@pytest.mark.parametrize("salt", [12345, 0, False, [1, 2], "fleet", memoryview(b"ab")])
def test_a_hash_salt_that_is_no_bytes_is_refused(salt: object) -> None:
    # bytes(12345) is 12345 zero bytes: a salt anyone can reproduce; 0, False and b"" one.
    with pytest.raises(AllocatorError, match=r"hash_salt=.* must be bytes"):
        PrefixHasher(4, salt=salt)  # type: ignore[arg-type]
    PrefixHasher(4, salt=bytearray(b"ab"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("token_ids", [1, 2, 3]),
        ("cache_salt", "tenant-b"),
        ("lora_name", "adapter"),
        ("mm_inputs", (MultiModalInput(offset=0, length=4, identifier="dog"),)),
    ],
)
def test_a_hashed_field_cannot_be_replaced_once_hashed(field: str, value: object) -> None:
    allocator = make_allocator([full(4)], 32)
    request = Request("r", list(TOKENS))
    setattr(request, field, value)  # before hashing: allowed
    request = Request("r", list(TOKENS))
    allocator.find_cached_prefix(request)
    with pytest.raises(AllocatorError, match=f"{field} cannot be replaced once the request"):
        setattr(request, field, value)


def test_a_copy_starts_without_the_originals_hashes() -> None:
    allocator = make_allocator([full(4)], 32)
    original = Request("r", list(TOKENS))
    assert served(allocator, original) == 0
    allocator.free("r")
    edited = copy.copy(original)
    edited.token_ids = [7] * len(TOKENS)  # the copy's own fields, not yet hashed
    assert edited.block_hashes is not original.block_hashes
    assert allocator.find_cached_prefix(edited).num_tokens == 0


def test_encoder_tokens_without_a_group_to_hold_them_are_refused() -> None:
    # Found by review: the decoder's K/V depend on the encoder input, which no hash covers;
    # with no group holding encoder tokens, two requests with other audio and the same
    # decoder prompt shared blocks.
    attention = dict(num_kv_heads=1, head_size=8, dtype=torch.float16, block_size=4)
    for specs, ctx in (
        ([full(4)], SizingContext(max_model_len=64)),
        ([full(4), CrossAttentionSpec(**attention)], SizingContext(max_model_len=64)),
    ):
        allocator = make_allocator(specs, 32, ctx=ctx)
        request = Request("a", list(TOKENS), num_encoder_tokens=30)
        with pytest.raises(AllocatorError, match="num_encoder_tokens=30, but no group"):
            served(allocator, request)
        allocator.check_invariants()
        assert served(allocator, Request("b", list(TOKENS))) == 0


def test_a_resumed_request_of_a_prompt_only_group_hits_no_further_than_its_prompt() -> None:
    # R-SWA: positions past a request's prompt hold K/V computed as generated tokens; a
    # request that had them as its prompt cached other K/V there.
    from kvspec_sliding_window.specs import ReferenceSlidingWindowSpec

    rswa = ReferenceSlidingWindowSpec(
        block_size=4, rswa_window=2, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    allocator = make_allocator([rswa], 64)
    served(allocator, Request("a", list(TOKENS)))
    allocator.free("a")
    resumed = Request("c", list(TOKENS), num_prompt_tokens=6)
    assert allocator.find_cached_prefix(resumed).num_tokens == 4
    assert served(allocator, Request("d", list(TOKENS))) == 16
