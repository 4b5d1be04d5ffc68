"""Chained, salted, cryptographic block hashes for the prefix cache (no pickle anywhere).

The hash of hash-block ``i`` is ``BLAKE2b(parent || tokens_i || extras_i)`` where ``parent``
is block ``i-1``'s hash and block 0's parent is a per-request root:
``BLAKE2b(process salt, cache salt, LoRA name)``. Token ids are packed as little-endian
``uint32``; every field of the root is length-prefixed, and the token part of a block has a
fixed length, so no two different inputs serialise to the same bytes. The process salt comes
from ``os.urandom``, so hashes cannot be precomputed (or collided) from outside the process.
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


def _field(value: str | bytes | None) -> bytes:
    if value is None:
        return b"\x00"
    data = value.encode() if isinstance(value, str) else bytes(value)
    return b"\x01" + struct.pack("<Q", len(data)) + data


def _pack_tokens(request: Request, start: int, stop: int) -> bytes:
    """Tokens ``[start, stop)`` of ``request`` as little-endian uint32s."""
    tokens = request.token_ids[start:stop]
    try:
        # struct packs a list about twice as fast as array("I", ...).tobytes().
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        raise _bad_tokens(request, start, stop, _first_bad_token(tokens, start)) from None


def _first_bad_token(tokens: list[int], start: int) -> str:
    """Which token cannot be packed, worded as the compiled kernel words it."""
    for position, token in enumerate(tokens, start):
        try:
            value = operator.index(token)
        except TypeError:
            value = -1
        if not 0 <= value < 2**32:
            return f"token {position} is {token!r}, not an int in [0, 2**32)"
    return f"struct cannot pack {tokens!r}"


def _bad_tokens(request: Request, start: int, stop: int, detail: str) -> AllocatorError:
    return AllocatorError(
        f"request {request.request_id!r}: token ids in [{start}, {stop}) must be ints in "
        f"[0, 2**32) to be hashed: {detail}"
    )


class PrefixHasher:
    """Computes and caches the block hashes of requests at ``hash_block_size`` granularity."""

    def __init__(self, hash_block_size: int, salt: bytes | None = None) -> None:
        if not isinstance(hash_block_size, int) or hash_block_size <= 0:
            raise AllocatorError(f"hash_block_size={hash_block_size!r} must be a positive int")
        self.hash_block_size = hash_block_size
        self._salt = PROCESS_SALT if salt is None else bytes(salt)
        # Roots by (cache salt, LoRA name): every request of a tenant and adapter has the
        # same one, so it is hashed once, not per request.
        self._roots: dict[tuple[str | bytes | None, str | None], bytes] = {}

    def root(self, request: Request) -> bytes:
        """The parent hash of the request's first block (process salt, tenant, LoRA)."""
        key = (request.cache_salt, request.lora_name)
        try:
            return self._roots[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable salt (a bytearray): not remembered
            return self._make_root(request)
        if len(self._roots) >= _ROOTS_KEPT:
            self._roots.clear()
        root = self._roots[key] = self._make_root(request)
        return root

    def _make_root(self, request: Request) -> bytes:
        return blake2b(
            b"kvspec-prefix-root" + _field(self._salt) + _field(request.cache_salt)
            + _field(request.lora_name),
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
            return hashes
        data = _pack_tokens(request, start, stop)
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
                parent = blake2b(parent + data[offset : offset + step], digest_size=DIGEST_SIZE).digest()
                append(parent)
        return hashes

    def _extras(self, request: Request, index: int) -> bytes:
        first = index * self.hash_block_size
        last = first + self.hash_block_size
        parts = [
            _field(item.identifier) + struct.pack("<QQ", item.offset, item.length)
            for item in request.mm_inputs
            if item.offset < last and item.offset + item.length > first
        ]
        return b"".join(parts)
