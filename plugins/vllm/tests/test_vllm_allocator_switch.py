"""The allocator switch (``KVSPEC_VLLM_ALLOCATOR``): no vLLM needed (these run in the main
.venv too)."""

from __future__ import annotations

import pytest
from kvspec_vllm import ALLOCATOR_SWITCH, KVSpecVLLMError, allocator_enabled, plugin


@pytest.mark.parametrize("value", ["1", "true", "On"])
def test_allocator_switch_on(value: str) -> None:
    assert allocator_enabled({ALLOCATOR_SWITCH: value})


@pytest.mark.parametrize("environ", [{}, {ALLOCATOR_SWITCH: "0"}, {"KVSPEC_VLLM": "1"}])
def test_allocator_switch_off(environ: dict[str, str]) -> None:
    assert not allocator_enabled(environ)


def test_allocator_switch_typo_is_refused_naming_the_variable() -> None:
    with pytest.raises(KVSpecVLLMError, match=r"KVSPEC_VLLM_ALLOCATOR='kvspec'"):
        allocator_enabled({ALLOCATOR_SWITCH: "kvspec"})


def test_shadow_and_allocator_together_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shadow mode mirrors vLLM's manager, the allocator switch replaces it: both on is
    refused before anything is installed."""
    monkeypatch.setenv("KVSPEC_VLLM_SHADOW", "1")
    monkeypatch.setenv(ALLOCATOR_SWITCH, "1")
    with pytest.raises(KVSpecVLLMError, match="set one of them"):
        plugin.register()
