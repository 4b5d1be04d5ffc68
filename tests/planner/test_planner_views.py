"""Materialisation: strides, padding, alignment, kernel blocks, descriptor, no half-allocation."""

from __future__ import annotations

import json
import re

import pytest
import torch
from planner_testkit import assert_views_sound, full, layers, manager_with_test_kinds

from kvspec_core import SizingContext
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError, PlanError
from kvspec_core.planner import LAYOUTS, materialize, plan_kv_cache

CTX = SizingContext(max_model_len=64, max_in_flight_tokens=8)
SMALL = dict(block_size=8, num_kv_heads=2, head_size=8, dtype=torch.float16)


def _plan(specs, layout="LBHNC", budget=64 << 10):
    return plan_kv_cache(specs, budget, CTX, manager_with_test_kinds(), layout=layout)


def test_layer_outer_and_block_outer_strides() -> None:
    page = 8 * 2 * 16 * 2
    lbhnc = _plan(layers([full(**SMALL)] * 3), "LBHNC")
    (tensor,) = lbhnc.tensors
    nb = lbhnc.pools[0].num_blocks
    assert (tensor.block_stride, tensor.layer_stride, tensor.offset) == (page, page * nb, 0)
    blhnc = _plan(layers([full(**SMALL)] * 3), "BLHNC")
    (tensor,) = blhnc.tensors
    assert (tensor.block_stride, tensor.layer_stride) == (3 * page, page)


def test_block_stride_alignment_rounds_blocks() -> None:
    specs = layers([full(block_stride_alignment=1024, **SMALL)] * 3)
    page = 8 * 2 * 16 * 2
    blhnc = _plan(specs, "BLHNC")
    assert blhnc.pools[0].block_bytes == 2048 and blhnc.tensors[0].block_stride == 2048
    assert blhnc.padding_breakdown[1] == (
        "alignment",
        blhnc.pools[0].num_blocks * (2048 - 3 * page),
    )
    lbhnc = _plan(specs, "LBHNC")
    assert lbhnc.tensors[0].block_stride == 1024 and lbhnc.pools[0].block_bytes == 3 * 1024
    # Found in review: the layer-outer stride's alignment bytes were labelled page padding.
    assert lbhnc.padding_breakdown[:2] == (
        ("page_padding", 0),
        ("alignment", lbhnc.pools[0].num_blocks * 3 * (1024 - page)),
    )
    for plan in (blhnc, lbhnc):
        assert_views_sound(plan)


def test_padded_pages_on_page_contiguous_layouts_and_refused_elsewhere() -> None:
    page = 8 * 2 * 16 * 2
    specs = layers([full(page_size_padded=page + 64, **SMALL)] * 2)
    for layout in ("LBHNC", "LBNHC", "BLHNC", "BLNHC"):
        plan = _plan(specs, layout)
        assert plan.padding_breakdown[0] == ("page_padding", plan.pools[0].num_blocks * 2 * 64)
        assert_views_sound(plan)
    for layout in ("LHBNC", "BHLNC"):
        with pytest.raises(PlanError, match=f"layout {layout} cannot hold padded pages"):
            _plan(specs, layout)


def test_kernel_block_split_on_a_layer_compact_layout() -> None:
    plan = _plan(layers([full(**SMALL)] * 2), "LBNHC")
    buffers = materialize(plan, kernel_block_sizes={0: 2})
    view = buffers.views["model.layers.1"]
    assert tuple(view.shape) == (4 * plan.pools[0].num_blocks, 2, 2, 16)
    descriptor = buffers.layout_descriptor()["layers"]["model.layers.1"]
    assert descriptor["kernel_block_size"] == 2
    assert descriptor["byte_strides"][0] == 8 * 2 * 16 * 2 // 4


def test_kernel_block_split_refused_where_blocks_are_not_dense_pages() -> None:
    plan = _plan(layers([full(**SMALL)] * 2), "BLHNC")
    with pytest.raises(PlanError) as caught:
        materialize(plan, kernel_block_sizes={0: 4})
    message = str(caught.value)
    assert "(BLHNC)" in message and "block stride 1024 != page 512" in message
    assert "Reduce the block size to 4" in message and "LBNHC" in message
    with pytest.raises(PlanError, match="positive divisor"):
        materialize(plan, kernel_block_sizes={0: 3})
    with pytest.raises(InvalidFieldError, match="group ids"):
        materialize(plan, kernel_block_sizes={5: 4})
    padded = _plan(layers([full(page_size_padded=1024, **SMALL)]), "LBHNC")
    with pytest.raises(PlanError, match="padded pages cannot be split"):
        materialize(padded, kernel_block_sizes={0: 4})


def test_refusal_allocates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(layers([full(**SMALL)] * 2), "BLHNC")
    allocations: list[str] = []
    real_empty, real_zeros = torch.empty, torch.zeros

    def spy(real):
        def call(*args, **kwargs):
            if str(kwargs.get("device", "cpu")) != "meta":
                allocations.append(real.__name__)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(torch, "empty", spy(real_empty))
    monkeypatch.setattr(torch, "zeros", spy(real_zeros))
    with pytest.raises(PlanError):
        materialize(plan, kernel_block_sizes={0: 4})
    assert allocations == []
    materialize(plan)
    assert allocations  # the spy does see real allocations


def test_misaligned_dtype_views_are_refused_before_allocation() -> None:
    # A 2-byte int8 page ahead of a float32 layer in one block would misalign its view.
    specs = layers(
        [
            full(num_kv_heads=1, head_size=1, block_size=1, dtype=torch.int8),
            full(num_kv_heads=1, head_size=1, block_size=1, dtype=torch.float32),
        ]
    )
    plan = plan_kv_cache(
        specs, 4096, SizingContext(max_model_len=4), manager_with_test_kinds(), layout="BLHNC"
    )
    with pytest.raises(PlanError, match=re.escape("cannot be viewed as torch.float32")):
        materialize(plan)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_descriptor_is_json_and_matches_views(layout: str) -> None:
    plan = _plan(layers([full(**SMALL)] * 2), layout)
    buffers = materialize(plan)
    descriptor = buffers.layout_descriptor()
    json.dumps(descriptor)
    for name, info in descriptor["layers"].items():
        view = buffers.views[name]
        assert info["shape"] == list(view.shape) and info["strides"] == list(view.stride())
        assert info["dtype"] == "float16"
        assert view.storage_offset() * view.element_size() == info["byte_offset"]
        assert view.data_ptr() - buffers.buffers[info["pool"]].data_ptr() == info["byte_offset"]


def test_materialize_refuses_bad_arguments_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(layers([full(**SMALL)] * 2), "LBNHC")
    with pytest.raises(InvalidFieldTypeError, match=r"materialize.*plan"):
        materialize(plan.to_dict())  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldTypeError, match=r"kernel_block_sizes.*mapping"):
        materialize(plan, kernel_block_sizes=4)  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError, match=r"kernel_block_sizes.*group ids"):
        materialize(plan, kernel_block_sizes={"0": 4})  # type: ignore[dict-item]
    # Found in review: None silently meant "no split", and any truthy offload_tiers counted.
    for bad in (None, 8.0, True):
        with pytest.raises(InvalidFieldTypeError, match=r"kernel_block_sizes\[0\]"):
            materialize(plan, kernel_block_sizes={0: bad})  # type: ignore[dict-item]
    with pytest.raises(InvalidFieldTypeError, match=r"materialize\.offload_tiers='no'"):
        materialize(plan, offload_tiers="no")  # type: ignore[arg-type]
    import numpy

    split = materialize(plan, kernel_block_sizes={0: numpy.int64(8)})  # an int by __index__
    assert split.views[next(iter(split.views))].shape[2] == 8
    allocations: list[object] = []
    real_empty = torch.empty

    def spy(*args, **kwargs):
        if str(kwargs.get("device", "cpu")) != "meta":
            allocations.append(kwargs.get("device"))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    with pytest.raises(InvalidFieldError, match=r"materialize.*device.*'no-such-device'"):
        materialize(plan, device="no-such-device")
    assert allocations == []


def test_kernel_block_size_is_checked_even_when_it_changes_nothing() -> None:
    plan = _plan(layers([full(**SMALL)] * 2), "LBNHC")
    with pytest.raises(PlanError, match="positive divisor"):
        materialize(plan, kernel_block_sizes={0: 0})
    for bad in (8.0, True):  # not ints: refused naming the entry (test above)
        with pytest.raises(InvalidFieldTypeError, match=r"kernel_block_sizes\[0\]"):
            materialize(plan, kernel_block_sizes={0: bad})  # type: ignore[dict-item]
    assert (
        materialize(plan, kernel_block_sizes={0: 8}).layer_views["model.layers.0"].kernel_block_size
        == 8
    )


def test_kernel_split_refused_where_pages_do_not_divide_into_kernel_states() -> None:
    from planner_testkit import StateSpec

    # One recurrent state per block cannot be cut into 4 kernel blocks of its own.
    plan = plan_kv_cache(
        layers([StateSpec(block_size=8, state_bytes=64)] * 2),
        64 << 10,
        CTX,
        manager_with_test_kinds(),
        layout="LBNHC",
    )
    with pytest.raises(PlanError, match=r"1 state.*4 kernel blocks"):
        materialize(plan, kernel_block_sizes={0: 2})


def test_kernel_split_refusal_names_alignment_when_it_is_the_cause() -> None:
    plan = _plan(layers([full(block_stride_alignment=1024, **SMALL)] * 2), "LBNHC")
    with pytest.raises(PlanError, match="block_stride_alignment=1024"):
        materialize(plan, kernel_block_sizes={0: 4})
