"""Replica 1 of the two-process test: another engine process that computes a prompt's blocks
and offloads them to the shared store (run with multiprocessing's spawn: a fresh interpreter)."""

from __future__ import annotations

import os
from typing import Any

from kvspec_core.runtime import PrefixHasher, Request
from kvspec_core.runtime.remote_store import BlockNamespace, RemoteBlockStore, RemoteStoreConfig


def offload_prompt(
    port: int, salt: bytes, tokens: list[int], block_size: int, parts: dict[str, Any], out: Any
) -> None:
    """Hash ``tokens`` as an allocator would, store one random page per full block, and put
    ``(hashes, pages, stored)`` on ``out``."""
    hashes = list(PrefixHasher(block_size, salt=salt).hashes(Request("r", tokens), len(tokens)))
    pages = [os.urandom(4096) for _ in hashes]
    store = RemoteBlockStore(BlockNamespace.of(**parts), RemoteStoreConfig(port=port))
    stored = store.put_many(list(zip(hashes, pages, strict=True)))
    store.close()
    out.put((hashes, pages, stored))
