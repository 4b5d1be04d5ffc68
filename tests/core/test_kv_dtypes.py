"""KV-cache dtypes and quant modes are data, extendable by plugins."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from kvspec_core import KVCacheDtype, KVQuantMode, PluginManager
from kvspec_core.errors import InvalidFieldError, KVSpecError, PluginError, UnknownNameError

ENGINE_NAMES = [
    "auto",
    "bfloat16",
    "float16",
    "float32",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8_per_token_head",
    "fp8_per_token_head",
    "int4_per_token_head",
    "nvfp4",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "nvfp4_ds_mla",
]


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_every_engine_name_is_known(name: str) -> None:
    assert PluginManager().kv_dtypes.get(name)


def test_auto_takes_the_model_dtype() -> None:
    registry = PluginManager().kv_dtypes
    assert registry.get("auto").resolve_storage(torch.float16) == torch.float16
    assert registry.get("fp8_e4m3").resolve_storage(torch.bfloat16) == torch.float8_e4m3fn
    assert registry.get("fp8").quant_mode.name == "fp8_per_tensor"
    assert registry.get("int8_per_token_head").quant_mode.per_token_head


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown KV cache dtype 'fp9'.*fp8_e5m2"):
        PluginManager().kv_dtypes.get("fp9")


def test_quant_mode_content_bytes() -> None:
    mode = KVQuantMode(name="k6v4", key_bits=6, value_bits=4, scale_bytes_per_token_head=2)
    assert mode.content_bytes(128, 128, torch.uint8) == (128 * 6 + 128 * 4) // 8 + 2
    half = KVQuantMode(name="half_bit", key_bits=Fraction(1, 2), value_bits=Fraction(1, 2))
    assert half.content_bytes(3, 3, torch.uint8) == 1  # 3 bits rounds up to one byte


def test_quant_mode_validates_bits() -> None:
    with pytest.raises(InvalidFieldError, match="key_bits"):
        KVQuantMode(name="bad", key_bits=0)
    with pytest.raises(InvalidFieldError, match="scale_bytes_per_token_head"):
        KVQuantMode(name="bad", scale_bytes_per_token_head=-1)


def test_a_name_differing_only_in_case_is_refused() -> None:
    """Found in review: a plugin registering 'FP8' beside the core's 'fp8' made
    --kv-cache-dtype FP8 silently pick the plugin's dtype."""
    registry = PluginManager().kv_dtypes
    with pytest.raises(PluginError, match=r"'FP8'.*differs only in case from 'fp8'.*'core'"):
        registry.register(KVCacheDtype(name="FP8", storage_dtype=torch.uint8), "intruder")
    assert "FP8" not in registry.names()


def test_a_registered_name_cannot_be_redefined_by_another_owner() -> None:
    registry = PluginManager().kv_dtypes
    with pytest.raises(PluginError, match=r"'fp8'.*already registered by 'core'"):
        registry.register(KVCacheDtype(name="fp8", storage_dtype=torch.uint8), "intruder")
    registry.register(
        KVCacheDtype(
            name="int2",
            storage_dtype=torch.uint8,
            quant_mode=KVQuantMode(name="int2", key_bits=2, value_bits=2),
        ),
        "plugin",
    )
    assert registry.get("int2").quant_mode.key_bits == 2
    registry.remove_owner("plugin")
    with pytest.raises(UnknownNameError):
        registry.get("int2")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"aliases": "bf16"}, "aliases"),  # a bare str would register "b", "f", "1", "6"
        ({"aliases": ("ok", 3)}, "aliases"),
        ({"aliases": ("ok", " ")}, "aliases"),
        ({"name": ""}, "name"),
        ({"name": 7}, "name"),
    ],
)
def test_kv_cache_dtype_names_are_validated(changes: dict[str, object], field: str) -> None:
    fields: dict[str, object] = {"name": "toy", "storage_dtype": torch.uint8}
    fields.update(changes)
    with pytest.raises(KVSpecError, match=rf"KVCacheDtype\.{field}="):
        KVCacheDtype(**fields)  # type: ignore[arg-type]


def test_quant_mode_name_must_not_be_blank() -> None:
    with pytest.raises(KVSpecError, match=r"KVQuantMode\.name=''"):
        KVQuantMode(name="")


def test_element_bits_default_to_the_storage_width() -> None:
    assert KVQuantMode(name="none").element_bits(torch.bfloat16) == (16, 16)
    k8v4 = KVQuantMode(name="k8v4_toy", key_bits=8, value_bits=4)
    assert k8v4.element_bits(torch.uint8) == (8, 4)
    # 128 K elements of 8 bits + 64 V elements of 4 bits = 160 bytes, no scales.
    assert k8v4.content_bytes(128, 64, torch.uint8) == 160
