"""kvspec: describe, plan and manage the KV cache of LLM inference engines.

Public API (stable, typed)::

    from kvspec_core import load_plugins, SizingContext, FullAttentionSpec
    manager = load_plugins()            # core families + installed plugins

Plugin authors find the whole contract here too: :class:`LayerConfig` (what a
``kvspec_layer_spec`` hook receives), the ``Register*`` callables the registration hooks
receive, :class:`FamilyRules` / :class:`FullAttentionRules` / :class:`TrailingWindowRules`
(runtime rules), ``cdiv`` / ``round_up`` (:mod:`kvspec_core.arithmetic`).
"""

from __future__ import annotations

# `import kvspec_core` has always loaded the runtime (`kvspec_core.runtime.X` works after it).
from kvspec_core import runtime  # noqa: F401
from kvspec_core.arithmetic import cdiv, round_up
from kvspec_core.context import SizingContext
from kvspec_core.errors import (
    CapacityError,
    ConfigError,
    InvalidFieldError,
    KVSpecError,
    MergeError,
    MissingFamilyError,
    PluginError,
)
from kvspec_core.kv_dtypes import KVCacheDtype, KVQuantMode
from kvspec_core.plugins import (
    CONTRACT_VERSION,
    PluginManager,
    RegisterKVDtype,
    RegisterRuntimeRules,
    RegisterSpecKind,
    hookimpl,
)
from kvspec_core.plugins.core_rules import FullAttentionRules, TrailingWindowRules
from kvspec_core.plugins.family_rules import FamilyRules, RulesFactory
from kvspec_core.plugins.layer_config import AttentionShape, LayerConfig, PlanOptions
from kvspec_core.plugins.manager import load_plugins
from kvspec_core.specs import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVSharingSpec,
    KVSpec,
    SinkFullAttentionSpec,
    UniformTypeSpecs,
)
from kvspec_core.version import __version__

__all__ = [
    "CONTRACT_VERSION",
    "AttentionShape",
    "AttentionSpec",
    "CapacityError",
    "ConfigError",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FamilyRules",
    "FullAttentionRules",
    "FullAttentionSpec",
    "InvalidFieldError",
    "KVCacheDtype",
    "KVQuantMode",
    "KVSharingSpec",
    "KVSpec",
    "KVSpecError",
    "LayerConfig",
    "MergeError",
    "MissingFamilyError",
    "PlanOptions",
    "PluginError",
    "PluginManager",
    "RegisterKVDtype",
    "RegisterRuntimeRules",
    "RegisterSpecKind",
    "RulesFactory",
    "SinkFullAttentionSpec",
    "SizingContext",
    "TrailingWindowRules",
    "UniformTypeSpecs",
    "__version__",
    "cdiv",
    "hookimpl",
    "load_plugins",
    "round_up",
]
