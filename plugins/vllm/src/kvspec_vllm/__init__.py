"""kvspec inside vLLM: a ``vllm.general_plugins`` plugin that plans vLLM's KV cache with
kvspec's planner when ``KVSPEC_VLLM=1``, and shadows vLLM's KV-cache manager with kvspec's
allocator when ``KVSPEC_VLLM_SHADOW=1``, and runs vLLM's scheduler on kvspec's allocator when
``KVSPEC_VLLM_ALLOCATOR=1`` (see the package README)."""

from kvspec_vllm.errors import KVSpecVLLMError, NotRepresentable
from kvspec_vllm.planning import Outcome, last_outcome
from kvspec_vllm.switch import (
    ALLOCATOR_SWITCH,
    SHADOW_SWITCH,
    SWITCH,
    allocator_enabled,
    plugin_enabled,
    shadow_enabled,
)
from kvspec_vllm.version import SUPPORTED_RANGE, check_vllm_version

__all__ = [
    "ALLOCATOR_SWITCH",
    "SHADOW_SWITCH",
    "SUPPORTED_RANGE",
    "SWITCH",
    "KVSpecVLLMError",
    "NotRepresentable",
    "Outcome",
    "allocator_enabled",
    "check_vllm_version",
    "last_outcome",
    "plugin_enabled",
    "shadow_enabled",
]
