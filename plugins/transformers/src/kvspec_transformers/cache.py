"""The transformers ``Cache`` whose layers are kvspec layer adapters.

``KVSpecCache.layers[i]`` is layer ``i``'s adapter (see :mod:`kvspec_transformers.layer_adapters`),
so every ``cache.update`` the model makes writes into kvspec's ``materialize()`` views. The
engine starts and finishes each step on the cache; sequence lengths come from the step, not
from stored tensors (the cache holds no tensors of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers.cache_utils import Cache, DummyLayer

from kvspec_transformers.layer_adapters import LayerAdapter
from kvspec_transformers.step import StepContext


class KVSpecCache(Cache):
    """A cache over kvspec views, one adapter per model layer, driven step by step;
    layers holding no cache (no plan group) are transformers ``DummyLayer``s."""

    def __init__(self, layers: Sequence[LayerAdapter | DummyLayer]) -> None:
        super().__init__(layers=list(layers))  # type: ignore[arg-type]
        self.adapters: tuple[LayerAdapter, ...] = tuple(
            layer for layer in layers if not isinstance(layer, DummyLayer)
        )
        self.current_step: StepContext | None = None

    def begin_step(self, step: StepContext) -> None:
        """Hand ``step`` to every layer before the model's forward."""
        self.current_step = step
        for adapter in self.adapters:
            adapter.begin_step(step)

    def finish_step(self, step: StepContext) -> None:
        """Let every layer finish ``step`` (state layers save their state)."""
        for adapter in self.adapters:
            adapter.finish_step(step)
        self.current_step = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens computed before the current step (the same for every layer)."""
        return self.current_step.start if self.current_step is not None else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __repr__(self) -> str:
        kinds: dict[str, Any] = {}
        for adapter in self.adapters:
            kinds[type(adapter).__name__] = kinds.get(type(adapter).__name__, 0) + 1
        return f"KVSpecCache({kinds})"
