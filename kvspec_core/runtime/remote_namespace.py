"""The keys of the remote block store (``remote_store.py``): ``kvspec/1/`` + a namespace's
16-byte digest + the salted chained block hash.

The namespace says what a block's bytes mean: the caller builds it from whatever fixes the
page layout (the plan's ``input_checksums`` of the layout and of each group's layers and
spec, the pool index, the tensor-parallel rank and size, ...), so a replica of another
model, layout or rank never reads these bytes as its own. ``RemoteTier`` adds the order its
storage gives a block's bytes (``RemoteBlockStore.bind_block_layout``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

#: Bytes of a namespace digest in a key.
NAMESPACE_DIGEST_SIZE: Final = 16
#: Every key of the store starts with it (its format version is the ``1``).
KEY_PREFIX: Final = b"kvspec/1/"

# Type tags of a namespace part's value: the str "1", the bytes b"1" and the int 1 differ.
_STR_TAG, _BYTES_TAG, _INT_TAG = b"s", b"b", b"i"


def length_prefixed(data: bytes) -> bytes:
    """``data`` behind its length (8 bytes, little endian): concatenations stay unambiguous."""
    return struct.pack("<Q", len(data)) + data


@dataclass(frozen=True)
class BlockNamespace:
    """What the bytes of a block mean: the part of a key that keeps models, layouts, pools
    and ranks apart. Build it with :meth:`of`; two namespaces are equal exactly when they
    were built of the same parts."""

    digest: bytes

    @classmethod
    def of(cls, **parts: str | bytes | int) -> BlockNamespace:
        """The namespace of these named parts (their order does not matter).

        Pass everything that changes what a block's bytes mean, and nothing else: e.g. the
        plan's ``input_checksums`` entries ``layout`` and each group's ``groups[i].layers``
        and ``groups[i].spec``, the context fields that change a block's bytes
        (``dcp_size``, ``mamba_cache_mode``, ``max_encoder_tokens``; not ``num_blocks``, the
        budgets or ``max_model_len``: a replica with more memory stores the same bytes), the
        pool index, the tensor-parallel rank and size (at TP above the KV heads, a rank's
        head depends on both), and what names the weights. Refuses an empty
        namespace and values that are not str, bytes or int.
        """
        if not parts:
            raise ValueError(
                "BlockNamespace.of() needs at least one part (the plan's input checksums, "
                "the pool index, ...): an empty namespace would be shared by every model"
            )
        hasher = hashlib.blake2b(digest_size=NAMESPACE_DIGEST_SIZE, person=b"kvspec-remote-ns")
        for name in sorted(parts):
            value = parts[name]
            if isinstance(value, bool) or not isinstance(value, (str, bytes, int)):
                raise TypeError(
                    f"BlockNamespace.of(): part {name}={value!r} must be a str, bytes or int, "
                    f"not {type(value).__name__}"
                )
            if isinstance(value, str):
                tagged = _STR_TAG + length_prefixed(value.encode("utf-8", "surrogatepass"))
            elif isinstance(value, bytes):
                tagged = _BYTES_TAG + length_prefixed(bytes(value))
            else:
                tagged = _INT_TAG + length_prefixed(str(int(value)).encode())
            hasher.update(length_prefixed(name.encode("utf-8", "surrogatepass")) + tagged)
        return cls(hasher.digest())

    @classmethod
    def from_checksums(
        cls, checksums: Mapping[str, str], **parts: str | bytes | int
    ) -> BlockNamespace:
        """:meth:`of` the ``checksums`` (e.g. a plan's ``input_checksums`` minus what does not
        change a block's bytes) under ``checksum:<name>``, and ``parts`` beside them."""
        named: dict[str, str | bytes | int] = {f"checksum:{k}": v for k, v in checksums.items()}
        clash = named.keys() & parts.keys()
        if clash:
            raise ValueError(f"BlockNamespace.from_checksums(): parts {sorted(clash)} given twice")
        return cls.of(**named, **parts)

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != NAMESPACE_DIGEST_SIZE:
            raise ValueError(
                f"BlockNamespace digest must be {NAMESPACE_DIGEST_SIZE} bytes; build it with "
                "BlockNamespace.of(...)"
            )

    @property
    def key_prefix(self) -> bytes:
        """What every key of this namespace starts with (a block hash follows)."""
        return KEY_PREFIX + self.digest

    def __str__(self) -> str:
        return self.digest.hex()
