"""The values of the remote block store (``remote_store.py``): a block's pages behind a 48-byte
header: magic ``KVSB``, format version, payload length, and BLAKE2b-256 of key and payload.
A value whose header, length or digest does not match (truncated, flipped, written under
another key, another format) decodes to None: no partial or corrupt block ever comes back.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Final

from kvspec_core.runtime.remote_namespace import length_prefixed

#: Version of the value format (the header below); a value of another version is a miss.
VALUE_FORMAT_VERSION: Final = 1

_MAGIC = b"KVSB"
# magic, format version, reserved (0), payload length, BLAKE2b-256(key || payload).
_HEADER = struct.Struct("<4sHHQ32s")
#: Bytes of a value's header.
HEADER_SIZE: Final = _HEADER.size

#: What a block's pages may be given as.
Pages = bytes | bytearray | memoryview


def checked_pages(payload: object, index: int) -> Pages:
    """``payload`` (block ``[index]`` of a ``put_many``) if it is bytes-like and one run of
    memory (a C-contiguous memoryview); else TypeError."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"RemoteBlockStore.put_many: block [{index}]'s pages must be bytes, bytearray or "
            f"memoryview, not {type(payload).__name__}"
        )
    if isinstance(payload, memoryview) and not payload.c_contiguous:
        # Its bytes are not one run in memory: the value would need a copy in an order
        # the caller did not choose (which shape or stride is the block's?).
        raise TypeError(
            f"RemoteBlockStore.put_many: block [{index}]'s pages are a memoryview that is not "
            "C-contiguous; give the block's bytes in order (e.g. tensor.contiguous())"
        )
    return payload


def _digest(key: bytes, payload: Pages) -> bytes:
    hasher = hashlib.blake2b(digest_size=32, person=b"kvspec-remote-v")
    hasher.update(length_prefixed(key))
    hasher.update(payload)
    return hasher.digest()


def encode_value(key: bytes, payload: Pages) -> bytes:
    """The stored value of ``payload`` under ``key``: header then payload."""
    view = memoryview(payload).cast("B")
    header = _HEADER.pack(_MAGIC, VALUE_FORMAT_VERSION, 0, view.nbytes, _digest(key, view))
    return header + view.tobytes()


def decode_value(key: bytes, value: bytes) -> bytes | None:
    """The payload of ``value`` read under ``key``, or None unless header, length and digest
    all match."""
    if value.__class__ is not bytes or len(value) < HEADER_SIZE:
        return None
    magic, version, reserved, length, digest = _HEADER.unpack_from(value)
    if magic != _MAGIC or version != VALUE_FORMAT_VERSION or reserved != 0:
        return None
    if length != len(value) - HEADER_SIZE:
        return None
    payload = value[HEADER_SIZE:]
    if not hmac.compare_digest(_digest(key, payload), digest):
        return None
    return payload
