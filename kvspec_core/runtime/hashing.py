"""Chained, salted, cryptographic block hashes for the prefix cache (no pickle anywhere).

The hash of hash-block ``i`` is ``BLAKE2b(parent || tokens_i || extras_i)`` where ``parent``
is block ``i-1``'s hash and block 0's parent is a per-request root:
``BLAKE2b(process salt, cache salt, LoRA name)``. Token ids are packed as little-endian
``uint32``; every field of the root is length-prefixed and the cache salt type-tagged (the
str ``"a"`` and the bytes ``b"a"`` are two tenants), and the token part of a block has a
fixed length, so no two different inputs serialise to the same bytes. The process salt comes
from ``os.urandom``, so hashes cannot be precomputed (or collided) from outside the process.

What is hashed runs no code of the caller's between reading a request and using what it
read: a cache salt must be a ``str``, ``bytes`` (or ``bytearray``, the same tenant as its
bytes) or ``None``, a LoRA name a ``str`` or ``None`` (their subclasses could run a
``__hash__`` in the middle of a step), and token ids that are not ints (numpy integers) are
read once through ``__index__``, after which the list must still hold the very objects read
(else the request is refused: a hash is always of the tokens the list holds). A multimodal
input's identifier is an exact ``str`` or ``bytes`` and its range exact ints
(:class:`~kvspec_core.runtime.request.MultiModalInput` refuses anything else), and the
hasher's own salt ``bytes`` or ``bytearray``: nothing is serialised through ``bytes()``.
"""

from __future__ import annotations

import operator
import os
import struct
from hashlib import blake2b

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.native import native
from kvspec_core.runtime.request import Request

#: Salt of every hasher of this process that is not given one explicitly.
PROCESS_SALT = os.urandom(32)
#: Bytes of one block hash.
DIGEST_SIZE = 32

#: Most roots a hasher remembers (distinct tenant salts and adapters) before it starts over.
_ROOTS_KEPT = 4096

#: Bytes of one packed token id.
_TOKEN_BYTES = struct.calcsize("<I")


#: Type tags of a root's fields: a str and the bytes of its UTF-8 encoding differ.
_NONE_TAG, _STR_TAG, _BYTES_TAG = b"\x00", b"\x01", b"\x02"

#: What ``struct`` packs without calling code of the caller's (ints and their subclasses).
_INT_ONLY = frozenset({int})

#: Worded as the compiled kernel words it.
_CHANGED = "token ids changed while they were hashed"


def _field(value: str | bytes | None) -> bytes:
    """``value`` (None, an exact str or exact bytes: the callers refuse anything else)
    type-tagged and length-prefixed."""
    if value is None:
        return _NONE_TAG
    if value.__class__ is str:
        # surrogatepass: every str has one encoding (a lone surrogate is no error).
        tag, data = _STR_TAG, value.encode("utf-8", "surrogatepass")
    elif value.__class__ is bytes:
        tag, data = _BYTES_TAG, value
    else:
        # Never serialised by bytes(): 3 would read as b"\0\0\0", False as b"".
        raise AllocatorError(f"cannot hash {_describe(value)}: it is no str, bytes or None")
    return tag + struct.pack("<Q", len(data)) + data


def _root_key(request: Request) -> tuple[str | bytes | None, str | None]:
    """``(cache salt, LoRA name)`` of ``request``, checked to be of the types whose hashing
    and comparison run no code of the caller's; a bytearray salt as its bytes."""
    salt = request.cache_salt
    lora = request.lora_name
    salt_class = salt.__class__
    if salt_class is bytearray:
        salt = bytes(salt)  # type: ignore[arg-type]
    elif salt is not None and salt_class is not str and salt_class is not bytes:
        raise AllocatorError(
            f"request {_describe(request.request_id)}: cache_salt={_describe(salt)} must be a "
            f"str, bytes or None, not {salt_class.__name__}; pass the tenant's salt as one "
            "(str and bytes salts are different tenants)"
        )
    if lora is not None and lora.__class__ is not str:
        raise AllocatorError(
            f"request {_describe(request.request_id)}: lora_name={_describe(lora)} must be a "
            f"str or None, not {lora.__class__.__name__}; pass the adapter's name"
        )
    return salt, lora


def _describe(value: object) -> str:
    """``repr(value)`` of an exact str, bytes or int, else its type (a repr of a hostile
    object could run its code)."""
    kind = value.__class__
    if value is None or kind is str or kind is bytes or kind is int or kind is bytearray:
        return repr(value)
    return f"<a {type(value).__name__}>"


def _pack_tokens(request: Request, start: int, stop: int) -> bytes:
    """Tokens ``[start, stop)`` of ``request`` as little-endian uint32s."""
    token_list = request.token_ids
    tokens = token_list[start:stop]
    if len(tokens) != stop - start:
        raise _bad_tokens(request, start, stop, _CHANGED)
    if set(map(type, tokens)) <= _INT_ONLY:
        values = tokens
    else:
        # Read each non-int token once (its __index__ may run any code), then check the
        # list still holds the objects it held in [0, stop) (the tokens hashed before
        # ``start`` too: these hashes chain from theirs): the hashes are of its tokens.
        length = len(token_list)
        held = token_list[:stop]
        values = _index_values(request, tokens, start, stop)
        if (
            request.token_ids is not token_list
            or len(token_list) != length
            or not all(map(operator.is_, token_list[:stop], held))
        ):
            raise _bad_tokens(request, start, stop, _CHANGED)
    try:
        # struct packs a list about twice as fast as array("I", ...).tobytes().
        return struct.pack(f"<{len(values)}I", *values)
    except struct.error:
        raise _bad_tokens(request, start, stop, _first_bad_token(values, tokens, start)) from None


def _index_values(request: Request, tokens: list[int], start: int, stop: int) -> list[int]:
    """The int value of each token (``operator.index``), in order; the first that has none
    refuses the request, worded as the compiled kernel words it."""
    values = []
    for position, token in enumerate(tokens, start):
        try:
            value = operator.index(token)
        except Exception:
            value = -1
        # Each checked as it is read, so the first bad token is named, as the kernel does.
        if not 0 <= value < 2**32:
            raise _bad_tokens(
                request,
                start,
                stop,
                f"token {position} is {_describe(token)}, not an int in [0, 2**32)",
            ) from None
        values.append(value)
    return values


def _first_bad_token(values: list[int], tokens: list[int], start: int) -> str:
    """Which token is out of range (``values``: the tokens as ints)."""
    for position, (value, token) in enumerate(zip(values, tokens, strict=True), start):
        if not 0 <= value < 2**32:
            return f"token {position} is {_describe(token)}, not an int in [0, 2**32)"
    return f"struct cannot pack tokens [{start}, {start + len(values)})"


def _bad_tokens(request: Request, start: int, stop: int, detail: str) -> AllocatorError:
    return AllocatorError(
        f"request {_describe(request.request_id)}: token ids in [{start}, {stop}) must be ints in "
        f"[0, 2**32) to be hashed: {detail}"
    )


class PrefixHasher:
    """Computes and caches the block hashes of requests at ``hash_block_size`` granularity."""

    def __init__(self, hash_block_size: int, salt: bytes | None = None) -> None:
        if not isinstance(hash_block_size, int) or hash_block_size <= 0:
            raise AllocatorError(f"hash_block_size={hash_block_size!r} must be a positive int")
        self.hash_block_size = hash_block_size
        if salt is not None and salt.__class__ not in (bytes, bytearray):
            # bytes(12345) would be 12345 zero bytes, bytes(False) empty: a salt anyone
            # could reproduce, or two configurations sharing one.
            raise AllocatorError(
                f"hash_salt={_describe(salt)} must be bytes (or a bytearray) or None, not "
                f"{type(salt).__name__}; replicas sharing a remote store pass the same bytes "
                "(e.g. os.urandom(32) kept in their configuration)"
            )
        self._salt = PROCESS_SALT if salt is None else bytes(salt)
        # Roots by (cache salt, LoRA name): every request of a tenant and adapter has the
        # same one, so it is hashed once, not per request.
        self._roots: dict[tuple[str | bytes | None, str | None], bytes] = {}

    def root(self, request: Request) -> bytes:
        """The parent hash of the request's first block (process salt, tenant, LoRA).

        Refuses, with :class:`AllocatorError`, a cache salt that is not a str, bytes,
        bytearray or None and a LoRA name that is not a str or None."""
        key = _root_key(request)
        root = self._roots.get(key)
        if root is None:
            if len(self._roots) >= _ROOTS_KEPT:
                self._roots.clear()
            root = self._roots[key] = self._make_root(*key)
        return root

    def _make_root(self, salt: str | bytes | None, lora: str | None) -> bytes:
        return blake2b(
            b"kvspec-prefix-root" + _field(self._salt) + _field(salt) + _field(lora),
            digest_size=DIGEST_SIZE,
        ).digest()

    def hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """The request's block hashes covering its first ``num_tokens`` tokens' full blocks.

        Returns the request's own cached list (may be longer than asked); do not mutate it.
        """
        hashes = request.block_hashes
        if request._hash_owner is not self:
            # Hashes made by another hasher (another salt) are meaningless here.
            hashes.clear()
            request._hash_owner = self
        size = self.hash_block_size
        num_tokens = min(num_tokens, len(request.token_ids))
        target = num_tokens // size
        done = len(hashes)
        if target <= done:
            return hashes
        start, stop = done * size, target * size
        parent = hashes[-1] if hashes else self.root(request)
        if native is not None and not request.mm_inputs:
            try:
                native.chain_hashes(parent, request.token_ids, start, stop, size, hashes)
            except ValueError as error:
                raise _bad_tokens(request, start, stop, str(error)) from None
            self._check_unchanged(request, hashes, start, stop)
            return hashes
        data = _pack_tokens(request, start, stop)
        self._check_unchanged(request, hashes, start, stop)
        if target == done + 1 and not request.mm_inputs:
            # One new block (a decode step completed it): skip the general loop.
            hashes.append(blake2b(parent + data, digest_size=DIGEST_SIZE).digest())
            return hashes
        step = size * _TOKEN_BYTES
        append = hashes.append
        if request.mm_inputs:
            for index in range(done, target):
                offset = (index - done) * step
                parent = blake2b(
                    parent + data[offset : offset + step] + self._extras(request, index),
                    digest_size=DIGEST_SIZE,
                ).digest()
                append(parent)
        else:
            for offset in range(0, len(data), step):
                parent = blake2b(
                    parent + data[offset : offset + step], digest_size=DIGEST_SIZE
                ).digest()
                append(parent)
        return hashes

    def _check_unchanged(
        self, request: Request, hashes: list[bytes], start: int, stop: int
    ) -> None:
        """Refuse a request whose hash list or owner a token's ``__index__`` replaced while
        it was hashed (the list a hash lands in must be the request's own)."""
        if request.block_hashes is not hashes or request._hash_owner is not self:
            raise _bad_tokens(request, start, stop, _CHANGED)

    def _extras(self, request: Request, index: int) -> bytes:
        first = index * self.hash_block_size
        last = first + self.hash_block_size
        parts = [
            _field(item.identifier) + struct.pack("<QQ", item.offset, item.length)
            for item in request.mm_inputs
            if item.offset < last and item.offset + item.length > first
        ]
        return b"".join(parts)
