"""What each decoder layer of a transformers model computes, and the check that a kvspec plan
agrees with it before the engine runs anything.

The paged attention takes every family rule from the kvspec spec (which keys a query reads),
never from transformers' masks. A plan made from a config that disagrees with the model (a
``kvspec_config`` with window 4096 for a model whose layers attend over 24 tokens, a layer
planned as attention where the model keeps a recurrent state) would answer with wrong tokens.
:func:`check_plan_against_model` refuses it at engine start, naming the layer, both readings
and the fix.

The model's reading follows what transformers builds its masks from: ``config.layer_types``
(``full_attention``, ``sliding_attention`` over ``config.sliding_window`` tokens,
``chunked_attention`` over ``config.attention_chunk_size``, ``linear_attention`` / ``mamba``
state layers); a config without ``layer_types`` slides every layer when it sets
``sliding_window`` (Mistral), else attends fully.

Which layers attend over another layer's K/V (cross-layer KV sharing, Gemma-3n) is read from
the model's attention modules, what transformers' forward itself branches on
(:func:`model_kv_sources`); :func:`check_sharing_against_model` refuses a plan whose
``kv_sharing`` says otherwise. A reader the plan gives a cache of its own would attend over
blocks nothing ever writes (transformers calls no ``cache.update`` for it): wrong tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from kvspec_core.specs.attention import AttentionSpec
from kvspec_core.specs.base import KVSpec
from kvspec_transformers.errors import EngineError

#: ``layer_types`` values of layers that attend over cached keys.
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
#: ``layer_types`` values of layers that keep a conv window and a recurrent state.
STATE_TYPES = ("linear_attention", "mamba")
#: ``layer_types`` values of layers that keep no cache (Nemotron-H's MLP and MoE layers).
MEMORYLESS_TYPES = ("mlp", "moe")
#: The config field that sets each attention type's span.
SPAN_FIELDS = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}


@attrs.frozen(kw_only=True)
class ModelLayer:
    """What layer ``index`` of the model computes.

    Attributes:
        index: the decoder layer's index.
        layer_type: a ``config.layer_types`` value (see :data:`ATTENTION_TYPES`,
            :data:`STATE_TYPES`).
        span: the sliding window or attention chunk in tokens; ``None`` for other types.
    """

    index: int
    layer_type: str
    span: int | None = None

    def first_attended_position(self, position: int) -> int:
        """The first key the query at ``position`` reads, as transformers' masks say."""
        if self.layer_type == "sliding_attention" and self.span is not None:
            return max(0, position - self.span + 1)
        if self.layer_type == "chunked_attention" and self.span is not None:
            return position - position % self.span
        return 0

    def describe(self) -> str:
        if self.span is not None:
            return f"{self.layer_type} (model.config.{SPAN_FIELDS[self.layer_type]}={self.span})"
        return self.layer_type


def model_layers(config: Any) -> list[ModelLayer]:
    """Every decoder layer of the model ``config`` (a transformers config) describes."""
    count = int(config.num_hidden_layers)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        window = getattr(config, "sliding_window", None)
        sliding = window is not None and getattr(config, "use_sliding_window", True) is not False
        layer_types = ["sliding_attention" if sliding else "full_attention"] * count
    if len(layer_types) != count:
        raise EngineError(
            f"model.config.layer_types has {len(layer_types)} entries for "
            f"num_hidden_layers={count}; fix the model's config"
        )
    layers = []
    for index, layer_type in enumerate(layer_types):
        field = SPAN_FIELDS.get(layer_type)
        span = getattr(config, field, None) if field is not None else None
        if field is not None and not (isinstance(span, int) and span > 0):
            raise EngineError(
                f"model layer {index} is {layer_type} but model.config.{field}={span!r} is not "
                "a positive int; fix the model's config"
            )
        layers.append(ModelLayer(index=index, layer_type=str(layer_type), span=span))
    return layers


def describe_spec(spec: KVSpec) -> str:
    """A spec as the error messages name it: its kind and its span, if any."""
    for field in SPAN_FIELDS.values():
        span = getattr(spec, field, None)
        if span is not None:
            return f"a {spec.kind} spec with {field}={span}"
    return f"a {spec.kind} spec"


def _positions(max_model_len: int, layer: ModelLayer, spec: KVSpec) -> range:
    """Query positions where two read ranges would differ if their rules differ: up to a
    few spans past the larger span (the rules are periodic or monotone after that)."""
    spans = [layer.span or 0] + [getattr(spec, field, None) or 0 for field in SPAN_FIELDS.values()]
    return range(min(max_model_len, 3 * max(spans) + 64))


def _is_hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def fix_for(own_config: bool) -> str:
    """How to make the plan agree with the model: ``own_config`` when kvspec planned
    ``model.config`` itself (then "plan the model's own config" is what was done)."""
    if own_config:
        return (
            "kvspec planned model.config itself and reads it otherwise than the model's code "
            "computes it (a kvspec ingestion gap): pass a kvspec_config that describes what "
            "the model computes"
        )
    return (
        "plan the model's own config (TransformersEngine(model) without kvspec_config), or "
        "make kvspec_config agree with model.config"
    )


def check_plan_against_model(
    config: Any,
    planned: Mapping[int, tuple[str, KVSpec]],
    max_model_len: int,
    *,
    own_config: bool = False,
) -> None:
    """Refuse a plan whose layers do not compute what the model's layers compute.

    ``planned``: per model layer index, the kvspec layer name and spec of every layer the
    plan keeps a cache for (a layer reading another's cache: the spec it reads through);
    ``own_config``: the plan was made from ``model.config`` (the fix then says so).

    Each model layer that attends must have an attention spec whose
    ``first_attended_position`` equals the model's for every query position; each state
    layer must be bound to a state (non-attention) spec.
    """
    fix = fix_for(own_config)
    known = ATTENTION_TYPES + STATE_TYPES + MEMORYLESS_TYPES
    # Layers of one type and span with one spec read alike: each pair is checked once.
    agreed: set[tuple[str, int | None, KVSpec]] = set()
    for layer in model_layers(config):
        name, spec = planned.get(layer.index, (f"model.layers.{layer.index}", None))
        if layer.layer_type not in known:
            raise EngineError(
                f"layer {name}: the model computes a {layer.layer_type!r} layer "
                "(model.config.layer_types), which kvspec-transformers cannot check against "
                f"the plan; it runs {', '.join(known)} layers"
            )
        if layer.layer_type in MEMORYLESS_TYPES:
            if spec is not None:
                raise EngineError(
                    f"layer {name}: the model computes an {layer.layer_type} layer (no cache) "
                    f"but the kvspec plan has {describe_spec(spec)}: {fix} (layer_types)"
                )
            continue
        if spec is None:
            raise EngineError(
                f"layer {name}: the model computes {layer.describe()} but the kvspec plan "
                f"keeps no cache for it: {fix}"
            )
        is_attention = isinstance(spec, AttentionSpec)
        if (layer.layer_type in STATE_TYPES) == is_attention:
            raise EngineError(
                f"layer {name}: the model computes {layer.describe()} but the kvspec plan has "
                f"{describe_spec(spec)}: {fix} (layer_types)"
            )
        if not isinstance(spec, AttentionSpec):
            continue
        key = (layer.layer_type, layer.span, spec)
        hashable = _is_hashable(key)  # a plugin spec that is not: checked every time
        if hashable and key in agreed:
            continue
        for position in _positions(max_model_len, layer, spec):
            if spec.first_attended_position(position) != layer.first_attended_position(position):
                field = SPAN_FIELDS.get(layer.layer_type)
                how = (
                    f"set kvspec_config's {field} to {layer.span}, or {fix}"
                    if field is not None and getattr(spec, field, None) is not None
                    else f"{fix} (layer_types)"
                )
                raise EngineError(
                    f"layer {name}: the model computes {layer.describe()} but the kvspec plan "
                    f"has {describe_spec(spec)} (the query at position {position} would read "
                    f"from key {spec.first_attended_position(position)}, the model's from "
                    f"{layer.first_attended_position(position)}): {how}"
                )
        if hashable:
            agreed.add(key)


def model_kv_sources(model: torch.nn.Module) -> dict[int, int | None]:
    """Reader layer index -> the index of the layer whose K/V it attends over, for every
    attention module the model builds without K/V of its own (``is_kv_shared_layer``).

    The source is the module's ``kv_shared_layer_index`` where it names one (transformers
    4.5x's Gemma-3n); else, as transformers 5's ``Gemma3nTextAttention.forward`` reads
    ``shared_kv_states[self.layer_type]``, the last earlier module of the same
    ``layer_type`` that stores its K/V there (``store_full_length_kv``); ``None`` when the
    modules say neither."""
    modules = sorted(
        (
            (int(getattr(module, "layer_idx")), module)  # noqa: B009
            for module in model.modules()
            if hasattr(module, "is_kv_shared_layer") and hasattr(module, "layer_idx")
        ),
        key=lambda item: item[0],
    )
    sources: dict[int, int | None] = {}
    last_store: dict[Any, int] = {}
    for index, module in modules:
        if getattr(module, "is_kv_shared_layer", False):
            named = getattr(module, "kv_shared_layer_index", None)
            layer_type = getattr(module, "layer_type", None)
            sources[index] = int(named) if isinstance(named, int) else last_store.get(layer_type)
        elif getattr(module, "store_full_length_kv", False):
            last_store[getattr(module, "layer_type", None)] = index
    return sources


def check_sharing_against_model(
    model_sources: Mapping[int, int | None],
    plan_sources: Mapping[int, int],
    names: Mapping[int, str],
    shared_layers_field: Any = None,
    *,
    own_config: bool = False,
) -> None:
    """Refuse a plan whose cross-layer KV sharing is not the model's, naming the first
    layer where they differ: a layer the model computes without K/V that the plan gives a
    cache (or another source), or a layer the plan makes a reader that computes its own.

    ``model_sources``: :func:`model_kv_sources`; ``plan_sources``: reader index -> source
    index of ``plan.kv_sharing``; ``names``: the kvspec layer name of each index;
    ``shared_layers_field``: ``model.config.num_kv_shared_layers`` (quoted in the fix);
    ``own_config``: as :func:`check_plan_against_model`'s."""
    fix = fix_for(own_config)

    def name(index: int | None) -> str:
        return names.get(index, f"model.layers.{index}") if index is not None else "?"

    field = (
        f" (model.config.num_kv_shared_layers={shared_layers_field})"
        if shared_layers_field is not None
        else ""
    )
    for index, source in sorted(model_sources.items()):
        if source is None:
            raise EngineError(
                f"layer {name(index)}: the model computes no K/V for it (is_kv_shared_layer) "
                "and its attention module does not say whose it reads (no "
                "kv_shared_layer_index, no earlier store_full_length_kv layer of its "
                "layer_type); kvspec-transformers cannot check it against the plan"
            )
    for index in sorted(set(model_sources) | set(plan_sources)):
        if index not in plan_sources:
            raise EngineError(
                f"layer {name(index)}: the model attends over the K/V of layer "
                f"{name(model_sources[index])} (is_kv_shared_layer{field}) but the kvspec plan "
                "keeps a cache of its own for it, which nothing would write: "
                f"{fix}"
            )
        if index not in model_sources:
            raise EngineError(
                f"layer {name(index)}: the kvspec plan has it read layer "
                f"{name(plan_sources[index])}'s cache (plan.kv_sharing) but the model computes "
                f"K/V of its own for it{field}: {fix}"
            )
        if model_sources[index] != plan_sources[index]:
            raise EngineError(
                f"layer {name(index)}: the model attends over the K/V of layer "
                f"{name(model_sources[index])} but the kvspec plan has it read layer "
                f"{name(plan_sources[index])}'s cache (plan.kv_sharing): {fix}"
            )
