"""Per-family runtime rules as the allocator uses them: which rules govern a group, which of
them the compiled kernels run, and which plugin to name when a plugin's rules raise.

The contract a family's rules implement (:class:`FamilyRules`) and the core's shapes to
subclass (:class:`FullAttentionRules` and the rest) belong to the plugin contract
(:mod:`kvspec_core.plugins.family_rules`, :mod:`kvspec_core.plugins.core_rules`); they are
re-exported here, their historical home, so ``from kvspec_core.runtime.rules import
FullAttentionRules`` keeps working.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvspec_core.errors import AllocatorError, KVSpecError, PluginError, RulesSizingError
from kvspec_core.plugins.core_rules import (
    CORE_RULES,
    CrossAttentionRules,
    FullAttentionRules,
    SingleBlockRules,
    StateCheckpointRules,
    TrailingWindowRules,
)
from kvspec_core.plugins.family_rules import NEVER, FamilyRules, RulesFactory, block_tokens_of
from kvspec_core.runtime.native import native
from kvspec_core.specs.uniform import UniformTypeSpecs

if TYPE_CHECKING:
    from kvspec_core.context import SizingContext
    from kvspec_core.plugins.manager import PluginManager
    from kvspec_core.specs.base import KVSpec

__all__ = [
    "COMPILED_METHODS",
    "COMPILED_SHAPES",
    "CORE_RULES",
    "NEVER",
    "STEP_METHODS",
    "CrossAttentionRules",
    "FamilyRules",
    "FullAttentionRules",
    "HitScan",
    "RulesFactory",
    "SingleBlockRules",
    "StateCheckpointRules",
    "TrailingWindowRules",
    "block_tokens_of",
    "caches_prompt_only",
    "compiled_shape",
    "hit_scanner",
    "plugin_rules_error",
    "rules_for",
    "rules_plugin",
]

#: The rules methods a block-boundary step asks (what the compiled step does itself).
STEP_METHODS = (
    "skipped_tokens",
    "next_skip_position",
    "blocks_needed",
    "next_allocation_end",
    "cache_range",
)
#: The core's parametric rule shapes the compiled step knows, by its code for them.
COMPILED_SHAPES: tuple[type[FullAttentionRules], ...] = (
    FullAttentionRules,
    TrailingWindowRules,
    StateCheckpointRules,
)


#: The rules methods the compiled kernels run as the class's code.
COMPILED_METHODS = (*STEP_METHODS, "longest_hit")


def overrides_on_instance(rules: object, names: Sequence[str] = COMPILED_METHODS) -> bool:
    """Whether ``rules`` carries one of the methods ``names`` of its own (set on the
    instance, e.g. by its factory): the compiled kernels, which run the class's code, must
    not answer for it."""
    own = getattr(rules, "__dict__", None)
    if not own:
        return False
    return any(name in own for name in names)


def compiled_shape(rules: object) -> int | None:
    """The index in :data:`COMPILED_SHAPES` of the shape whose step methods ``rules`` keeps
    (a subclass that overrides none of them, none set on the instance), or ``None`` (its
    steps run as Python)."""
    if overrides_on_instance(rules) or caches_prompt_only(rules):
        return None
    for code, shape in enumerate(COMPILED_SHAPES):
        if isinstance(rules, shape) and all(
            getattr(type(rules), name) is getattr(shape, name) for name in STEP_METHODS
        ):
            return code
    return None


def caches_prompt_only(rules: object) -> bool:
    """The rules' optional ``caches_prompt_only`` (see :class:`FamilyRules`): ``False``
    when absent; anything but a bool is refused (a truthy string must not decide which
    blocks are hits)."""
    value = getattr(rules, "caches_prompt_only", False)
    if value.__class__ is not bool:
        raise AllocatorError(
            f"runtime rules {rules!r}: caches_prompt_only={value!r} must be True or False "
            "(whether only blocks inside the request's prompt enter the prefix cache)"
        )
    return value


#: ``longest_hit(hashes, cache, max_blocks)`` as the allocator calls it.
HitScan = Callable[[Sequence[bytes], Mapping[bytes, int], int], list[int]]


def hit_scanner(rules: FamilyRules) -> HitScan:
    """What the allocator calls for ``rules.longest_hit(hashes, cache, max_blocks)``: the
    compiled twin of :class:`FullAttentionRules`'s scan (the same answer) when, at the call,
    ``rules`` still use that scan (no override on the class, none set on the instance) and
    the arguments are a list and a dict; ``rules.longest_hit`` itself otherwise. Decided per
    call, so an override made after the allocator was built is asked too."""
    if native is None:

        def ask_the_rules(
            hashes: Sequence[bytes], cache: Mapping[bytes, int], max_blocks: int
        ) -> list[int]:
            return rules.longest_hit(hashes, cache, max_blocks)

        return ask_the_rules
    compiled_scan = native.longest_hit
    core_scan = FullAttentionRules.longest_hit

    def longest_hit(
        hashes: Sequence[bytes], cache: Mapping[bytes, int], max_blocks: int
    ) -> list[int]:
        if (
            getattr(type(rules), "longest_hit", None) is not core_scan
            or overrides_on_instance(rules, ("longest_hit",))
            or hashes.__class__ is not list
            or cache.__class__ is not dict
        ):
            return rules.longest_hit(hashes, cache, max_blocks)
        try:
            cacheable = rules.prefix_cacheable
        except Exception:
            # Raise from inside the rules' own scan, as the Python path does, so the error
            # names the method the plugin's code failed in.
            return rules.longest_hit(hashes, cache, max_blocks)
        if not cacheable:
            return []
        found: list[int] = compiled_scan(hashes, cache, max_blocks)
        return found

    return longest_hit


def _rules_factory(
    spec: KVSpec, manager: PluginManager | None
) -> tuple[RulesFactory, str, str | None]:
    """The factory of ``spec``'s rules, the kind it was registered for, and the plugin that
    registered it (``None`` for the core's)."""
    # A kind without rules of its own behaves like its nearest ancestor kind that has some
    # (sliding-window MLA frees blocks like a sliding window, not like full attention).
    for klass in type(spec).__mro__:
        kind = getattr(klass, "kind", "")
        if not kind:
            continue
        if manager is not None:
            factory = manager.runtime_rules(kind)
            if factory is not None:
                return factory, kind, manager.spec_kinds.owner_of(kind)
        core = CORE_RULES.get(kind)
        if core is not None:
            return core, kind, None
    return CORE_RULES["full_attention"], "full_attention", None


def rules_plugin(spec: KVSpec, manager: PluginManager | None) -> tuple[str, str] | None:
    """``(plugin name, kind)`` of the plugin whose rules govern ``spec``'s group, or
    ``None`` when the core's rules do."""
    family_spec = spec.first_spec if isinstance(spec, UniformTypeSpecs) else spec
    _, kind, owner = _rules_factory(family_spec, manager)
    return None if owner is None else (owner, kind)


def rules_for(spec: KVSpec, ctx: SizingContext, manager: PluginManager | None) -> FamilyRules:
    """The rules of a group: those registered for its kind, else for its nearest ancestor
    kind, else full attention's. A uniform-type group uses its members' family's rules."""
    family_spec = spec.first_spec if isinstance(spec, UniformTypeSpecs) else spec
    factory, kind, owner = _rules_factory(family_spec, manager)
    try:
        rules = factory(family_spec, ctx)
    except KVSpecError:
        raise
    except Exception as error:
        if owner is None:
            raise
        raise PluginError(
            f"plugin {owner!r}: its runtime rules for kind {kind!r} raised "
            f"{type(error).__name__} when built for {family_spec.kind!r}: {error}; fix the "
            "plugin or leave it out (KVSPEC_PLUGINS)"
        ) from None
    if not isinstance(rules, FamilyRules):
        raise AllocatorError(
            f"runtime rules for kind {family_spec.kind!r} ({factory!r}) do not implement "
            "kvspec_core.runtime.rules.FamilyRules"
        )
    _check_rules_keep_within_sizing(family_spec, ctx, rules, kind, owner)
    return rules


def _check_rules_keep_within_sizing(
    spec: KVSpec, ctx: SizingContext, rules: FamilyRules, kind: str, owner: str | None
) -> None:
    """Refuse rules that free no block (full attention's step methods) for a spec sized for
    fewer blocks than a request of ``max_model_len`` tokens then holds: a kind without rules
    of its own (a plugin's window or sink+recent spec) falls back to full attention's, and
    every request would be refused as over its admission cap long before max_model_len,
    while the plan counts it whole."""
    if getattr(type(rules), "skipped_tokens", None) is not FullAttentionRules.skipped_tokens:
        return  # the rules free blocks as the request grows
    sized = spec.max_blocks_per_request(ctx)
    if sized == 0:
        return  # a group holding no blocks (encoder-only layers): the allocator skips it
    _, needed = rules.blocks_needed(0, 0, ctx.max_model_len, 0)
    if needed <= sized:
        return
    source = f"kind {kind!r}'s" + (f" (plugin {owner!r})" if owner else "")
    raise RulesSizingError(
        f"kind {spec.kind!r} is sized for {sized} blocks per request (its "
        f"max_blocks_per_request), but the runtime rules it gets, {source} "
        f"{type(rules).__name__}, free none and keep {needed} for a request of "
        f"max_model_len={ctx.max_model_len:,} tokens, so no request could grow past "
        f"{sized * rules.block_tokens:,} tokens while the plan counts it whole",
        f"register rules for {spec.kind!r} that free what its sizing leaves out (the "
        "kvspec_register_runtime_rules hook; a TrailingWindowRules subclass for a window)",
    )


def plugin_rules_error(
    error: BaseException, rules: Sequence[object], owners: Sequence[tuple[str, str] | None]
) -> PluginError | None:
    """A :class:`PluginError` naming the plugin, kind and method when ``error`` was raised
    inside a plugin's rules object ``rules[i]`` (``owners[i]`` its plugin and kind), found
    from the traceback; ``None`` when no plugin rules are in it (an error of the caller or
    of kvspec itself, to be raised as it is)."""
    traceback = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        owner_self = frame.f_locals.get("self")
        for index, candidate in enumerate(rules):
            if owner_self is candidate and owners[index] is not None:
                plugin, kind = owners[index]  # type: ignore[misc]
                return PluginError(
                    f"plugin {plugin!r}: its runtime rules for kind {kind!r} (group {index}) "
                    f"raised {type(error).__name__} in {frame.f_code.co_name}: {error}; the "
                    "allocator changed nothing; fix the plugin or leave it out (KVSPEC_PLUGINS)"
                )
        traceback = traceback.tb_next
    return None
