"""The hooks a kvspec plugin may implement (contract version 1).

Registration hooks follow the "register callback" style: the core calls each plugin's
implementation on its own with a ``register`` function bound to that plugin, validates
everything handed to it, and applies a plugin's registrations all together or not at all.
None of these hooks is ``firstresult`` or ``historic``: the core calls every implementation
itself, one plugin at a time, so one plugin raising never aborts another's call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvspec_core.plugins.contract import hookspec

if TYPE_CHECKING:
    from kvspec_core.kv_dtypes import KVCacheDtype
    from kvspec_core.plugins.family_rules import FamilyRules
    from kvspec_core.plugins.layer_config import LayerConfig
    from kvspec_core.specs.base import KVSpec


class RegisterSpecKind(Protocol):
    """The ``register`` a plugin's ``kvspec_register_spec_kinds`` receives:
    ``register(spec_class, uniform_base=None)`` adds a spec kind owned by the caller."""

    def __call__(
        self, spec_class: type[KVSpec], uniform_base: type[KVSpec] | None = None
    ) -> None: ...


class RegisterKVDtype(Protocol):
    """The ``register`` a plugin's ``kvspec_register_kv_dtypes`` receives:
    ``register(kv_dtype)`` adds a KV-cache dtype name owned by the caller."""

    def __call__(self, kv_dtype: KVCacheDtype) -> None: ...


class RegisterRuntimeRules(Protocol):
    """The ``register`` a plugin's ``kvspec_register_runtime_rules`` receives:
    ``register(kind, rules)`` sets the rules factory of a kind the caller registered:
    ``rules(spec, ctx)`` returns a :class:`~kvspec_core.runtime.FamilyRules` for one group,
    ``spec`` being an instance of that kind (so the factory may take the kind's own spec
    class, hence the loose parameter types)."""

    def __call__(self, kind: str, rules: Callable[..., FamilyRules]) -> None: ...


@hookspec
def kvspec_register_spec_kinds(register: RegisterSpecKind) -> None:
    """Register the spec classes this plugin provides (since contract 1).

    Call ``register(SpecClass)`` once per class. ``SpecClass`` is a frozen attrs subclass of
    :class:`kvspec_core.KVSpec` with a unique ``kind`` class variable. ``uniform_base`` names
    the class whose instances may share a uniform-type group with it (default: the nearest
    registered ancestor's base, else the class itself). A kind registered by another plugin
    is refused naming both plugins. Not firstresult; return value ignored.
    """


@hookspec
def kvspec_register_kv_dtypes(register: RegisterKVDtype) -> None:
    """Register KV-cache dtypes (name, storage dtype, quant mode) (since contract 1).

    Call ``register(KVCacheDtype(...))``; the name becomes valid for ``--kv-cache-dtype``.
    A name another plugin registered differently is refused. Not firstresult.
    """


@hookspec
def kvspec_layer_spec(layer: LayerConfig) -> KVSpec | None:
    """Return the spec of ``layer`` if this plugin's family owns it, else ``None`` (since 1).

    Called once per plugin per layer. Exactly one plugin must claim each layer: none is
    refused naming the layer, its type and the distribution that provides it; two are
    refused naming both plugins. Raise :class:`kvspec_core.errors.ConfigError` naming the
    config field when the layer is yours but its fields are invalid. Any other exception (or
    an answer that is neither a spec nor ``None``) is a bug the core isolates: a warning where
    another plugin claims the layer, a :class:`~kvspec_core.errors.PluginError` naming your
    distribution where none does (or under ``KVSPEC_STRICT_PLUGINS=1``). Not firstresult.
    """


@hookspec
def kvspec_register_runtime_rules(register: RegisterRuntimeRules) -> None:
    """Register runtime allocator rules for kinds this plugin registered (since contract 1).

    ``rules`` is a factory ``rules(spec, ctx)`` (typically the rules class) returning an
    object that implements :class:`kvspec_core.runtime.rules.FamilyRules` for one group
    (tokens that can be dropped, longest resumable cache hit, blocks to allocate). Kinds
    without rules use their nearest registered ancestor kind's, else full attention's. Not
    firstresult.
    """


#: Every hook name, in the order the core calls them.
HOOK_NAMES = (
    "kvspec_register_spec_kinds",
    "kvspec_register_kv_dtypes",
    "kvspec_register_runtime_rules",
    "kvspec_layer_spec",
)
