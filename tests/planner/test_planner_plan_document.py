"""``plan_from_dict`` checks every field of a plan document (type, range, the ids it refers
to) before using any of it: a bad one is a ConfigError naming its path, never a raw error from
deep inside the rebuild (``pools[0].blocks_per_request = 0`` divided by zero in plan.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_testkit import HostSpec, full, layers, manager_with_test_kinds, window
from test_planner_plugin_faults import faulty_layers, manager_with_faulty_plugin

from kvspec_core import ConfigError, SizingContext
from kvspec_core.errors import KVSpecError, PluginError
from kvspec_core.planner import KVCachePlan, plan_from_dict, plan_kv_cache
from kvspec_core.specs.encoder import EncoderOnlyAttentionSpec

CTX = SizingContext(max_model_len=2048, max_in_flight_tokens=512)


def _plan() -> KVCachePlan:
    """Two device pools and a host pool, a memoryless layer: every kind of field."""
    encoder = EncoderOnlyAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    host = HostSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    specs = layers([encoder, full(), window(64), full(head_size=128), window(64), host])
    return plan_kv_cache(specs, 64 << 20, CTX, manager_with_test_kinds(), host_budget_bytes=8 << 20)


PLAN = _plan()
DOCUMENT: dict[str, Any] = json.loads(json.dumps(PLAN.to_dict()))


def _document() -> dict[str, Any]:
    return copy.deepcopy(DOCUMENT)


def _refused(data: object, field: str) -> str:
    with pytest.raises(ConfigError) as raised:
        plan_from_dict(data, manager_with_test_kinds())  # type: ignore[arg-type]
    message = str(raised.value)
    assert f"field {field!r}" in message, message
    return message


@pytest.mark.parametrize("data", [None, [], "plan.json", 3])
def test_a_document_that_is_no_mapping_is_named_as_the_document(data: object) -> None:
    """It used to read "field '' is None", naming a field the user never wrote."""
    with pytest.raises(ConfigError) as raised:
        plan_from_dict(data, manager_with_test_kinds())  # type: ignore[arg-type]
    message = str(raised.value)
    assert message.startswith(f"invalid KV-cache plan: the document is {data!r} "), message
    assert "field ''" not in message


def test_a_zero_demand_pool_is_refused_naming_the_field() -> None:
    """It used to raise ZeroDivisionError from Pool.max_concurrency."""
    data = _document()
    data["pools"][0]["blocks_per_request"] = 0
    message = _refused(data, "pools[0].blocks_per_request")
    assert "must be an int in [1, 2**62]" in message
    assert "re-plan instead of editing a plan" in message


@pytest.mark.parametrize(
    "path, value, field",
    [
        (("pools", 0, "blocks_per_request"), -4, "pools[0].blocks_per_request"),
        (("pools", 0, "num_blocks"), "100", "pools[0].num_blocks"),
        (("pools", 0, "num_blocks"), True, "pools[0].num_blocks"),
        (("pools", 1, "block_bytes"), 0, "pools[1].block_bytes"),
        (("pools", 0, "slot_bytes"), [], "pools[0].slot_bytes"),
        (("pools", 0, "max_concurrency"), float("nan"), "pools[0].max_concurrency"),
        (("pools", 0, "groups", 0), 99, "pools[0].groups[0]"),
        (("pools", 0, "id"), 1, "pools[0].id"),
        (("groups", 0, "pool"), 7, "groups[0].pool"),
        (("groups", 0, "layers"), "model.layers.1", "groups[0].layers"),
        (("groups", 0, "spec"), None, "groups[0].spec"),
        (("groups", 0, "spec", "fields", "block_size"), 0, "groups[0].spec"),
        (("groups", 1, "host_resident"), 0, "groups[1].host_resident"),
        (("tensors", 0, "group"), 12, "tensors[0].group"),
        (("tensors", 0, "strides", 1), 1.5, "tensors[0].strides[1]"),
        (("context", "max_model_len"), 0, "context.max_model_len"),
        (("context", "prefix_caching"), "yes", "context.prefix_caching"),
        (("context", "page_size"), 16, "context.page_size"),
        (("budget_bytes",), -1, "budget_bytes"),
        (("host_budget_bytes",), 2**70, "host_budget_bytes"),
        (("padding_breakdown", "alignment"), None, "padding_breakdown.alignment"),
        (("memoryless_layers", 0), 3, "memoryless_layers[0]"),
        (("groups",), {}, "groups"),
    ],
)
def test_a_malformed_field_is_refused_naming_its_path(
    path: tuple[Any, ...], value: object, field: str
) -> None:
    data = _document()
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    _refused(data, field)


def test_a_missing_field_and_a_non_mapping_are_refused() -> None:
    data = _document()
    del data["pools"][1]["alignment"]
    assert "is missing" in _refused(data, "pools[1].alignment")
    with pytest.raises(ConfigError, match="mapping with str keys"):
        plan_from_dict([], manager_with_test_kinds())  # type: ignore[arg-type]


def test_a_plugin_spec_answering_a_zero_size_in_a_plan_names_the_plugin() -> None:
    manager = manager_with_faulty_plugin()
    data = json.loads(json.dumps(plan_kv_cache(faulty_layers(), 64 << 20, CTX, manager).to_dict()))
    data["groups"][0]["spec"]["fields"]["answers"] = "state_content_size_bytes"
    with pytest.raises(
        PluginError,
        match=r"plugin 'faulty' \(distribution kvspec-faulty\): "
        r"FaultySpec\.state_content_size_bytes .* returned 0",
    ):
        plan_from_dict(data, manager)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every field and item of the document, containers included."""
    found = [path] if path else []
    if isinstance(value, dict):
        return found + [p for key, item in value.items() for p in _paths(item, (*path, key))]
    if isinstance(value, list):
        return found + [p for index, item in enumerate(value) for p in _paths(item, (*path, index))]
    return found


PATHS = _paths(DOCUMENT)

HOSTILE = st.one_of(
    st.sampled_from(
        [
            0,
            -1,
            1,
            2,
            True,
            False,
            None,
            "",
            "x",
            1.5,
            float("nan"),
            float("inf"),
            -(2**63),
            2**64,
            [],
            {},
            [0],
            ["model.layers.1"],
            {"a": 1},
        ]
    ),
    st.integers(min_value=-(2**66), max_value=2**66),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(PATHS), HOSTILE, st.sampled_from(["set", "delete", "extra"])),
        min_size=1,
        max_size=3,
    )
)
def test_any_edit_gives_a_clean_error_or_the_same_plan(
    edits: list[tuple[tuple[Any, ...], object, str]],
) -> None:
    data = _document()
    for path, drawn, action in edits:
        value = copy.deepcopy(drawn)  # hypothesis may draw one list or dict twice
        target: Any = data
        try:
            for key in path[:-1]:
                target = target[key]
            if action == "set":
                target[path[-1]] = value
            elif action == "delete":
                del target[path[-1]]
            elif isinstance(target[path[-1]], dict):
                target[path[-1]]["extra"] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced the container
    try:
        plan = plan_from_dict(data, manager_with_test_kinds())
    except KVSpecError:
        return
    # Accepted: then it is the plan that was written, field for field.
    assert plan == PLAN
    assert json.dumps(plan.to_dict()) == json.dumps(DOCUMENT)


def test_every_field_set_to_each_hostile_value_gives_a_clean_error_or_the_same_plan() -> None:
    """Exhaustive where the property above samples: each field of the document, one at a
    time, set to zero, a negative, a bool, a str, None, a float."""
    for path in PATHS:
        for value in (0, -1, True, "1", None, 0.5):
            data = _document()
            target: Any = data
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value
            try:
                plan = plan_from_dict(data, manager_with_test_kinds())
            except KVSpecError:
                continue
            assert plan == PLAN, f"{path} = {value!r} was accepted as another plan"
