"""Runtime allocator rules of chunked local attention.

A step starting at computed length ``c`` attends only within the chunk holding ``c``, so the
blocks entirely below that chunk's start are freed. Resuming at ``p`` needs only the blocks
of ``p``'s chunk before ``p``: at a chunk boundary nothing at all (the hit's earlier entries
are null blocks; the other groups of the model decide how far a hit really goes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvspec_chunked_local.specs import ChunkedLocalAttentionSpec
from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.plugins.contract import hookimpl
from kvspec_core.plugins.hookspecs import RegisterRuntimeRules
from kvspec_core.runtime.rules import FullAttentionRules


class ChunkedLocalRules(FullAttentionRules):
    """Rules of one chunked-local-attention group."""

    hit_priority = 1

    def __init__(self, spec: ChunkedLocalAttentionSpec, ctx: SizingContext) -> None:
        super().__init__(spec, ctx)
        self.chunk = spec.attention_chunk_size

    def _chunk_start(self, position: int) -> int:
        return position // self.chunk * self.chunk

    def skipped_tokens(self, num_computed: int) -> int:
        return self._chunk_start(num_computed)

    def next_skip_position(self, num_skipped_blocks: int) -> int:
        # The first chunk start at or past the end of the next block.
        return cdiv((num_skipped_blocks + 1) * self.block_tokens, self.chunk) * self.chunk

    def longest_hit(
        self, hashes: Sequence[bytes], cache: Mapping[bytes, int], max_blocks: int
    ) -> list[int]:
        if not self.prefix_cacheable:
            return []
        tokens = self.block_tokens
        get = cache.get
        while max_blocks > 0:
            chunk_start = self._chunk_start(max_blocks * tokens)
            first = chunk_start // tokens
            found: list[int] = []
            for index in range(first, max_blocks):
                block = get(hashes[index])
                if block is None:
                    break
                found.append(block)
            end = first + len(found)
            if end * tokens >= chunk_start:
                return [0] * first + found
            # The block holding the chunk start is missing and begins in the previous
            # chunk: resuming there needs that chunk's blocks; try below it.
            max_blocks = end
        return []


@hookimpl
def kvspec_register_runtime_rules(register: RegisterRuntimeRules) -> None:
    register("chunked_local_attention", ChunkedLocalRules)
