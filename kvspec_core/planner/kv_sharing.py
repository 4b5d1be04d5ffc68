"""Cross-layer KV sharing in the planner: which layer's cache each reading layer reads.

A :class:`~kvspec_core.specs.kv_sharing.KVSharingSpec` layer needs no blocks, so grouping
lists it among the memoryless layers like any layer whose ``max_blocks_per_request`` is 0.
What sets it apart is checked here, before anything is sized: its target is a layer of the
plan, earlier in model order, not in a cycle of readers; a chain of readers is followed to
the layer holding the cache (its *source*); the source holds blocks; and the reader's own
spec merges with its source's (same family, window and page geometry), so the view it gets,
its source's, is the cache it means to read. The plan records ``(reader, source)`` pairs
(``plan.kv_sharing``); ``materialize()`` views each reader over its source's bytes.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Mapping
from typing import cast

from kvspec_core.errors import MergeError, PlanError
from kvspec_core.planner.spec_answers import checked_merge
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.kv_sharing import KVSharingSpec

#: How a reading layer names its target, in errors.
TARGET_FIELD = "target_layer"


def _follow(
    reader: str,
    layer_specs: Mapping[str, KVSpec],
    order: Mapping[str, int],
    resolved: dict[str, str],
) -> str:
    """The layer whose cache ``reader`` ends up reading (its chain followed), refusing a
    cycle, a target that is not planned, and a target later in model order. ``resolved``
    holds the sources found so far (each hop is walked once over all readers)."""
    chain = [reader]
    on_chain = {reader}
    while True:
        # Only reading layers are appended to the chain (see the end of the loop).
        target = cast(KVSharingSpec, layer_specs[chain[-1]]).target_layer
        if target in on_chain:
            cycle = " -> ".join([*chain[chain.index(target) :], target])
            raise PlanError(
                f"layers {cycle} read each other's KV cache in a cycle (field "
                f"{TARGET_FIELD!r}), so none of them holds the cache they read; give one of "
                "them a cache of its own (its family's spec instead of a KVSharingSpec)"
            )
        if target not in layer_specs:
            raise PlanError(
                f"layer {chain[-1]} reads the KV cache of layer {target!r} (field "
                f"{TARGET_FIELD!r}), which is not among the planned layers; name an earlier "
                "layer of this model that holds a cache (with pipeline parallelism, one on "
                "the same stage)"
            )
        chain.append(target)
        on_chain.add(target)
        if target in resolved or not isinstance(layer_specs[target], KVSharingSpec):
            break
    for current, target in itertools.pairwise(chain):  # each hop walked here
        if order[target] >= order[current]:
            raise PlanError(
                f"layer {current} reads the KV cache of layer {target} (field "
                f"{TARGET_FIELD!r}), which comes after it in model order; a layer can only "
                "read a cache an earlier layer has written in the same step: name an "
                "earlier layer"
            )
    source = resolved.get(chain[-1], chain[-1])
    for layer in chain[:-1]:
        resolved[layer] = source
    return source


def _check_same_cache(
    reader: str, source: str, reader_spec: KVSpec, source_spec: KVSpec, manager: PluginManager
) -> None:
    """Refuse a reader whose own spec does not describe its source's cache."""
    manager.spec_kinds.entry_of(reader_spec)
    fix = (
        f"the reader's reader_spec must be of the source's kind ({type(source_spec).__name__}) "
        "with the same geometry and window: read a layer of the same attention type"
    )
    if type(reader_spec) is not type(source_spec):
        raise PlanError(
            f"layer {reader} cannot read the KV cache of layer {source}: its reader_spec is a "
            f"{type(reader_spec).__name__} but layer {source} holds a "
            f"{type(source_spec).__name__} cache; {fix}"
        )
    try:
        checked_merge(
            type(source_spec),
            [source_spec, reader_spec],
            [source, reader],
            f"layer {reader} reading layer {source}",
        )
    except MergeError as error:
        raise PlanError(
            f"layer {reader} cannot read the KV cache of layer {source}: "
            f"{_difference_of(error)}; {fix}"
        ) from error


#: The default merge's framing of a difference (``kvspec_core.specs.merging``): advice for
#: layers sharing a group ("plan them in separate groups"), no fix for a reader.
_GROUP_FRAMING = re.compile(
    r"^layers cannot share one KV cache group: (?P<difference>.*?)"
    r"(?:; give them the same \w+ or plan them in separate groups)?$",
    re.DOTALL,
)


def _difference_of(error: MergeError) -> str:
    """What differs, from a merge refusal, without its advice on grouping."""
    found = _GROUP_FRAMING.match(str(error))
    return found["difference"] if found is not None else str(error)


def resolve_kv_sharing(
    layer_specs: Mapping[str, KVSpec], memoryless: Collection[str], manager: PluginManager
) -> tuple[tuple[str, str], ...]:
    """``(reader, source)`` for every reading layer of ``layer_specs`` (model order), its
    pairing checked; ``memoryless`` are the layers that need no blocks (the readers among
    them), since a source must hold blocks."""
    pairs = []
    order = {name: index for index, name in enumerate(layer_specs)}
    resolved: dict[str, str] = {}
    for reader, spec in layer_specs.items():
        if not isinstance(spec, KVSharingSpec):
            continue
        source = resolved.get(reader) or _follow(reader, layer_specs, order, resolved)
        if source in memoryless:
            raise PlanError(
                f"layer {reader} reads the KV cache of layer {source} (field "
                f"{TARGET_FIELD!r}), but layer {source} holds none (its spec needs no blocks, "
                "like encoder-only attention); name a layer that holds a cache"
            )
        _check_same_cache(reader, source, spec.reader_spec, layer_specs[source], manager)
        pairs.append((reader, source))
    return tuple(pairs)


def check_plan_sharing(
    kv_sharing: tuple[tuple[str, str], ...],
    memoryless: Collection[str],
    grouped: Collection[str],
) -> None:
    """Refuse a plan's ``kv_sharing`` unless every reader is a memoryless layer read once and
    every source a layer holding blocks (a plan read back from a document)."""
    seen: set[str] = set()
    # The planner writes kv_sharing from the layer specs; a pair it could not have written
    # means the plan was edited (or made by something else).
    fix = "the planner writes kv_sharing: re-plan instead of editing a plan"
    for index, (reader, source) in enumerate(kv_sharing):
        if reader in seen or reader not in memoryless:
            raise PlanError(
                f"kv_sharing[{index}]: layer {reader!r} must be a memoryless layer of the plan, "
                f"listed once; {fix}"
            )
        if source not in grouped:
            raise PlanError(
                f"kv_sharing[{index}]: layer {reader!r} reads layer {source!r}, which holds no "
                f"blocks in this plan; {fix}"
            )
        seen.add(reader)
