"""Worked examples of the core attention specs against the reference formulas."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from kvspec_core import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    InvalidFieldError,
    MergeError,
    SinkFullAttentionSpec,
    SizingContext,
)
from kvspec_core.kv_dtypes import BUILTIN_KV_CACHE_DTYPES

LLAMA_8B_LAYER = dict(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


def kv_mode(name: str):
    return next(d for d in BUILTIN_KV_CACHE_DTYPES if d.name == name).quant_mode


def test_llama_page_is_block_times_heads_times_k_plus_v_times_dtype() -> None:
    spec = FullAttentionSpec(**LLAMA_8B_LAYER)
    assert spec.page_size_bytes == 16 * 8 * (128 + 128) * 2 == 65536
    # 32 layers: 2 MiB per block, 128 KiB per token.
    assert 32 * spec.page_size_bytes == 2 * 1024 * 1024
    assert 32 * spec.page_size_bytes // 16 == 131072


@pytest.mark.parametrize(
    ("max_len", "dcp", "blocks"),
    [(131072, 1, 8192), (100, 1, 7), (16, 1, 1), (17, 1, 2), (131072, 2, 4096), (33, 4, 1)],
)
def test_full_attention_max_memory(max_len: int, dcp: int, blocks: int) -> None:
    spec = FullAttentionSpec(**LLAMA_8B_LAYER)
    ctx = SizingContext(max_model_len=max_len, dcp_size=dcp)
    assert spec.max_blocks_per_request(ctx) == blocks
    assert spec.max_memory_usage_bytes(ctx) == blocks * 65536


def test_dcp_unsharded_cache_holds_every_token() -> None:
    spec = FullAttentionSpec(**LLAMA_8B_LAYER, dcp_sharded=False)
    ctx = SizingContext(max_model_len=131072, dcp_size=2)
    assert spec.max_blocks_per_request(ctx) == 8192
    assert spec.block_table_width(ctx, 131072) == 8192


def test_block_table_width_divides_by_dcp_when_sharded() -> None:
    spec = FullAttentionSpec(**LLAMA_8B_LAYER)
    assert spec.block_table_width(SizingContext(max_model_len=1000, dcp_size=4), 1000) == 16
    assert spec.block_table_width(SizingContext(max_model_len=1000), 1000) == 63


def test_k_and_v_head_sizes_may_differ() -> None:
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=192, head_size_v=128, dtype=torch.bfloat16
    )
    assert spec.state_content_size_bytes == (192 + 128) * 2
    assert spec.page_size_bytes == 16 * 8 * 640


def test_padded_page_and_its_refusal() -> None:
    spec = FullAttentionSpec(**LLAMA_8B_LAYER, page_size_padded=70000)
    assert spec.page_size_bytes == 70000
    assert spec.unpadded_page_size_bytes == 65536
    with pytest.raises(
        InvalidFieldError, match=r"page_size_padded.*>= the unpadded page size 65536"
    ):
        FullAttentionSpec(**LLAMA_8B_LAYER, page_size_padded=1000)


def test_packed_head_slots_and_state_content() -> None:
    spec = FullAttentionSpec(**LLAMA_8B_LAYER, num_head_slots=1, state_content_bytes=656)
    assert spec.num_heads == 1
    assert spec.page_size_bytes == 16 * 656


@pytest.mark.parametrize(("tokens_per_state", "states"), [(1, 16), (4, 4), (Fraction(1, 2), 32)])
def test_tokens_per_state_compresses_or_expands(tokens_per_state, states: int) -> None:
    spec = FullAttentionSpec(**LLAMA_8B_LAYER, tokens_per_state=tokens_per_state)
    assert spec.num_states == states
    assert spec.num_kernel_states(8) == int(8 // tokens_per_state)
    assert spec.page_size_bytes == states * 8 * 512


def test_tokens_per_state_must_leave_a_state_per_block() -> None:
    with pytest.raises(InvalidFieldError, match="tokens_per_state"):
        FullAttentionSpec(**LLAMA_8B_LAYER, tokens_per_state=32)
    with pytest.raises(InvalidFieldError, match="tokens_per_state"):
        FullAttentionSpec(**LLAMA_8B_LAYER, tokens_per_state=0)


@pytest.mark.parametrize(
    ("name", "dtype", "cell_bytes"),
    [
        ("fp8", torch.float8_e4m3fn, 256),
        ("int8_per_token_head", torch.int8, 256 + 8),
        ("fp8_per_token_head", torch.float8_e4m3fn, 256 + 8),
        ("int4_per_token_head", torch.uint8, 128 + 8),
        ("nvfp4", torch.uint8, 144),
        ("turboquant_k8v4", torch.uint8, (128 * 8 + 128 * 4) // 8 + 4),
        ("turboquant_3bit_nc", torch.uint8, (256 * 3) // 8 + 4),
    ],
)
def test_quantised_cells(name: str, dtype: torch.dtype, cell_bytes: int) -> None:
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=dtype, kv_quant_mode=kv_mode(name)
    )
    assert spec.state_content_size_bytes == cell_bytes
    assert spec.page_size_bytes == 16 * 8 * cell_bytes


def test_merge_records_one_window_and_ors_non_causal() -> None:
    plain = FullAttentionSpec(**LLAMA_8B_LAYER)
    windowed = FullAttentionSpec(**LLAMA_8B_LAYER, sliding_window=4096, non_causal=True)
    merged = FullAttentionSpec.merge([plain, windowed, plain], ["l0", "l1", "l2"])
    assert merged.sliding_window == 4096
    assert merged.non_causal is True
    assert FullAttentionSpec.merge([plain, plain]) == plain


def test_merge_refuses_two_windows_naming_field_values_and_layers() -> None:
    a = FullAttentionSpec(**LLAMA_8B_LAYER, sliding_window=4096)
    b = FullAttentionSpec(**LLAMA_8B_LAYER, sliding_window=1024)
    with pytest.raises(MergeError) as caught:
        FullAttentionSpec.merge([a, b], ["model.layers.0", "model.layers.1"])
    message = str(caught.value)
    assert "'sliding_window'" in message and "4096" in message and "1024" in message
    assert "model.layers.0" in message and "model.layers.1" in message


def test_merge_refuses_window_and_chunk_in_one_group() -> None:
    a = FullAttentionSpec(**LLAMA_8B_LAYER, sliding_window=4096)
    b = FullAttentionSpec(**LLAMA_8B_LAYER, attention_chunk_size=8192)
    with pytest.raises(MergeError, match="kvspec-chunked-local"):
        FullAttentionSpec.merge([a, b])


def test_merge_refuses_different_heads_and_classes() -> None:
    a = FullAttentionSpec(**LLAMA_8B_LAYER)
    with pytest.raises(MergeError, match=r"num_kv_heads.*8 in l0.*4 in l1"):
        FullAttentionSpec.merge(
            [a, FullAttentionSpec(**{**LLAMA_8B_LAYER, "num_kv_heads": 4})], ["l0", "l1"]
        )
    with pytest.raises(MergeError, match="l1 is a SinkFullAttentionSpec"):
        FullAttentionSpec.merge(
            [a, SinkFullAttentionSpec(**LLAMA_8B_LAYER, sink_len=4)], ["l0", "l1"]
        )
    with pytest.raises(MergeError, match="empty"):
        FullAttentionSpec.merge([])


def test_sink_spec_merges_like_full_attention() -> None:
    a = SinkFullAttentionSpec(**LLAMA_8B_LAYER, sink_len=4)
    assert SinkFullAttentionSpec.merge([a, a]) == a
    with pytest.raises(MergeError, match="sink_len"):
        SinkFullAttentionSpec.merge([a, SinkFullAttentionSpec(**LLAMA_8B_LAYER, sink_len=8)])
    assert a.max_blocks_per_request(SizingContext(max_model_len=64)) == 4


def test_cross_attention_holds_the_encoder_length() -> None:
    spec = CrossAttentionSpec(block_size=16, num_kv_heads=20, head_size=64, dtype=torch.float16)
    ctx = SizingContext(max_model_len=448, max_encoder_tokens=1500)
    assert spec.max_blocks_per_request(ctx) == 94
    assert spec.max_memory_usage_bytes(ctx) == 94 * 16 * 20 * 128 * 2
    assert not spec.prefix_cacheable


def test_encoder_only_needs_no_cache() -> None:
    spec = EncoderOnlyAttentionSpec(
        block_size=16, num_kv_heads=20, head_size=64, dtype=torch.float16
    )
    assert spec.max_memory_usage_bytes(SizingContext(max_model_len=1500)) == 0


def test_with_block_size_validates() -> None:
    spec = FullAttentionSpec(**LLAMA_8B_LAYER)
    assert spec.with_block_size(32).page_size_bytes == 2 * spec.page_size_bytes
    with pytest.raises(InvalidFieldError, match="block_size"):
        spec.with_block_size(0)


def test_protocol_defaults() -> None:
    spec = FullAttentionSpec(**LLAMA_8B_LAYER)
    assert spec.block_table_token_alignment == 128
    assert spec.prefix_cacheable and spec.prefix_replay_tokens == 0
    assert spec.has_layer_views and spec.uses_slot_mapping
    assert spec.view_dtype == torch.bfloat16
    assert spec.head_size_v == 128 and spec.dcp_sharded is True
    assert (spec.host_resident, spec.group_role, spec.transferable) == (False, "default", True)
