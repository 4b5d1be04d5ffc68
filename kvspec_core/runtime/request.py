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
    identifier: str | bytes

    def __attrs_post_init__(self) -> None:
        # Exact types: the hash reads them without running a caller's code, and an
        # identifier of another type (3, False, a list) would serialise like some bytes.
        if (
            self.offset.__class__ is not int
            or self.length.__class__ is not int
            or not 0 <= self.offset < 2**63
            or not 0 < self.length < 2**63
        ):
            raise AllocatorError(
                f"MultiModalInput(offset={self.offset!r}, length={self.length!r}) is invalid: "
                "offset must be an int >= 0 and length an int > 0"
            )
        if self.identifier.__class__ is not str and self.identifier.__class__ is not bytes:
            raise AllocatorError(
                f"MultiModalInput(offset={self.offset}).identifier is of type "
                f"{type(self.identifier).__name__}; it must be a str or bytes (a content hash "
                "of the input, e.g. of the image bytes): two inputs with equal identifiers "
                "share cached blocks"
            )


#: The fields a request's block hashes are computed from: fixed once it is hashed.
_HASHED_FIELDS = frozenset({"token_ids", "cache_salt", "lora_name", "mm_inputs"})


class Request:
    """One request as the allocator sees it.

    ``token_ids`` is the request's own list: the engine appends generated tokens to it (or
    calls :meth:`append_token`) before asking for their slots. Block hashes are computed
    incrementally, only over full hash blocks, and cached here, so a token is hashed once
    in the request's lifetime. So ``token_ids`` is append-only: a token changed in place
    keeps the hash of the old one, and a later request with the old tokens would hit blocks
    computed for the new ones. Replacing a hashed field (``token_ids``, ``cache_salt``,
    ``lora_name``, ``mm_inputs``) once the request is hashed is refused; build a new
    :class:`Request` instead (a copy, ``copy.copy``, starts with no hashes).

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
        inputs = tuple(mm_inputs)
        for item in inputs:
            if item.__class__ is not MultiModalInput:
                raise AllocatorError(
                    f"request {request_id!r}: mm_inputs holds a {type(item).__name__}; each "
                    "must be a kvspec_core.runtime.MultiModalInput (its fields are checked and "
                    "hashed as they are)"
                )
        self.mm_inputs = tuple(sorted(inputs, key=lambda item: item.offset))
        self.num_encoder_tokens = num_encoder_tokens
        #: Chained hashes of the full hash blocks hashed so far (filled by the allocator).
        self.block_hashes: list[bytes] = []
        self._hash_owner: object | None = None

    def __setattr__(self, name: str, value: object) -> None:
        if name in _HASHED_FIELDS and getattr(self, "_hash_owner", None) is not None:
            raise AllocatorError(
                f"request {self.request_id!r}: {name} cannot be replaced once the request is "
                "hashed (its cached block hashes would describe other content: a false "
                "prefix hit for later requests); build a new Request"
            )
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in Request.__slots__ if hasattr(self, name)}

    def __setstate__(self, state: dict[str, object]) -> None:
        # A deep copy or an unpickled request is restored field by field, its hashes with
        # it: not through the refusal of __setattr__.
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def __copy__(self) -> Request:
        """A shallow copy that starts with no block hashes (they are the copy's own once
        hashed, so changing the copy's fields changes no hash of the original's)."""
        copied = Request.__new__(Request)
        for name in Request.__slots__:
            object.__setattr__(copied, name, getattr(self, name))
        object.__setattr__(copied, "block_hashes", [])
        object.__setattr__(copied, "_hash_owner", None)
        return copied

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token(self, token_id: int) -> None:
        """Append one generated token (the allocator hashes it once its block is full)."""
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, num_tokens={len(self.token_ids)})"
