"""Worked examples: every sliding-window spec against the reference engine's formulas."""

from __future__ import annotations

import re

import pytest
import torch
from sliding_window_testkit import manager_with_plugin, swa_fields

from kvspec_core import FullAttentionSpec, SizingContext, UniformTypeSpecs
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError, MergeError
from kvspec_core.specs import spec_from_dict, spec_to_dict
from kvspec_sliding_window import KpoolTailSpec, ReferenceSlidingWindowSpec, SlidingWindowSpec

# Mistral-7B geometry: one page of 16 tokens = 16 tokens x 8 heads x (128 K + 128 V) x 2 B.
MISTRAL_PAGE = 16 * 8 * 256 * 2


# --------------------------------------------------------------------------- page geometry
def test_page_size_unpadded_is_tokens_times_heads_times_kv_bytes() -> None:
    spec = SlidingWindowSpec(**swa_fields())
    assert spec.unpadded_page_size_bytes == MISTRAL_PAGE == 65536
    assert spec.page_size_bytes == MISTRAL_PAGE
    assert (spec.num_heads, spec.num_states, spec.state_content_size_bytes) == (8, 16, 512)


def test_page_size_padded_replaces_the_real_size() -> None:
    spec = SlidingWindowSpec(**swa_fields(page_size_padded=MISTRAL_PAGE + 4096))
    assert spec.page_size_bytes == MISTRAL_PAGE + 4096
    assert spec.unpadded_page_size_bytes == MISTRAL_PAGE


def test_padding_below_the_real_page_is_refused_naming_the_field() -> None:
    with pytest.raises(
        InvalidFieldError, match=re.escape("SlidingWindowSpec.page_size_padded=65535")
    ):
        SlidingWindowSpec(**swa_fields(page_size_padded=MISTRAL_PAGE - 1))


@pytest.mark.parametrize(
    "cls, extra",
    [
        (KpoolTailSpec, {}),
        (ReferenceSlidingWindowSpec, {"sliding_window": None, "rswa_window": 256}),
    ],
)
def test_padded_and_unpadded_pages_of_the_other_kinds(cls: type, extra: dict) -> None:
    plain = cls(**swa_fields(**extra))
    padded = cls(**swa_fields(page_size_padded=MISTRAL_PAGE + 64, **extra))
    assert plain.page_size_bytes == padded.unpadded_page_size_bytes == MISTRAL_PAGE
    assert padded.page_size_bytes == MISTRAL_PAGE + 64
    ctx = SizingContext(max_model_len=32768)
    assert padded.max_memory_usage_bytes(ctx) == (
        padded.max_blocks_per_request(ctx) * (MISTRAL_PAGE + 64)
    )


def test_asymmetric_heads_and_fp32() -> None:
    spec = SlidingWindowSpec(
        **swa_fields(
            head_size=192, head_size_v=128, dtype=torch.float32, num_kv_heads=2, block_size=32
        )
    )
    assert spec.page_size_bytes == 32 * 2 * (192 + 128) * 4


# --------------------------------------------------------------------------- sizing
# (window, extra_retained, in_flight, max_model_len, block_size, blocks), worked by hand from
# cdiv(min(window - 1 + extra + in_flight, max_len), block) + 1.
ADMISSION_CASES = [
    (4096, 0, 16384, 32768, 16, 1281),  # min(20479, 32768) = 20479 -> 1280 + 1
    (4096, 0, 16384, 8192, 16, 513),  # capped at max_len 8192 -> 512 + 1
    (4096, 0, 2048, 131072, 16, 385),  # 6143 -> 384 (383.94 rounded up) + 1
    (128, 0, 2048, 131072, 16, 137),  # gpt-oss: 2175 -> 136 + 1
    (128, 3, 2048, 131072, 16, 138),  # 2178 -> 137 + 1
    (4, 0, 1, 100, 4, 2),  # the reference's own example: [xxCD][EF]
    (2047, 0, 8192, 4096, 16, 257),  # Phi-3: capped at 4096 -> 256 + 1
    (1, 0, 1, 1, 1, 2),  # smallest possible request
]


@pytest.mark.parametrize("window, extra, in_flight, max_len, block, blocks", ADMISSION_CASES)
def test_admission_cap_and_max_memory(
    window: int, extra: int, in_flight: int, max_len: int, block: int, blocks: int
) -> None:
    spec = SlidingWindowSpec(
        **swa_fields(sliding_window=window, extra_retained_tokens=extra, block_size=block)
    )
    ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=in_flight)
    assert spec.max_blocks_per_request(ctx) == blocks
    assert spec.max_memory_usage_bytes(ctx) == blocks * spec.page_size_bytes


@pytest.mark.parametrize(
    "dcp, sharded, blocks",
    [
        (1, True, 1281),
        (2, True, 641),  # cdiv(20479, 2) = 10240 -> 640 + 1
        (4, True, 321),  # 5120 -> 320 + 1
        (3, True, 428),  # 6827 -> 427 (426.7) + 1
        (4, False, 1281),  # a replicated (unsharded) cache holds the whole range on every rank
    ],
)
def test_admission_cap_under_decode_context_parallelism(
    dcp: int, sharded: bool, blocks: int
) -> None:
    spec = SlidingWindowSpec(**swa_fields(dcp_sharded=sharded))
    ctx = SizingContext(max_model_len=32768, max_in_flight_tokens=16384, dcp_size=dcp)
    assert spec.max_blocks_per_request(ctx) == blocks
    assert spec.max_memory_usage_bytes(ctx) == blocks * MISTRAL_PAGE


@pytest.mark.parametrize(
    "max_len, dcp, sharded, width",
    [
        (32768, 1, True, 2048),
        (32768, 4, True, 512),
        (32769, 4, True, 513),
        (32768, 4, False, 2048),
    ],
)
def test_block_table_width_covers_every_position(
    max_len: int, dcp: int, sharded: bool, width: int
) -> None:
    spec = SlidingWindowSpec(**swa_fields(dcp_sharded=sharded))
    ctx = SizingContext(max_model_len=max_len, dcp_size=dcp)
    assert spec.block_table_width(ctx, max_len) == width


def test_kpool_tail_holds_one_block_whatever_the_length() -> None:
    spec = KpoolTailSpec(**swa_fields(block_size=64, sliding_window=64))
    for max_len in (1, 64, 65, 131072):
        ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=8192, dcp_size=2)
        assert spec.max_blocks_per_request(ctx) == 1
        assert spec.block_table_width(ctx, max_len) == 1
        assert spec.max_memory_usage_bytes(ctx) == spec.page_size_bytes == 64 * 8 * 256 * 2


def test_reference_sliding_window_is_sized_as_full_attention() -> None:
    rswa = ReferenceSlidingWindowSpec(**swa_fields(sliding_window=None, rswa_window=512))
    full = FullAttentionSpec(**swa_fields(sliding_window=None))
    for max_len, dcp in [(1, 1), (4096, 1), (32768, 1), (32769, 4), (131072, 8)]:
        ctx = SizingContext(max_model_len=max_len, dcp_size=dcp)
        assert rswa.max_memory_usage_bytes(ctx) == full.max_memory_usage_bytes(ctx)
        assert rswa.block_table_width(ctx, max_len) == full.block_table_width(ctx, max_len)
    ctx = SizingContext(max_model_len=32768)
    assert rswa.max_blocks_per_request(ctx) == 2048
    assert rswa.max_memory_usage_bytes(ctx) == 2048 * MISTRAL_PAGE
    ctx = SizingContext(max_model_len=32769, dcp_size=4)
    assert rswa.max_blocks_per_request(ctx) == 513  # cdiv(cdiv(32769, 4), 16)


# --------------------------------------------------------------------------- properties
def test_runtime_properties() -> None:
    swa = SlidingWindowSpec(**swa_fields())
    tail = KpoolTailSpec(**swa_fields())
    rswa = ReferenceSlidingWindowSpec(**swa_fields(sliding_window=None, rswa_window=64))
    assert (swa.prefix_cacheable, swa.uses_slot_mapping, swa.has_layer_views) == (True, True, True)
    assert swa.block_table_token_alignment == 128
    assert (tail.prefix_cacheable, tail.uses_slot_mapping, tail.has_layer_views) == (
        False,
        False,
        True,
    )
    assert (rswa.prefix_cacheable, rswa.uses_slot_mapping) == (True, True)
    assert swa.dcp_sharded is True  # attention caches are DCP-sharded unless told otherwise
    assert swa.view_dtype == torch.bfloat16


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "field, value, error",
    [
        ("sliding_window", 0, InvalidFieldError),
        ("sliding_window", -4096, InvalidFieldError),
        ("sliding_window", True, InvalidFieldTypeError),
        ("sliding_window", 4096.0, InvalidFieldTypeError),
        ("extra_retained_tokens", -1, InvalidFieldError),
        ("extra_retained_tokens", "2", InvalidFieldTypeError),
    ],
)
def test_invalid_fields_are_refused_naming_class_and_field(
    field: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=rf"SlidingWindowSpec\.{field}="):
        SlidingWindowSpec(**swa_fields(**{field: value}))


def test_missing_window_is_refused() -> None:
    fields = swa_fields()
    del fields["sliding_window"]
    with pytest.raises(TypeError, match="sliding_window"):
        SlidingWindowSpec(**fields)


def test_invalid_rswa_window_is_refused() -> None:
    with pytest.raises(InvalidFieldError, match=r"ReferenceSlidingWindowSpec\.rswa_window=0"):
        ReferenceSlidingWindowSpec(**swa_fields(sliding_window=None, rswa_window=0))


# --------------------------------------------------------------------------- merge
def test_merge_of_equal_layers_returns_the_spec() -> None:
    spec = SlidingWindowSpec(**swa_fields())
    assert SlidingWindowSpec.merge([spec, spec, spec], ["l0", "l1", "l2"]) == spec
    tail = KpoolTailSpec(**swa_fields())
    assert KpoolTailSpec.merge([tail, tail]) == tail


@pytest.mark.parametrize(
    "field, other",
    [
        ("sliding_window", 128),
        ("extra_retained_tokens", 3),
        ("num_kv_heads", 4),
        ("dtype", torch.float16),
    ],
)
def test_merge_refusal_names_field_values_and_layers(field: str, other: object) -> None:
    base = SlidingWindowSpec(**swa_fields())
    odd = SlidingWindowSpec(**swa_fields(**{field: other}))
    with pytest.raises(MergeError) as caught:
        SlidingWindowSpec.merge(
            [base, odd, base], ["model.layers.0", "model.layers.1", "model.layers.2"]
        )
    message = str(caught.value)
    assert f"field {field!r} differs" in message
    assert repr(getattr(base, field)) in message and repr(other) in message
    assert "model.layers.0, model.layers.2" in message and "model.layers.1" in message


def test_merge_refuses_a_tail_among_windows() -> None:
    with pytest.raises(
        MergeError, match=re.escape("model.layers.1 is a KpoolTailSpec, not a SlidingWindowSpec")
    ):
        SlidingWindowSpec.merge(
            [SlidingWindowSpec(**swa_fields()), KpoolTailSpec(**swa_fields())],
            ["model.layers.0", "model.layers.1"],
        )


def test_merge_of_nothing_is_refused() -> None:
    with pytest.raises(MergeError, match="empty"):
        SlidingWindowSpec.merge([])


def test_rswa_merge_combines_non_causal_and_keeps_one_window() -> None:
    causal = ReferenceSlidingWindowSpec(**swa_fields(sliding_window=None, rswa_window=256))
    prefix_lm = ReferenceSlidingWindowSpec(
        **swa_fields(sliding_window=None, rswa_window=256, non_causal=True)
    )
    merged = ReferenceSlidingWindowSpec.merge([causal, prefix_lm], ["a", "b"])
    assert merged.non_causal is True and merged.rswa_window == 256
    assert type(merged) is ReferenceSlidingWindowSpec


def test_rswa_merge_refuses_two_windows_naming_layers() -> None:
    a = ReferenceSlidingWindowSpec(**swa_fields(sliding_window=None, rswa_window=256))
    b = ReferenceSlidingWindowSpec(**swa_fields(sliding_window=None, rswa_window=512))
    with pytest.raises(MergeError) as caught:
        ReferenceSlidingWindowSpec.merge([a, b, b], ["vision.0", "text.1", "text.2"])
    assert "'rswa_window' differs (256 in vision.0; 512 in text.1, text.2)" in str(caught.value)


def test_rswa_merge_refuses_plain_full_attention() -> None:
    rswa = ReferenceSlidingWindowSpec(**swa_fields(sliding_window=None, rswa_window=256))
    full = FullAttentionSpec(**swa_fields(sliding_window=None))
    with pytest.raises(MergeError, match="layer y is a FullAttentionSpec"):
        ReferenceSlidingWindowSpec.merge([rswa, full], ["x", "y"])


# --------------------------------------------------------------------------- uniformity
def test_uniformity_decisions() -> None:
    registry = manager_with_plugin().spec_kinds
    swa = SlidingWindowSpec(**swa_fields())
    swa_other_shape = SlidingWindowSpec(**swa_fields(num_kv_heads=2, head_size=64))
    swa_other_window = SlidingWindowSpec(**swa_fields(sliding_window=1024))
    tail = KpoolTailSpec(**swa_fields())
    full = FullAttentionSpec(**swa_fields(sliding_window=None))
    rswa = ReferenceSlidingWindowSpec(**swa_fields(sliding_window=None, rswa_window=4096))
    rswa_other = ReferenceSlidingWindowSpec(**swa_fields(sliding_window=None, rswa_window=64))

    def uniform(*specs: object) -> bool:
        return UniformTypeSpecs.is_uniform_type(
            {f"l{i}": spec for i, spec in enumerate(specs)}, registry
        )  # type: ignore[misc]

    assert uniform(swa, swa_other_shape)
    assert not uniform(swa, swa_other_window)
    assert not uniform(swa, tail) and not uniform(tail, swa)
    assert uniform(tail, KpoolTailSpec(**swa_fields(sliding_window=8)))
    assert not uniform(swa, full) and not uniform(full, swa)
    assert uniform(rswa, rswa) and not uniform(rswa, rswa_other)
    assert not uniform(rswa, full) and not uniform(full, rswa)
    assert not uniform(swa, rswa)
    group = UniformTypeSpecs.from_specs({"a": swa, "b": swa_other_shape}, registry)
    assert group is not None
    ctx = SizingContext(max_model_len=32768)
    assert group.max_blocks_per_request(ctx) == swa.max_blocks_per_request(ctx) == 1281
    assert group.page_size_bytes == swa.page_size_bytes + swa_other_shape.page_size_bytes


# --------------------------------------------------------------------------- serialisation
@pytest.mark.parametrize(
    "spec",
    [
        SlidingWindowSpec(**swa_fields(extra_retained_tokens=2, page_size_padded=70000)),
        KpoolTailSpec(**swa_fields(sliding_window=64)),
        ReferenceSlidingWindowSpec(
            **swa_fields(sliding_window=None, rswa_window=64, non_causal=True)
        ),
    ],
)
def test_specs_round_trip_through_plain_data(spec: object) -> None:
    registry = manager_with_plugin().spec_kinds
    data = spec_to_dict(spec)  # type: ignore[arg-type]
    assert spec_from_dict(data, registry) == spec
