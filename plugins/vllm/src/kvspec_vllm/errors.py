"""The plugin's errors."""

from __future__ import annotations


class KVSpecVLLMError(RuntimeError):
    """kvspec-vllm cannot run as asked (an unsupported vLLM, a bad switch value)."""


class NotRepresentable(Exception):
    """kvspec's plan of this model has no vLLM representation (or kvspec cannot read one of
    vLLM's layer specs); vLLM's own KV-cache config is kept. ``reason`` says which part."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
