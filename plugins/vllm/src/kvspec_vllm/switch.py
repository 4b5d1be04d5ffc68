"""``KVSPEC_VLLM``: whether vLLM's KV-cache config comes from kvspec's planner."""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvspec_vllm.errors import KVSpecVLLMError

#: The environment variable that turns the plugin on.
SWITCH = "KVSPEC_VLLM"

_ON = frozenset({"1", "true", "on", "yes"})
_OFF = frozenset({"", "0", "false", "off", "no"})


def plugin_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``True`` when ``KVSPEC_VLLM`` is ``1`` (or ``true`` / ``on`` / ``yes``), ``False``
    when it is unset, empty, ``0`` (``false`` / ``off`` / ``no``); any other value is
    refused, since a typo must not silently leave vLLM on its own plan."""
    env = os.environ if environ is None else environ
    value = env.get(SWITCH, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise KVSpecVLLMError(
        f"{SWITCH}={env.get(SWITCH)!r} is not a switch value: set {SWITCH}=1 to plan vLLM's KV "
        f"cache with kvspec, or unset it (or {SWITCH}=0) to leave vLLM's own plan"
    )
