"""The ``vllm.general_plugins`` entry point: patch vLLM's KV-cache planning when switched on.

vLLM calls :func:`register` in every process it starts (the front end, the engine core, the
workers). With ``KVSPEC_VLLM=1`` it checks the vLLM version and replaces
``get_kv_cache_configs`` in ``vllm.v1.core.kv_cache_utils`` and in ``vllm.v1.engine.core``
(which imported it by name). With ``KVSPEC_VLLM_SHADOW=1`` it wraps the KV-cache manager
the scheduler builds in a kvspec shadow (:mod:`kvspec_vllm.shadow`). With
``KVSPEC_VLLM_ALLOCATOR=1`` the scheduler builds kvspec's manager instead of vLLM's
(:mod:`kvspec_vllm.scheduler_seam`); it and shadow mode exclude each other. Without any
switch it changes nothing.
"""

from __future__ import annotations

from kvspec_vllm import scheduler_seam, shadow
from kvspec_vllm.errors import KVSpecVLLMError
from kvspec_vllm.planning import planned_by_kvspec
from kvspec_vllm.specs import vllm_module
from kvspec_vllm.switch import (
    ALLOCATOR_SWITCH,
    SHADOW_SWITCH,
    allocator_enabled,
    plugin_enabled,
    shadow_enabled,
)
from kvspec_vllm.version import check_vllm_version

#: Modules holding the name ``get_kv_cache_configs`` that vLLM's engine core calls.
PATCHED_MODULES = ("vllm.v1.core.kv_cache_utils", "vllm.v1.engine.core")


def register() -> None:
    """Install kvspec's planning into vLLM when ``KVSPEC_VLLM`` is on, the shadow when
    ``KVSPEC_VLLM_SHADOW`` is, kvspec's allocator behind the scheduler when
    ``KVSPEC_VLLM_ALLOCATOR`` is (idempotent)."""
    planning, shadowing, allocating = plugin_enabled(), shadow_enabled(), allocator_enabled()
    if not (planning or shadowing or allocating):
        return
    if shadowing and allocating:
        raise KVSpecVLLMError(
            f"kvspec-vllm: {SHADOW_SWITCH}=1 mirrors vLLM's own KV-cache manager into kvspec's "
            f"allocator, {ALLOCATOR_SWITCH}=1 replaces that manager by kvspec's: set one of them"
        )
    check_vllm_version(vllm_module("vllm").__version__)
    if planning:
        install()
    if shadowing:
        shadow.install()
    if allocating:
        scheduler_seam.install()


def install() -> None:
    """Replace ``get_kv_cache_configs`` in :data:`PATCHED_MODULES` by kvspec's planning;
    refuses when they no longer hold vLLM's one function (another plugin patched it)."""
    modules = [vllm_module(name) for name in PATCHED_MODULES]
    current = [getattr(module, "get_kv_cache_configs", None) for module in modules]
    if all(getattr(function, "kvspec_vllm", False) for function in current):
        return
    original = current[0]
    if original is None or any(function is not original for function in current):
        raise KVSpecVLLMError(
            "kvspec-vllm: vLLM's get_kv_cache_configs is missing or already replaced in "
            f"{', '.join(PATCHED_MODULES)} (another plugin patched it?); refusing to stack "
            "over it. Unset KVSPEC_VLLM or remove the other patch"
        )
    replacement = planned_by_kvspec(original)
    for module in modules:
        module.get_kv_cache_configs = replacement


def uninstall() -> None:
    """Put vLLM's own ``get_kv_cache_configs`` back (tests switch the plugin off with it)."""
    for name in PATCHED_MODULES:
        module = vllm_module(name)
        function = module.get_kv_cache_configs
        if getattr(function, "kvspec_vllm", False):
            module.get_kv_cache_configs = function.__wrapped__
