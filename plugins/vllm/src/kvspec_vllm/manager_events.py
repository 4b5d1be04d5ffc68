"""kvspec's KV events as vLLM publishes them: ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` of ``vllm.distributed.kv_events``, carrying **vLLM's block hashes**.

A KV-aware router matches the hashes it gets from every replica, so an engine on kvspec's
allocator must publish the hashes vLLM's own manager would: kvspec hashes blocks with its
own (salted BLAKE2b) chain, and this translator replaces each by vLLM's hash of the same
block. A stored block belongs to the request whose ``allocate_slots`` cached it: its
position in that request gives vLLM's hash (``request.block_hashes``) and the extra keys
(LoRA, cache salt) vLLM reports. While a block stays cached the translator remembers its
vLLM hash, for the ``BlockRemoved`` event of its eviction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvspec_core.runtime.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvspec_vllm.errors import KVSpecVLLMError
from kvspec_vllm.specs import vllm_module


class EventTranslator:
    """Turns kvspec's events into vLLM's, one request's allocation at a time."""

    def __init__(self, group_metadata: Sequence[tuple[str, int | None]]) -> None:
        self._metadata = tuple(group_metadata)
        self._events = vllm_module("vllm.distributed.kv_events")
        self._utils = vllm_module("vllm.v1.core.kv_cache_utils")
        # (group, kvspec hash) -> vLLM's hash of that block, while it is cached.
        self._vllm_hash: dict[tuple[int, bytes], Any] = {}

    @property
    def num_cached_hashes(self) -> int:
        """Blocks whose vLLM hash is remembered (those kvspec holds cached)."""
        return len(self._vllm_hash)

    def translate(
        self, events: Iterable[Any], request: Any, kvspec_hashes: Sequence[bytes]
    ) -> list[Any]:
        """vLLM's events for kvspec's ``events``; blocks stored were cached by ``request``
        (vLLM's), whose kvspec hashes are ``kvspec_hashes``."""
        translated: list[Any] = []
        for event in events:
            if isinstance(event, BlockStored):
                translated.append(self._stored(event, request, kvspec_hashes))
            elif isinstance(event, BlockRemoved):
                translated.extend(self._removed(event))
            elif isinstance(event, AllBlocksCleared):
                self._vllm_hash.clear()
                translated.append(self._events.AllBlocksCleared())
        return translated

    def _stored(self, event: BlockStored, request: Any, kvspec_hashes: Sequence[bytes]) -> Any:
        if request is None:
            raise KVSpecVLLMError(
                "kvspec-vllm: kvspec's allocator cached blocks outside an allocation "
                f"(group {event.group}); their vLLM hashes are unknown"
            )
        first = kvspec_hashes.index(event.block_hashes[0])
        count = len(event.block_hashes)
        vllm_hashes = request.block_hashes
        if len(vllm_hashes) < first + count:
            raise KVSpecVLLMError(
                f"kvspec-vllm: request {request.request_id!r} has {len(vllm_hashes)} vLLM block "
                f"hashes, but kvspec cached its blocks {first}..{first + count - 1}; vLLM "
                "computes block hashes only with prefix caching on"
            )
        for position, kvspec_hash in enumerate(event.block_hashes, start=first):
            self._vllm_hash[(event.group, kvspec_hash)] = vllm_hashes[position]
        return self._block_stored(
            request, event.group, first, count, event.block_size, list(event.token_ids)
        )

    def reused(
        self, request: Any, hit_blocks: Sequence[int], block_sizes: Sequence[int]
    ) -> list[Any]:
        """vLLM's ``BlockStored`` events for the blocks a prefix hit reuses, one per group
        with ``hit_blocks[group]`` blocks from the request's first (its null entries too),
        as vLLM's ``emit_cached_block_events`` reports them for a request asking
        ``kv_cache_report_mode="full"``."""
        return [
            self._block_stored(
                request, group, 0, count, size, list(request.all_token_ids[: count * size])
            )
            for group, (count, size) in enumerate(zip(hit_blocks, block_sizes, strict=True))
            if count
        ]

    def _block_stored(
        self, request: Any, group: int, first: int, count: int, size: int, token_ids: list[int]
    ) -> Any:
        """vLLM's ``BlockStored`` for ``request``'s blocks ``first..first+count-1`` of
        ``group``: vLLM's hashes of those positions, the LoRA and extra keys it reports."""
        utils = self._utils
        convert = utils.maybe_convert_block_hash
        vllm_hashes = request.block_hashes
        extra_keys = []
        mm_index = 0
        for position in range(first, first + count):
            keys, mm_index = utils.generate_block_hash_extra_keys(
                request, position * size, (position + 1) * size, mm_index
            )
            extra_keys.append(keys)
        lora = request.lora_request
        kind, window = self._metadata[group]
        return self._events.BlockStored(
            block_hashes=[convert(vllm_hashes[p]) for p in range(first, first + count)],
            parent_block_hash=convert(vllm_hashes[first - 1]) if first else None,
            token_ids=token_ids,
            block_size=size,
            lora_id=lora.adapter_id if lora else None,
            medium=self._events.MEDIUM_GPU,
            lora_name=lora.name if lora else None,
            extra_keys=utils.to_event_extra_keys(extra_keys),
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            session_id=request.session_id,
        )

    def _removed(self, event: BlockRemoved) -> list[Any]:
        convert = self._utils.maybe_convert_block_hash
        removed = []
        for kvspec_hash in event.block_hashes:
            vllm_hash = self._vllm_hash.pop((event.group, kvspec_hash), None)
            if vllm_hash is None:
                raise KVSpecVLLMError(
                    f"kvspec-vllm: kvspec evicted a block of group {event.group} whose vLLM "
                    "hash was never recorded (a block cached outside the scheduler's calls?)"
                )
            # vLLM reports each evicted block in an event of its own.
            removed.append(
                self._events.BlockRemoved(
                    block_hashes=[convert(vllm_hash)],
                    medium=self._events.MEDIUM_GPU,
                    group_idx=event.group,
                )
            )
        return removed
