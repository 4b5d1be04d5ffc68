"""Engine helpers of the state family: a block's state tensors in a materialised view, the
block-table columns a step reads and writes in ``align`` mode, and where prefill steps end so
prefix caching saves reusable states. Checked against real plans and the real allocator."""

from __future__ import annotations

from itertools import pairwise
from math import prod
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mamba_testkit import QWEN3_NEXT, load_config, manager_with_plugin, state_layer

from kvspec_core import SizingContext
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError, PlanError
from kvspec_core.planner import materialize, plan_kv_cache
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.testing import model_layer
from kvspec_mamba import MambaSpec, StateColumns, mamba_spec, prefill_step_ends, state_columns

ALIGN = SizingContext(max_model_len=256, max_in_flight_tokens=64, mamba_cache_mode="align")

#: Bamba-9B's Mamba-2 geometry (ibm-ai-platform/Bamba-9B config.json).
BAMBA_9B = dict(
    model_type="bamba",
    hidden_size=4096,
    mamba_n_heads=128,
    mamba_d_head=64,
    mamba_d_state=128,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_n_groups=1,
)


def materialised(
    spec: MambaSpec, layers: int = 1, blocks: int = 5
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Views of ``layers`` layers of ``spec`` in a real plan of about ``blocks`` blocks, and
    the pool buffer behind them."""
    specs = {f"model.layers.{index}": spec for index in range(layers)}
    budget = blocks * layers * spec.page_size_bytes
    plan = plan_kv_cache(specs, budget, ALIGN, manager_with_plugin())
    buffers = materialize(plan)
    return [buffers.views[name] for name in specs], buffers.buffers[0]


def byte_range(tensor: torch.Tensor, buffer: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last byte of ``tensor`` inside ``buffer`` (dense tensors)."""
    start = tensor.data_ptr() - buffer.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def test_qwen3_next_state_views_have_transformers_shapes_and_alias_the_block() -> None:
    layer = model_layer(load_config(QWEN3_NEXT), 0, manager_with_plugin())
    spec = mamba_spec(layer)
    assert isinstance(spec, MambaSpec) and spec.mamba_type == "gated_delta_net"
    (view,), buffer = materialised(spec)
    conv, recurrent = spec.state_views(view, 2)
    # transformers' Qwen3NextGatedDeltaNet: conv [conv_dim, kernel - 1 kept columns],
    # recurrent [num_v_heads, k_head_dim, v_head_dim] (both per request, no batch axis).
    assert conv.shape == (8192, 3) and conv.stride() == (1, 8192)
    assert recurrent.shape == (32, 128, 128) and recurrent.is_contiguous()
    assert conv.dtype == recurrent.dtype == torch.bfloat16
    page_start = 2 * view.stride(0) + view.storage_offset()
    assert conv.data_ptr() - buffer.data_ptr() == page_start
    assert byte_range(recurrent, buffer) == (
        page_start + 3 * 8192 * 2,
        page_start + spec.state_content_size_bytes,
    )
    recurrent.fill_(1.5)
    assert torch.equal(
        spec.state_views(view, 2)[1], torch.full((32, 128, 128), 1.5, dtype=torch.bfloat16)
    )
    assert not spec.state_views(view, 1)[1].any() and not spec.state_views(view, 3)[1].any()


def test_conv_view_is_the_stored_window_transposed() -> None:
    spec = MambaSpec(block_size=4, shapes=((3, 5), (2, 2)), dtypes=(torch.float32,) * 2)
    (view,), _ = materialised(spec)
    conv, _ = spec.state_views(view, 1)
    stored = view[1, 0, 0, : 3 * 5 * 4].view(torch.float32).view(3, 5)
    conv.copy_(torch.arange(15, dtype=torch.float32).view(5, 3))  # [channels, time]
    assert torch.equal(stored, torch.arange(15, dtype=torch.float32).view(5, 3).T)


def test_bamba_9b_mamba2_state_views() -> None:
    spec = mamba_spec(state_layer(BAMBA_9B))
    assert isinstance(spec, MambaSpec)
    (view,), _ = materialised(spec, blocks=3)
    conv, ssm = spec.state_views(view, 1)
    # transformers' BambaMixer: conv [intermediate + 2 * groups * d_state, d_conv - 1 kept],
    # ssm [heads, head_dim, d_state].
    assert conv.shape == (8192 + 2 * 128, 3)
    assert ssm.shape == (128, 64, 128)


def test_lone_recurrent_state_keeps_its_shape() -> None:
    spec = MambaSpec(
        block_size=4, shapes=((2, 4, 4),), dtypes=(torch.float32,), mamba_type="linear_attention"
    )
    (view,), _ = materialised(spec)
    (state,) = spec.state_views(view, 1)
    assert state.shape == (2, 4, 4) and not spec.has_conv_state


def test_mixed_dtypes_each_state_in_its_own_dtype() -> None:
    spec = MambaSpec(
        block_size=4, shapes=((3, 10), (2, 4, 8)), dtypes=(torch.bfloat16, torch.float32)
    )
    (view,), _ = materialised(spec)
    conv, ssm = spec.state_views(view, 1)
    assert (conv.dtype, ssm.dtype) == (torch.bfloat16, torch.float32)
    assert ssm.data_ptr() - conv.data_ptr() == 3 * 10 * 2


def test_blocks_and_layers_never_overlap() -> None:
    spec = MambaSpec(block_size=4, shapes=((3, 6), (2, 4, 4)), dtypes=(torch.float32,) * 2)
    views, buffer = materialised(spec, layers=3, blocks=4)
    seen: list[tuple[int, int]] = []
    for view in views:
        for block in range(1, view.shape[0]):
            conv, ssm = spec.state_views(view, block)
            seen.append(byte_range(conv.T, buffer))
            seen.append(byte_range(ssm, buffer))
    seen.sort()
    assert all(end <= start for (_, end), (start, _) in pairwise(seen))
    assert seen[-1][1] <= buffer.numel()


def test_a_misaligned_state_is_refused_naming_the_alignment() -> None:
    # 62-byte pages, a 30-byte bf16 conv window first: block 1's fp32 state starts at byte
    # 92 of the pool, block 2's at byte 154, which no fp32 view can start at.
    spec = MambaSpec(block_size=4, shapes=((3, 5), (2, 4)), dtypes=(torch.bfloat16, torch.float32))
    (view,), _ = materialised(spec)
    assert view.stride(0) == 62
    spec.state_views(view, 1)
    with pytest.raises(PlanError, match=r"state 1 .* byte 154 .*block_stride_alignment"):
        spec.state_views(view, 2)


@pytest.mark.parametrize(
    "make_view, block_id, error, match",
    [
        (lambda view: view.numpy(), 1, InvalidFieldTypeError, "layer_view"),
        (lambda view: view.view(torch.int8), 1, InvalidFieldError, r"uint8 tensor \[num_blocks"),
        (lambda view: view[:, :, :, :8], 1, InvalidFieldError, "layer_view"),
        (lambda view: view, 0, InvalidFieldError, "null block"),
        (lambda view: view, 99, InvalidFieldError, r"block_id=99.*1\.\."),
        (lambda view: view, -1, InvalidFieldError, "block_id=-1"),
        (lambda view: view, True, InvalidFieldTypeError, "block_id"),
        (lambda view: view, 1.0, InvalidFieldTypeError, "block_id"),
    ],
)
def test_state_views_refuse_bad_input(
    make_view: Any, block_id: Any, error: type[Exception], match: str
) -> None:
    spec = MambaSpec(block_size=4, shapes=((3, 6), (2, 4, 4)), dtypes=(torch.float32,) * 2)
    (view,), _ = materialised(spec)
    with pytest.raises(error, match=match):
        spec.state_views(make_view(view), block_id)


@pytest.mark.parametrize(
    "computed, new, mode, columns",
    [
        (0, 10, "align", StateColumns(read=None, write=2)),  # prefill: state at 10 in block 2
        (10, 1, "align", StateColumns(read=2, write=2)),  # decode inside a block: in place
        (11, 1, "align", StateColumns(read=2, write=2)),  # step ends on 12: block 2 is saved
        (12, 1, "align", StateColumns(read=2, write=3)),  # crosses the boundary: copy 2 -> 3
        (8, 9, "align", StateColumns(read=1, write=4)),  # resume a hit of 8 tokens
        (0, 10, "none", StateColumns(read=None, write=0)),
        (12, 5, "all", StateColumns(read=0, write=0)),
    ],
)
def test_state_columns(computed: int, new: int, mode: str, columns: StateColumns) -> None:
    assert state_columns(computed, new, 4, mode) == columns
    spec = MambaSpec(block_size=4, shapes=((2, 4),), dtypes=(torch.float32,))
    assert spec.state_columns(computed, new, mode) == columns


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((0, 0, 4, "align"), InvalidFieldError, "num_new_tokens=0"),
        ((-1, 1, 4, "align"), InvalidFieldError, "num_computed=-1"),
        ((0, 1, 0, "align"), InvalidFieldError, "block_size=0"),
        ((0, 1, 4, "aligned"), InvalidFieldError, "mamba_cache_mode='aligned'.*none, align, all"),
        ((0, True, 4, "align"), InvalidFieldTypeError, "num_new_tokens"),
    ],
)
def test_state_columns_refuse_bad_input(args: tuple, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        state_columns(*args)


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.integers(1, 60),
    steps=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    hit_prompt=st.integers(1, 60),
)
def test_columns_name_blocks_the_allocator_holds(
    prompt: int, steps: list[int], hit_prompt: int
) -> None:
    """In align mode the write column is a real block of the request, the read column is
    the block the allocator kept from the previous step (or the prefix-hit block), and a
    step that leaves its block writes a different block than it reads."""
    spec = MambaSpec(block_size=4, shapes=((2, 4),), dtypes=(torch.float32,))
    allocator = KVCacheAllocator([spec], 64, ALIGN, manager=manager_with_plugin())
    request = Request("a", list(range(prompt)))
    previous_write: int | None = None
    computed = 0
    for new in [prompt, *steps]:
        if computed:
            request.token_ids.extend(range(computed, computed + new))
        columns = spec.state_columns(computed, new, "align")
        assert allocator.allocate_slots(request, new)
        table = allocator.block_ids("a")[0]
        assert table[columns.write] != 0
        if columns.read is not None:
            assert table[columns.read] == previous_write
            assert (columns.read == columns.write) == (table[columns.read] == table[columns.write])
        previous_write = table[columns.write]
        computed += new
    other = Request("b", list(range(hit_prompt)))
    prefix = allocator.find_cached_prefix(other)
    if prefix.num_tokens:
        columns = spec.state_columns(prefix.num_tokens, hit_prompt - prefix.num_tokens, "align")
        assert columns.read is not None
        assert prefix.block_ids[0][columns.read] != 0
        assert prefix.block_ids[0][: columns.read] == (0,) * columns.read


@pytest.mark.parametrize(
    "computed, tokens, checkpoint_at, ends",
    [
        (0, 10, None, (8, 10)),  # save the state at 8, the last boundary before token 9
        (0, 8, None, (4, 8)),  # token 7 is still produced: boundary 4
        (0, 3, None, (3,)),  # no boundary inside
        (8, 10, None, (10,)),  # the hit already sits on the boundary
        (0, 30, 12, (12, 28, 30)),  # the prefix hint comes first
        (4, 30, 28, (28, 30)),
    ],
)
def test_prefill_step_ends(
    computed: int, tokens: int, checkpoint_at: int | None, ends: tuple[int, ...]
) -> None:
    assert prefill_step_ends(computed, tokens, 4, checkpoint_at) == ends


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 10, 4, 6), "checkpoint_at=6.*multiple of block_size=4"),
        ((0, 10, 4, 12), "checkpoint_at=12.*strictly between"),
        ((8, 20, 4, 8), "checkpoint_at=8"),
        ((5, 5, 4, None), "num_tokens=5"),
    ],
)
def test_prefill_step_ends_refuse_bad_input(args: tuple, match: str) -> None:
    with pytest.raises(InvalidFieldError, match=match):
        prefill_step_ends(*args)


def test_prefill_steps_save_the_state_the_next_request_resumes_from() -> None:
    spec = MambaSpec(block_size=4, shapes=((2, 4),), dtypes=(torch.float32,))
    allocator = KVCacheAllocator([spec], 32, ALIGN, manager=manager_with_plugin())
    first = Request("a", list(range(10)))
    computed = 0
    for end in prefill_step_ends(0, 10, spec.block_size):
        assert allocator.allocate_slots(first, end - computed)
        computed = end
    second = Request("b", list(range(9)) + [99, 98, 97])
    prefix = allocator.find_cached_prefix(second)
    assert prefix.num_tokens == 8
    read = spec.state_columns(8, 4, "align").read
    assert read is not None and prefix.block_ids[0][read] == allocator.block_ids("a")[0][read]
    # One prefill step saves nothing to resume from.
    single = KVCacheAllocator([spec], 32, ALIGN, manager=manager_with_plugin())
    assert single.allocate_slots(Request("a", list(range(10))), 10)
    assert single.find_cached_prefix(Request("b", list(range(12)))).num_tokens == 0


def test_qwen3_next_page_is_the_state_views_sum() -> None:
    spec = mamba_spec(model_layer(load_config(QWEN3_NEXT), 0, manager_with_plugin()))
    assert isinstance(spec, MambaSpec)
    assert spec.state_content_size_bytes == sum(
        prod(shape) * dtype.itemsize for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    )
