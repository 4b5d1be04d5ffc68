"""kvspec plugin for the sliding-window families: ``sliding_window``, ``kpool_tail`` and
``reference_sliding_window`` (R-SWA)."""

from kvspec_sliding_window.specs import (
    KpoolTailSpec,
    ReferenceSlidingWindowSpec,
    SlidingWindowSpec,
)

__all__ = ["KpoolTailSpec", "ReferenceSlidingWindowSpec", "SlidingWindowSpec"]
