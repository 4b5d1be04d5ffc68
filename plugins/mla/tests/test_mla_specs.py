"""Worked examples for the MLA specs against the reference engine's formulas."""

from __future__ import annotations

import re

import attrs
import pytest
import torch
from mla_testkit import latent_fields, manager_with_mla

from kvspec_core import SizingContext
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError, MergeError
from kvspec_core.kv_dtypes import BUILTIN_QUANT_MODES
from kvspec_core.specs import FullAttentionSpec, UniformTypeSpecs, spec_from_dict, spec_to_dict
from kvspec_mla import (
    CircularBufferSpec,
    HiddenStateCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)

FP8_PER_TENSOR = next(mode for mode in BUILTIN_QUANT_MODES if mode.name == "fp8_per_tensor")
#: DeepSeek-V2-Lite: 576 bf16 values per token, block 16.
BF16_PAGE = 16 * 576 * 2


# --------------------------------------------------------------------------- page size
@pytest.mark.parametrize(
    "overrides, unpadded, page",
    [
        ({}, BF16_PAGE, BF16_PAGE),  # 18,432
        ({"block_size": 64}, 64 * 1152, 64 * 1152),
        ({"dtype": torch.float8_e4m3fn, "kv_quant_mode": FP8_PER_TENSOR}, 16 * 576, 16 * 576),
        ({"dtype": torch.uint8, "cache_dtype_str": "fp8_ds_mla"}, 16 * 656, 16 * 656),
        ({"dtype": torch.uint8, "cache_dtype_str": "fp8_ds_mla", "block_size": 64}, 41984, 41984),
        ({"dtype": torch.uint8, "cache_dtype_str": "nvfp4_ds_mla", "block_size": 64}, 22528, 22528),
        # DeepSeek-V4: 584 B records, page rounded up to the 576 B TMA stride: 65 x 576.
        (
            {
                "dtype": torch.uint8,
                "cache_dtype_str": "fp8_ds_mla",
                "model_version": "deepseek_v4",
                "head_size": 512,
                "block_size": 64,
                "alignment": 576,
            },
            37376,
            37440,
        ),
        # alignment pads up to the next multiple, and leaves an aligned page alone.
        ({"alignment": 4096}, BF16_PAGE, 20480),
        ({"alignment": 1024}, BF16_PAGE, BF16_PAGE),
        ({"alignment": 4096, "page_size_padded": 24576}, BF16_PAGE, 24576),
        ({"page_size_padded": 20000}, BF16_PAGE, 20000),
        # a backend-published record size wins over the table.
        (
            {"dtype": torch.uint8, "cache_dtype_str": "fp8_ds_mla", "state_content_bytes": 600},
            16 * 600,
            16 * 600,
        ),
        # non-DS cache dtype names keep the dense formula.
        ({"cache_dtype_str": "auto"}, BF16_PAGE, BF16_PAGE),
    ],
)
def test_mla_page_size(overrides: dict, unpadded: int, page: int) -> None:
    spec = MLAAttentionSpec(**latent_fields(**overrides))
    assert spec.unpadded_page_size_bytes == unpadded
    assert spec.page_size_bytes == page
    assert spec.head_size_v == 0


def test_fp8_ds_mla_stores_656_bytes_per_token() -> None:
    for block in (1, 16, 64, 256):
        spec = MLAAttentionSpec(
            **latent_fields(block_size=block, dtype=torch.uint8, cache_dtype_str="fp8_ds_mla")
        )
        assert spec.page_size_bytes == 656 * block
        assert spec.view_dtype == torch.uint8


def test_hidden_state_cache_is_paged_like_mla() -> None:
    hidden = HiddenStateCacheSpec(**latent_fields(alignment=4096))
    assert hidden.page_size_bytes == 20480
    assert type(hidden).kind == "hidden_state_cache"


@pytest.mark.parametrize(
    "overrides, field, error",
    [
        ({"head_size_v": -1}, "head_size_v", InvalidFieldError),
        ({"head_size_v": 1.0}, "head_size_v", InvalidFieldTypeError),
        ({"cache_dtype_str": ""}, "cache_dtype_str", InvalidFieldError),
        ({"cache_dtype_str": 8}, "cache_dtype_str", InvalidFieldTypeError),
        (
            {"cache_dtype_str": "int3_ds_mla", "dtype": torch.uint8},
            "cache_dtype_str",
            InvalidFieldError,
        ),
        (
            {"cache_dtype_str": "nvfp4_ds_mla", "model_version": "deepseek_v4", "head_size": 512},
            "cache_dtype_str",
            InvalidFieldError,
        ),
        ({"cache_dtype_str": "fp8_ds_mla", "head_size": 512}, "head_size", InvalidFieldError),
        ({"alignment": 0}, "alignment", InvalidFieldError),
        ({"alignment": 4096, "page_size_padded": 20000}, "page_size_padded", InvalidFieldError),
        ({"page_size_padded": 100}, "page_size_padded", InvalidFieldError),
        ({"model_version": "deepseek_v5"}, "model_version", InvalidFieldError),
        ({"cache_role": "dense"}, "cache_role", InvalidFieldError),
        ({"is_index_group_leader": 1}, "is_index_group_leader", InvalidFieldTypeError),
        ({"storage_block_size": 0}, "storage_block_size", InvalidFieldError),
        (
            {"non_causal_multi_token_decode": "yes"},
            "non_causal_multi_token_decode",
            InvalidFieldTypeError,
        ),
    ],
)
def test_invalid_fields_are_refused_naming_the_field(
    overrides: dict, field: str, error: type
) -> None:
    with pytest.raises(error) as caught:
        MLAAttentionSpec(**latent_fields(**overrides))
    assert caught.value.field == field
    assert "MLAAttentionSpec" in str(caught.value)


def test_unpublished_format_names_the_published_ones() -> None:
    with pytest.raises(InvalidFieldError) as caught:
        MLAAttentionSpec(
            **latent_fields(
                dtype=torch.uint8,
                cache_dtype_str="nvfp4_ds_mla",
                model_version="deepseek_v4",
                head_size=512,
            )
        )
    message = str(caught.value)
    assert "no byte size is published" in message
    assert "nvfp4_ds_mla (model_version=None, head_size=576: 352 B/token)" in message
    assert "state_content_bytes" in message


# --------------------------------------------------------------------------- sizing
@pytest.mark.parametrize(
    "max_len, dcp, blocks, width",
    [
        (1, 1, 1, 1),
        (16, 1, 1, 1),
        (17, 1, 2, 2),
        (163840, 1, 10240, 10240),  # DeepSeek-V2-Lite's full context
        (163840, 2, 5120, 5120),  # DCP shards the latent's token positions
        (163841, 4, 2561, 2561),  # cdiv(cdiv(163841, 4), 16)
    ],
)
def test_mla_max_memory_and_width(max_len: int, dcp: int, blocks: int, width: int) -> None:
    spec = MLAAttentionSpec(**latent_fields())
    ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=16384, dcp_size=dcp)
    assert spec.max_blocks_per_request(ctx) == blocks
    assert spec.max_memory_usage_bytes(ctx) == blocks * BF16_PAGE
    assert spec.block_table_width(ctx, max_len) == width


def test_mla_sizing_ignores_in_flight_tokens() -> None:
    spec = MLAAttentionSpec(**latent_fields(dtype=torch.uint8, cache_dtype_str="fp8_ds_mla"))
    sizes = {
        spec.max_memory_usage_bytes(SizingContext(max_model_len=4096, max_in_flight_tokens=n))
        for n in (1, 512, 8192, 1 << 20)
    }
    assert sizes == {256 * 16 * 656}


@pytest.mark.parametrize("max_len", [1, 100, 163840, 1 << 30])
def test_circular_buffer_holds_one_block_for_life(max_len: int) -> None:
    ring = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=512, dtype=torch.bfloat16)
    ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=8192, dcp_size=2)
    assert ring.page_size_bytes == 8 * 1 * (512 + 512) * 2
    assert ring.max_blocks_per_request(ctx) == 1
    assert ring.max_memory_usage_bytes(ctx) == ring.page_size_bytes
    assert ring.block_table_width(ctx, max_len) == 1


def test_runtime_properties() -> None:
    mla = MLAAttentionSpec(**latent_fields())
    ring = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=512, dtype=torch.bfloat16)
    swa = SlidingWindowMLASpec(**latent_fields(sliding_window=128))
    replay = SlidingWindowMLASpec(**latent_fields(sliding_window=128, bounded_replay=True))
    assert (mla.prefix_cacheable, mla.uses_slot_mapping, mla.block_table_token_alignment) == (
        True,
        True,
        128,
    )
    assert mla.prefix_replay_tokens == 0
    assert (ring.prefix_cacheable, ring.uses_slot_mapping, ring.block_table_token_alignment) == (
        False,
        False,
        None,
    )
    assert (swa.prefix_cacheable, swa.prefix_replay_tokens) == (True, 0)
    assert (replay.prefix_cacheable, replay.prefix_replay_tokens) == (False, 128)
    for spec in (mla, ring, swa):
        assert (spec.host_resident, spec.group_role, spec.transferable) == (False, "default", True)


# --------------------------------------------------------------------------- sliding MLA
@pytest.mark.parametrize(
    "window, extra, in_flight, max_len, block, blocks",
    [
        # min(127 + 16384, 163840) = 16511 -> cdiv(16511, 64) + 1
        (128, 0, 16384, 163840, 64, 259),
        (128, 0, 16384, 1000, 64, 17),  # capped by max_model_len: cdiv(1000, 64) + 1
        (128, 3, 1, 163840, 64, 4),  # 127 + 3 + 1 = 131 -> cdiv(131, 64) + 1
        (4096, 0, 8192, 131072, 16, 769),  # 12287 -> 768 + 1
    ],
)
def test_sliding_window_mla_cap(
    window: int, extra: int, in_flight: int, max_len: int, block: int, blocks: int
) -> None:
    spec = SlidingWindowMLASpec(
        **latent_fields(
            sliding_window=window,
            extra_retained_tokens=extra,
            block_size=block,
            dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla",
        )
    )
    ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=in_flight)
    assert spec.max_blocks_per_request(ctx) == blocks
    assert spec.page_size_bytes == block * 656
    assert spec.max_memory_usage_bytes(ctx) == blocks * block * 656


def test_sliding_window_mla_pads_like_mla() -> None:
    spec = SlidingWindowMLASpec(
        **latent_fields(
            sliding_window=128,
            block_size=64,
            head_size=512,
            dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla",
            model_version="deepseek_v4",
            alignment=576,
        )
    )
    assert (spec.unpadded_page_size_bytes, spec.page_size_bytes) == (37376, 37440)
    assert spec.head_size_v == 0
    with pytest.raises(InvalidFieldError) as caught:
        SlidingWindowMLASpec(**latent_fields(sliding_window=128, model_version="v3"))
    assert caught.value.field == "model_version"


# --------------------------------------------------------------------------- merge
def test_merge_of_equal_specs_returns_the_spec() -> None:
    spec = MLAAttentionSpec(**latent_fields(cache_role="indexer", alignment=4096))
    assert MLAAttentionSpec.merge([spec, spec, spec], ["a", "b", "c"]) == spec


def test_merge_combines_decode_capability_with_any() -> None:
    plain = MLAAttentionSpec(**latent_fields())
    capable = attrs.evolve(plain, non_causal_multi_token_decode=True)
    merged = MLAAttentionSpec.merge([plain, capable, plain], ["l0", "l1", "l2"])
    assert merged.non_causal_multi_token_decode is True
    assert merged == capable


@pytest.mark.parametrize(
    "field, left, right",
    [
        ("cache_dtype_str", "fp8_ds_mla", None),
        ("model_version", None, "deepseek_v4"),
        ("cache_role", "sparse", "indexer"),
        ("is_index_group_leader", False, True),
        ("storage_block_size", None, 256),
        ("block_stride_alignment", None, 512),
        ("alignment", None, 4096),
        ("tokens_per_state", 1, 4),
        ("head_size", 576, 512),
    ],
)
def test_merge_refusals_name_field_values_and_layers(
    field: str, left: object, right: object
) -> None:
    base = latent_fields(dtype=torch.uint8) if field == "cache_dtype_str" else latent_fields()
    if field == "model_version":
        base = latent_fields(head_size=512)
    a = MLAAttentionSpec(**{**base, field: left})
    b = MLAAttentionSpec(**{**base, field: right})
    with pytest.raises(MergeError) as caught:
        MLAAttentionSpec.merge([a, a, b], ["model.layers.0", "model.layers.1", "model.layers.2"])
    message = str(caught.value)
    assert repr(field) in message
    assert repr(left) in message and repr(right) in message
    assert "model.layers.0, model.layers.1" in message and "model.layers.2" in message


def test_merge_refuses_mixed_classes_naming_the_layer() -> None:
    mla = MLAAttentionSpec(**latent_fields())
    hidden = HiddenStateCacheSpec(**latent_fields())
    with pytest.raises(MergeError, match=re.escape("model.layers.1 is a HiddenStateCacheSpec")):
        MLAAttentionSpec.merge([mla, hidden], ["model.layers.0", "model.layers.1"])


@pytest.mark.parametrize(
    "field, left, right",
    [
        ("sliding_window", 128, 256),
        ("bounded_replay", False, True),
        ("extra_retained_tokens", 0, 2),
        ("cache_dtype_str", None, "fp8_ds_mla"),
    ],
)
def test_sliding_window_mla_merge_refusals(field: str, left: object, right: object) -> None:
    base = latent_fields(sliding_window=128, dtype=torch.uint8)
    a = SlidingWindowMLASpec(**{**base, field: left})
    b = SlidingWindowMLASpec(**{**base, field: right})
    assert SlidingWindowMLASpec.merge([a, a], ["x", "y"]) == a
    with pytest.raises(MergeError) as caught:
        SlidingWindowMLASpec.merge([a, b], ["swa.0", "swa.1"])
    assert repr(field) in str(caught.value) and "swa.1" in str(caught.value)


def test_circular_buffer_merge_requires_equal_rings() -> None:
    ring = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=512, dtype=torch.bfloat16)
    other = attrs.evolve(ring, block_size=16)
    assert CircularBufferSpec.merge([ring, ring], ["r0", "r1"]) == ring
    with pytest.raises(MergeError, match="'block_size'"):
        CircularBufferSpec.merge([ring, other], ["r0", "r1"])


# --------------------------------------------------------------------------- uniformity
def test_uniformity_decisions() -> None:
    registry = manager_with_mla().spec_kinds
    mla = MLAAttentionSpec(**latent_fields())
    indexer = MLAAttentionSpec(**latent_fields(head_size=128, cache_role="indexer"))
    hidden = HiddenStateCacheSpec(**latent_fields())
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    ring = CircularBufferSpec(block_size=16, num_kv_heads=1, head_size=512, dtype=torch.bfloat16)
    swa = SlidingWindowMLASpec(**latent_fields(sliding_window=128))
    swa_other_window = SlidingWindowMLASpec(**latent_fields(sliding_window=256))
    swa_replay = SlidingWindowMLASpec(**latent_fields(sliding_window=128, bounded_replay=True))

    def uniform(*specs: object) -> bool:
        return UniformTypeSpecs.is_uniform_type(
            {f"l{i}": spec for i, spec in enumerate(specs)}, registry
        )

    # Every MLA layer holds every token, like full attention: one uniform group.
    assert uniform(mla, indexer, hidden)
    assert uniform(mla, full) and uniform(full, mla)
    assert not uniform(mla, ring) and not uniform(ring, mla)
    assert uniform(ring, ring)
    assert uniform(swa, swa)
    assert not uniform(swa, swa_other_window)
    assert not uniform(swa, swa_replay)
    assert not uniform(swa, mla) and not uniform(mla, swa)
    group = UniformTypeSpecs.from_specs({"a": mla, "b": indexer}, registry)
    assert group is not None
    assert group.page_size_bytes == BF16_PAGE + 16 * 128 * 2


# --------------------------------------------------------------------------- serialisation
def test_specs_round_trip_through_plain_data() -> None:
    registry = manager_with_mla().spec_kinds
    specs = [
        MLAAttentionSpec(
            **latent_fields(
                dtype=torch.uint8,
                cache_dtype_str="fp8_ds_mla",
                alignment=4096,
                cache_role="indexer",
            )
        ),
        HiddenStateCacheSpec(**latent_fields()),
        CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=512, dtype=torch.bfloat16),
        SlidingWindowMLASpec(**latent_fields(sliding_window=128, bounded_replay=True)),
    ]
    for spec in specs:
        again = spec_from_dict(spec_to_dict(spec), registry)
        assert again == spec and type(again) is type(spec)
        assert again.page_size_bytes == spec.page_size_bytes
