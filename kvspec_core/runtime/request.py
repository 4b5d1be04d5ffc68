"""What the allocator needs to know about one request: its tokens and what salts its hashes."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvspec_core.errors import AllocatorError


@attrs.frozen(kw_only=True)
class MultiModalInput:
    """A multimodal input whose placeholder tokens occupy ``[offset, offset + length)``.

    ``identifier`` (a content hash the engine computes, e.g. of the image bytes) is mixed
    into the hash of every block that overlaps the placeholder range, so two prompts with
    identical placeholder tokens but different images never share blocks.
    """

    offset: int
    length: int
    identifier: str

    def __attrs_post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise AllocatorError(
                f"MultiModalInput(offset={self.offset}, length={self.length}) is invalid: "
                "offset must be >= 0 and length > 0"
            )


class Request:
    """One request as the allocator sees it.

    ``token_ids`` is the request's own list: the engine appends generated tokens to it (or
    calls :meth:`append_token`) before asking for their slots. Block hashes are computed
    incrementally, only over full hash blocks, and cached here, so a token is hashed once
    in the request's lifetime.

    Attributes:
        request_id: unique key of the request in the allocator.
        token_ids: prompt tokens followed by generated tokens.
        cache_salt: per-tenant salt: requests with different salts never share blocks.
        lora_name: adapter name; requests under different adapters never share blocks.
        mm_inputs: multimodal inputs, mixed into the hashes of the blocks they overlap.
        num_encoder_tokens: encoder input tokens held by cross-attention groups.
        num_prompt_tokens: how many of ``token_ids`` are the prompt (default: all of them at
            construction). An engine building the request again after a preemption, with
            its generated tokens in ``token_ids``, passes the original prompt length: a
            family whose K/V depend on where the prompt ended (R-SWA) caches only the
            prompt's blocks.
    """

    __slots__ = (
        "_hash_owner",
        "block_hashes",
        "cache_salt",
        "lora_name",
        "mm_inputs",
        "num_encoder_tokens",
        "num_prompt_tokens",
        "request_id",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str | int,
        token_ids: list[int],
        *,
        cache_salt: str | bytes | None = None,
        lora_name: str | None = None,
        mm_inputs: Sequence[MultiModalInput] = (),
        num_encoder_tokens: int = 0,
        num_prompt_tokens: int | None = None,
    ) -> None:
        if not isinstance(token_ids, list):
            raise AllocatorError(
                f"request {request_id!r}: token_ids must be a list of ints (the allocator "
                f"reads tokens the engine appends), got {type(token_ids).__name__}"
            )
        if num_encoder_tokens < 0:
            raise AllocatorError(
                f"request {request_id!r}: num_encoder_tokens={num_encoder_tokens} must be >= 0"
            )
        if num_prompt_tokens is None:
            num_prompt_tokens = len(token_ids)
        elif num_prompt_tokens.__class__ is not int or not 0 <= num_prompt_tokens <= len(token_ids):
            raise AllocatorError(
                f"request {request_id!r}: num_prompt_tokens={num_prompt_tokens!r} must be an "
                f"int in [0, {len(token_ids)}] (the prompt's share of token_ids), or None for "
                "all of them"
            )
        self.request_id = request_id
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.mm_inputs = tuple(sorted(mm_inputs, key=lambda item: item.offset))
        self.num_encoder_tokens = num_encoder_tokens
        #: Chained hashes of the full hash blocks hashed so far (filled by the allocator).
        self.block_hashes: list[bytes] = []
        self._hash_owner: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token(self, token_id: int) -> None:
        """Append one generated token (the allocator hashes it once its block is full)."""
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, num_tokens={len(self.token_ids)})"
