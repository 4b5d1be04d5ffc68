"""kvspec inside vLLM: a ``vllm.general_plugins`` plugin that plans vLLM's KV cache with
kvspec's planner when ``KVSPEC_VLLM=1`` (see the package README)."""

from kvspec_vllm.errors import KVSpecVLLMError, NotRepresentable
from kvspec_vllm.planning import Outcome, last_outcome
from kvspec_vllm.switch import SWITCH, plugin_enabled
from kvspec_vllm.version import SUPPORTED_RANGE, check_vllm_version

__all__ = [
    "SUPPORTED_RANGE",
    "SWITCH",
    "KVSpecVLLMError",
    "NotRepresentable",
    "Outcome",
    "check_vllm_version",
    "last_outcome",
    "plugin_enabled",
]
