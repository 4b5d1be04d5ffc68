"""Paged attention through the planner's views, on every layout, against dense attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from planner_testkit import manager_with_test_kinds, window

from kvspec_core import SizingContext
from kvspec_core.planner import LAYOUTS, materialize, plan_kv_cache
from kvspec_core.specs import FullAttentionSpec

BLOCK, HEADS, HEAD = 4, 2, 8


def _specs() -> dict:
    # Two full and two window layers of one page size: two groups aliasing one pool.
    common = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    return {
        "l0": FullAttentionSpec(**common),
        "l1": window(6, **common),
        "l2": FullAttentionSpec(**common),
        "l3": window(6, **common),
    }


def _write(
    view: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int
) -> None:
    for token, slot in enumerate(slots.tolist()):
        view[slot // block, :, slot % block, :HEAD] = k[:, token]
        view[slot // block, :, slot % block, HEAD:] = v[:, token]


def _gather(view: torch.Tensor, table: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    pages = view[torch.tensor(table)]  # [blocks, H, N, K+V]
    dense = pages.permute(1, 0, 2, 3).reshape(HEADS, -1, 2 * HEAD)[:, :tokens]
    return dense[..., :HEAD], dense[..., HEAD:]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_paged_attention_matches_dense_on_every_layout(layout: str) -> None:
    manager = manager_with_test_kinds()
    ctx = SizingContext(max_model_len=32, max_in_flight_tokens=8)
    plan = plan_kv_cache(_specs(), 64 * 1024, ctx, manager, layout=layout)
    assert len(plan.pools) == 1 and len(plan.groups) == 2
    buffers = materialize(plan)
    generator = torch.Generator().manual_seed(0)
    lengths = [13, 7, 10]
    # Hand out distinct block ids per (group, request), never the null block 0.
    free = list(range(1, plan.pools[0].num_blocks))
    free = [free[i] for i in torch.randperm(len(free), generator=generator).tolist()]
    tables = {
        (group.id, r): [free.pop() for _ in range(-(-n // BLOCK))]
        for group in plan.groups
        for r, n in enumerate(lengths)
    }
    dense = {}
    for group in plan.groups:
        for layer in group.layers:
            view = buffers.views[layer]
            assert view.dtype == torch.float32
            assert tuple(view.shape) == (plan.pools[0].num_blocks, HEADS, BLOCK, 2 * HEAD)
            for r, n in enumerate(lengths):
                k = torch.randn(HEADS, n, HEAD, generator=generator)
                v = torch.randn(HEADS, n, HEAD, generator=generator)
                table = tables[(group.id, r)]
                slots = torch.tensor([table[t // BLOCK] * BLOCK + t % BLOCK for t in range(n)])
                _write(view, slots, k, v, BLOCK)
                dense[(layer, r)] = (k, v)
    for group in plan.groups:
        for layer in group.layers:
            for r, n in enumerate(lengths):
                k, v = dense[(layer, r)]
                paged_k, paged_v = _gather(buffers.views[layer], tables[(group.id, r)], n)
                assert torch.equal(paged_k, k) and torch.equal(paged_v, v)
                q = torch.randn(HEADS, 3, HEAD, generator=generator)
                expected = F.scaled_dot_product_attention(q, k, v)
                got = F.scaled_dot_product_attention(q, paged_k, paged_v)
                assert torch.equal(got, expected)


def test_kernel_block_views_round_trip_pages() -> None:
    manager = manager_with_test_kinds()
    ctx = SizingContext(max_model_len=32, max_in_flight_tokens=8)
    specs = {
        f"l{i}": FullAttentionSpec(
            block_size=8, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
        )
        for i in range(3)
    }
    plan = plan_kv_cache(specs, 96 * 1024, ctx, manager, layout="LBNHC")
    buffers = materialize(plan, kernel_block_sizes={0: 4})
    view = buffers.views["l1"]
    assert view.shape[0] == 2 * plan.pools[0].num_blocks and view.shape[2] == 4
    descriptor = buffers.layout_descriptor()["layers"]["l1"]
    assert descriptor["kernel_block_size"] == 4
    buffers.buffers[0].zero_()
    generator = torch.Generator().manual_seed(1)
    k = torch.randn(HEADS, 11, HEAD, generator=generator)
    v = torch.randn(HEADS, 11, HEAD, generator=generator)
    manager_blocks = [5, 2]
    kernel_table = [b * 2 + j for b in manager_blocks for j in range(2)]
    slots = torch.tensor([kernel_table[t // 4] * 4 + t % 4 for t in range(11)])
    _write(view, slots, k, v, 4)
    pages = view[torch.tensor(kernel_table)].permute(1, 0, 2, 3).reshape(HEADS, -1, 2 * HEAD)
    assert torch.equal(pages[:, :11, :HEAD], k) and torch.equal(pages[:, :11, HEAD:], v)
    # Kernel blocks of manager block b lie inside b's bytes of the layer.
    raw = buffers.buffers[0]
    touched = (raw != 0).nonzero().flatten()
    layer_base = buffers.layer_views["l1"].offset
    page = plan.groups[0].spec.page_size_bytes
    blocks = {(int(i) - layer_base) // page for i in touched}
    assert blocks <= set(manager_blocks)
