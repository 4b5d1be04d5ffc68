"""Worked examples: MambaSpec against the reference engine's formulas."""

from __future__ import annotations

import re

import pytest
import torch
from mamba_testkit import manager_with_plugin

from kvspec_core import FullAttentionSpec, SizingContext, UniformTypeSpecs
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError, MergeError
from kvspec_core.specs import spec_from_dict, spec_to_dict
from kvspec_mamba import MambaSpec

BF16 = torch.bfloat16
# Jamba-1.5-Mini at TP 1: conv (3, 8192) + ssm (8192, 16), bf16.
JAMBA_SHAPES = ((3, 8192), (8192, 16))
JAMBA_STATE = 3 * 8192 * 2 + 8192 * 16 * 2


def jamba(**overrides: object) -> MambaSpec:
    fields: dict[str, object] = dict(
        block_size=16, shapes=JAMBA_SHAPES, dtypes=(BF16, BF16), mamba_type="mamba1"
    )
    fields.update(overrides)
    return MambaSpec(**fields)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- page geometry
def test_page_is_the_sum_of_state_tensors() -> None:
    spec = jamba()
    assert JAMBA_STATE == 311_296
    assert spec.state_content_size_bytes == spec.unpadded_page_size_bytes == 311_296
    assert spec.page_size_bytes == 311_296
    assert (spec.num_heads, spec.num_states, spec.tokens_per_state) == (1, 1, -1)
    assert spec.num_kernel_states(4096) == 1  # one state whatever the token span


def test_mixed_dtypes_count_each_tensor_in_its_own_dtype() -> None:
    spec = MambaSpec(
        block_size=16, shapes=((3, 10240), (128, 64, 128)), dtypes=(BF16, torch.float32)
    )
    assert spec.page_size_bytes == 3 * 10240 * 2 + 128 * 64 * 128 * 4 == 4_255_744


def test_padded_page() -> None:
    spec = jamba(page_size_padded=327_680)
    assert spec.page_size_bytes == 327_680
    assert spec.unpadded_page_size_bytes == 311_296
    assert jamba(page_size_padded=311_296).page_size_bytes == 311_296


def test_padding_below_the_state_is_refused() -> None:
    with pytest.raises(InvalidFieldError, match=r"MambaSpec\.page_size_padded=311295 .*311296"):
        jamba(page_size_padded=311_295)


@pytest.mark.parametrize(
    "field, value, error, allowed",
    [
        ("shapes", (), InvalidFieldError, "non-empty tuple of shapes"),
        ("shapes", ((3, 0), (8192, 16)), InvalidFieldError, "positive ints"),
        ("shapes", ((3, 8192), ()), InvalidFieldError, "non-empty tuple of positive"),
        ("shapes", [[3, 8192], [8192, 16]], InvalidFieldError, "tuple"),
        ("shapes", ((1 << 30, 1 << 30), (1, 1)), InvalidFieldError, "above the limit"),
        ("dtypes", (BF16,), InvalidFieldError, "one dtype per state shape"),
        ("dtypes", ("bfloat16", BF16), InvalidFieldError, "torch dtypes"),
        ("mamba_type", "mamba3", InvalidFieldError, "'gated_delta_net'"),
        ("num_speculative_blocks", -1, InvalidFieldError, ">= 0|\\[0,"),
        ("num_prefill_checkpoint_blocks", 1.5, InvalidFieldTypeError, "int"),
        ("prefill_checkpoint_alignment", 0, InvalidFieldError, "\\[1,"),
        ("tp_replicated", 1, InvalidFieldTypeError, "bool"),
        ("block_size", 0, InvalidFieldError, "\\[1,"),
    ],
)
def test_invalid_fields_are_refused_naming_field_and_allowed(
    field: str, value: object, error: type[Exception], allowed: str
) -> None:
    with pytest.raises(error, match=rf"MambaSpec\.{field}=") as caught:
        jamba(**{field: value})
    assert caught.match(allowed)


def test_runtime_properties() -> None:
    spec = jamba()
    assert spec.block_table_token_alignment is None
    assert spec.dcp_sharded is False  # the state is replicated across DCP ranks
    assert (spec.prefix_cacheable, spec.uses_slot_mapping, spec.has_layer_views) == (
        True,
        True,
        True,
    )
    assert spec.view_dtype is None


# --------------------------------------------------------------------------- sizing
# (mode, speculative, checkpoints, cap): 1 + spec, or 2 + spec + checkpoints in align mode.
CAP_CASES = [
    ("none", 0, 0, 1),
    ("none", 3, 5, 4),
    ("all", 2, 1, 3),
    ("align", 0, 0, 2),
    ("align", 3, 0, 5),
    ("align", 3, 4, 9),
]


@pytest.mark.parametrize("mode, speculative, checkpoints, cap", CAP_CASES)
@pytest.mark.parametrize("max_len", [1, 8192, 262144])
def test_admission_cap_and_max_memory(
    mode: str, speculative: int, checkpoints: int, cap: int, max_len: int
) -> None:
    spec = jamba(num_speculative_blocks=speculative, num_prefill_checkpoint_blocks=checkpoints)
    for dcp in (1, 4):
        ctx = SizingContext(max_model_len=max_len, mamba_cache_mode=mode, dcp_size=dcp)
        assert spec.max_blocks_per_request(ctx) == cap
        assert spec.max_memory_usage_bytes(ctx) == cap * 311_296


@pytest.mark.parametrize(
    "mode, speculative, max_len, block, width",
    [
        ("align", 0, 262144, 16, 16384),
        ("align", 2, 262144, 16, 16386),
        ("align", 1, 100, 16, 8),  # cdiv(100, 16) + 1
        ("none", 2, 262144, 16, 3),  # the cap: 1 + 2
        ("all", 0, 262144, 16, 1),
    ],
)
def test_block_table_width(
    mode: str, speculative: int, max_len: int, block: int, width: int
) -> None:
    spec = jamba(num_speculative_blocks=speculative, block_size=block)
    ctx = SizingContext(max_model_len=max_len, mamba_cache_mode=mode)
    assert spec.block_table_width(ctx, max_len) == width


# --------------------------------------------------------------------------- merge
def test_merge_of_equal_layers_returns_the_spec() -> None:
    assert MambaSpec.merge([jamba(), jamba(), jamba()], ["a", "b", "c"]) == jamba()


@pytest.mark.parametrize(
    "field, other",
    [
        ("shapes", ((3, 4096), (4096, 16))),
        ("dtypes", (BF16, torch.float32)),
        ("mamba_type", "mamba2"),
        ("num_speculative_blocks", 2),
        ("page_size_padded", 400_000),
        ("tp_replicated", True),
    ],
)
def test_merge_refusal_names_field_values_and_layers(field: str, other: object) -> None:
    with pytest.raises(MergeError) as caught:
        MambaSpec.merge(
            [jamba(), jamba(**{field: other}), jamba()],
            ["model.layers.0", "model.layers.1", "model.layers.2"],
        )
    message = str(caught.value)
    assert f"field {field!r} differs" in message
    assert f"{getattr(jamba(), field)!r} in model.layers.0, model.layers.2" in message
    assert f"{other!r} in model.layers.1" in message


def test_merge_refuses_an_attention_layer() -> None:
    attention = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=BF16)
    with pytest.raises(
        MergeError, match=re.escape("model.layers.4 is a FullAttentionSpec, not a MambaSpec")
    ):
        MambaSpec.merge([jamba(), attention], ["model.layers.0", "model.layers.4"])  # type: ignore[list-item]


# --------------------------------------------------------------------------- uniformity
def test_uniformity_decisions() -> None:
    registry = manager_with_plugin().spec_kinds
    base = jamba()
    # Another shape padded to the same page: may share a uniform group.
    same_page = MambaSpec(
        block_size=16,
        shapes=((3, 4096), (4096, 16)),
        dtypes=(BF16, BF16),
        page_size_padded=311_296,
        mamba_type="mamba2",
    )
    attention = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=BF16)

    def uniform(*specs: object) -> bool:
        return UniformTypeSpecs.is_uniform_type({f"l{i}": s for i, s in enumerate(specs)}, registry)  # type: ignore[misc]

    assert uniform(base, same_page) and uniform(same_page, base)
    assert not uniform(
        base, MambaSpec(block_size=16, shapes=((3, 4096), (4096, 16)), dtypes=(BF16, BF16))
    )
    assert not uniform(base, jamba(num_speculative_blocks=1))
    assert not uniform(base, jamba(num_prefill_checkpoint_blocks=1))
    assert not uniform(base, jamba(prefill_checkpoint_alignment=16))
    assert not uniform(base, jamba(tp_replicated=True))
    assert not uniform(base, attention) and not uniform(attention, base)
    group = UniformTypeSpecs.from_specs({"a": base, "b": same_page}, registry)
    assert group is not None
    ctx = SizingContext(max_model_len=262144, mamba_cache_mode="align")
    assert group.max_blocks_per_request(ctx) == 2
    assert group.block_table_width(ctx, 262144) == 16384


def test_round_trip_through_plain_data() -> None:
    spec = MambaSpec(
        block_size=64,
        shapes=((3, 10240), (128, 64, 128)),
        dtypes=(BF16, torch.float32),
        page_size_padded=5_000_000,
        num_speculative_blocks=2,
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=64,
        tp_replicated=True,
    )
    assert spec_from_dict(spec_to_dict(spec), manager_with_plugin().spec_kinds) == spec
