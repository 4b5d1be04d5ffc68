"""Runtime allocator rules of the sliding-window families.

* ``sliding_window``: a step starting at computed length ``c`` attends to positions from
  ``c - window + 1``; blocks entirely below ``c - window + 1 - extra_retained_tokens`` are
  freed. Resuming at ``p`` needs the blocks of the last ``window - 1 + extra_retained_tokens``
  positions before ``p`` (what the request would hold had it computed them itself), or
  every block before ``p`` when ``p`` is within that reach; earlier entries are null blocks.
  Below the device (an offload tier with ``keep="family_rules"``) it keeps a freed
  request's last window only (the core's ``TrailingWindowRules.offload_range``).
* ``kpool_tail``: one block for the request's life, never cached.
* ``reference_sliding_window`` (R-SWA): its gap eviction depends on where the prompt ends,
  which the positional rules cannot express yet, so it keeps every block, exactly like full
  attention (and its admission cap is full attention's): correct, never frees early. Its
  K/V past the prompt depend on where the prompt ended too (a generated token attends the
  prompt and the last ``rswa_window`` generated tokens; the same token in a later prompt
  attends every earlier one), so only the blocks inside a request's prompt are cached: a
  multi-turn follow-up whose prompt holds the earlier answer hits the earlier prompt only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.plugins.contract import hookimpl
from kvspec_core.plugins.hookspecs import RegisterRuntimeRules
from kvspec_core.runtime.rules import FullAttentionRules, SingleBlockRules, TrailingWindowRules
from kvspec_sliding_window.specs import SlidingWindowSpec


class SlidingWindowRules(TrailingWindowRules):
    """Rules of one sliding-window group: the core's trailing-window shape (whose steps
    the compiled kernels do) with this family's hits."""

    def __init__(self, spec: SlidingWindowSpec, ctx: SizingContext) -> None:
        super().__init__(spec, ctx)
        self.window = spec.sliding_window
        self.extra = spec.extra_retained_tokens
        self.retained_tokens = self.window - 1 + self.extra
        #: Cached blocks a hit past the first window needs right before the hit position:
        #: the window, plus the retained tokens a speculative re-prefill reads.
        self.window_blocks = cdiv(self.retained_tokens, self.block_tokens)

    def longest_hit(
        self, hashes: Sequence[bytes], cache: Mapping[bytes, int], max_blocks: int
    ) -> list[int]:
        if not self.prefix_cacheable or max_blocks <= 0:
            return []
        need = self.window_blocks
        if need == 0:  # a window of one token attends only to itself
            return [0] * max_blocks
        # Every lookup at once (map and list run them without a Python frame per block).
        found: list = list(map(cache.get, hashes[:max_blocks]))  # block ids, None: a miss
        # The latest run of `need` cached blocks ends at the largest resumable position: try
        # the window ending at `end`; a miss inside it moves `end` down to that miss.
        end = len(found)
        while end >= need:
            window = found[end - need : end]
            if None not in window:
                return [0] * (end - need) + window
            end = end - need + (need - 1 - window[::-1].index(None))
        # No full window anywhere: only a position inside the first window can resume, and
        # that needs every block from the start.
        leading = found.index(None) if None in found else len(found)
        return found[:leading]


class ReferenceSlidingWindowRules(FullAttentionRules):
    """R-SWA: full attention's steps and hits, caching only the blocks inside the prompt."""

    caches_prompt_only = True


class KpoolTailRules(SingleBlockRules):
    """The kpool indexer's one-block raw tail."""


@hookimpl
def kvspec_register_runtime_rules(register: RegisterRuntimeRules) -> None:
    register("sliding_window", SlidingWindowRules)
    register("kpool_tail", KpoolTailRules)
    register("reference_sliding_window", ReferenceSlidingWindowRules)
