"""The switch and the version gate: no vLLM needed (these run in the main .venv too)."""

from __future__ import annotations

import pytest
from kvspec_vllm import KVSpecVLLMError, check_vllm_version, plugin_enabled, shadow_enabled
from kvspec_vllm.version import release_of


@pytest.mark.parametrize("value", ["1", "true", "ON", " yes "])
def test_switch_on(value: str) -> None:
    assert plugin_enabled({"KVSPEC_VLLM": value})


@pytest.mark.parametrize(
    "environ", [{}, {"KVSPEC_VLLM": ""}, {"KVSPEC_VLLM": "0"}, {"KVSPEC_VLLM": "off"}]
)
def test_switch_off(environ: dict[str, str]) -> None:
    assert not plugin_enabled(environ)


def test_switch_typo_is_refused_naming_the_variable() -> None:
    with pytest.raises(KVSpecVLLMError, match=r"KVSPEC_VLLM='2'.*KVSPEC_VLLM=1"):
        plugin_enabled({"KVSPEC_VLLM": "2"})


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.0+cpu"])
def test_supported_versions(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "0.32", "dev"])
def test_other_versions_are_refused(version: str) -> None:
    with pytest.raises(KVSpecVLLMError, match=r"supports vLLM >=0.32.0,<0.33, found vLLM"):
        check_vllm_version(version)


def test_release_of() -> None:
    assert release_of("0.32.1rc1.dev5+g1234") == (0, 32, 1)
    assert release_of("main") is None


def test_shadow_switch() -> None:
    assert shadow_enabled({"KVSPEC_VLLM_SHADOW": "1"})
    assert not shadow_enabled({"KVSPEC_VLLM": "1"})
    with pytest.raises(KVSpecVLLMError, match=r"KVSPEC_VLLM_SHADOW='maybe'"):
        shadow_enabled({"KVSPEC_VLLM_SHADOW": "maybe"})
