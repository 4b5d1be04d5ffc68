"""The plugin's switches: ``KVSPEC_VLLM`` (vLLM's KV-cache config comes from kvspec's
planner), ``KVSPEC_VLLM_SHADOW`` (kvspec's allocator shadows vLLM's KV-cache manager) and
``KVSPEC_VLLM_ALLOCATOR`` (kvspec's allocator replaces vLLM's KV-cache manager behind the
scheduler)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvspec_core.switches import switch_value
from kvspec_vllm.errors import KVSpecVLLMError

#: The environment variable that turns kvspec's planning on.
SWITCH = "KVSPEC_VLLM"
#: The environment variable that turns shadow mode on (:mod:`kvspec_vllm.shadow`).
SHADOW_SWITCH = "KVSPEC_VLLM_SHADOW"
#: The environment variable that puts kvspec's allocator behind vLLM's scheduler
#: (:mod:`kvspec_vllm.scheduler_seam`).
ALLOCATOR_SWITCH = "KVSPEC_VLLM_ALLOCATOR"


def plugin_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``True`` when ``KVSPEC_VLLM`` is ``1`` (or ``true`` / ``on`` / ``yes``), ``False``
    when it is unset, empty, ``0`` (``false`` / ``off`` / ``no``); any other value is
    refused, since a typo must not silently leave vLLM on its own plan."""
    return switch_on(SWITCH, environ)


def shadow_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVSPEC_VLLM_SHADOW`` is on (same values as :func:`plugin_enabled`)."""
    return switch_on(SHADOW_SWITCH, environ)


def allocator_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVSPEC_VLLM_ALLOCATOR`` is on (same values as :func:`plugin_enabled`)."""
    return switch_on(ALLOCATOR_SWITCH, environ)


def switch_on(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """The value of the switch ``name`` in ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    value = switch_value(env.get(name))
    if value is not None:
        return value
    raise KVSpecVLLMError(
        f"{name}={env.get(name)!r} is not a switch value: set {name}=1 to turn it on, or "
        f"unset it (or {name}=0) to leave it off"
    )
