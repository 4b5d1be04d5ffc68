"""The spec-kind registry: kind name -> class, owner plugin, uniform-type base."""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from kvspec_core.errors import KindConflictError, MissingFamilyError, PluginError, UnknownNameError
from kvspec_core.plugins.known_families import KIND_DISTRIBUTIONS, install_hint
from kvspec_core.specs.base import KVSpec


@attrs.frozen
class SpecKindEntry:
    """One registered kind."""

    kind: str
    spec_class: type[KVSpec]
    uniform_base: type[KVSpec]
    owner: str


def _check_merge_declarations(spec_class: type[KVSpec], owner: str) -> None:
    """The generic merge reads these names; a typo would silently fall back to "must agree"."""
    fields = {attribute.name for attribute in attrs.fields(spec_class)}
    for declaration in ("merge_any_fields", "merge_optional_fields"):
        unknown = sorted(set(getattr(spec_class, declaration)) - fields)
        if unknown:
            raise PluginError(
                f"plugin {owner!r} registered {spec_class.__name__}, whose {declaration} names "
                f"{unknown}, which are not fields of it; its fields are {sorted(fields)}"
            )
    both = sorted(spec_class.merge_any_fields & spec_class.merge_optional_fields)
    if both:
        raise PluginError(
            f"plugin {owner!r} registered {spec_class.__name__}, which declares {both} in both "
            "merge_any_fields and merge_optional_fields; a field takes one merge rule"
        )


def _check_merge_is_classmethod(spec_class: type[KVSpec], owner: str) -> None:
    """The planner calls ``SpecClass.merge(specs, layer_names)`` on the class; an instance
    method there would take the list of specs for ``self`` and fail far from the plugin."""
    for klass in spec_class.__mro__:
        if "merge" in klass.__dict__:
            if not isinstance(klass.__dict__["merge"], classmethod):
                raise PluginError(
                    f"plugin {owner!r} registered {spec_class.__name__}, whose merge (defined "
                    f"in {klass.__name__}) is not a classmethod; declare it as @classmethod "
                    "def merge(cls, specs, layer_names=()) -> one spec for the group"
                )
            return


class SpecRegistry:
    """Spec kinds known to one plugin manager; never global."""

    def __init__(self) -> None:
        self._by_kind: dict[str, SpecKindEntry] = {}
        self._by_class: dict[type[KVSpec], SpecKindEntry] = {}
        #: Kind -> every plugin that claimed it; such a kind is registered for none of them.
        self._contested: dict[str, tuple[str, ...]] = {}

    def check(self, spec_class: object, owner: str, uniform_base: object = None) -> SpecKindEntry:
        """Validate a registration without applying it; returns the entry it would add."""
        if not (isinstance(spec_class, type) and issubclass(spec_class, KVSpec)):
            raise PluginError(
                f"plugin {owner!r} registered {spec_class!r}, which is not a KVSpec subclass"
            )
        # attrs.has() is true for a plain subclass too, whose own fields attrs never saw.
        if "__attrs_attrs__" not in spec_class.__dict__:
            raise PluginError(
                f"plugin {owner!r} registered {spec_class.__name__}, which is not an attrs class; "
                "decorate it with @attrs.frozen(kw_only=True)"
            )
        _check_merge_declarations(spec_class, owner)
        _check_merge_is_classmethod(spec_class, owner)
        kind = spec_class.__dict__.get("kind")
        if not isinstance(kind, str) or not kind:
            raise PluginError(
                f"plugin {owner!r} registered {spec_class.__name__} without its own `kind` "
                "class variable; set kind: ClassVar[str] = '<unique name>'"
            )
        existing = self._by_kind.get(kind)
        # Even the same class is refused from a second owner: taking it over would let that
        # plugin's rollback or unregistration remove the kind from its real owner.
        if existing is not None and (
            existing.spec_class is not spec_class or existing.owner != owner
        ):
            raise KindConflictError(
                f"spec kind {kind!r} registered by plugin {owner!r} ({spec_class.__qualname__}) "
                f"is already registered by plugin {existing.owner!r} "
                f"({existing.spec_class.__qualname__})",
                kind=kind,
                claimants=(existing.owner, owner),
            )
        if kind in self._contested:
            raise KindConflictError(
                self._contested_message(kind),
                kind=kind,
                claimants=(*self._contested[kind], owner),
            )
        if uniform_base is None:
            parent = self._nearest_entry(spec_class, skip_self=True)
            base = parent.uniform_base if parent is not None else spec_class
        elif isinstance(uniform_base, type) and issubclass(spec_class, uniform_base):
            base = uniform_base
        else:
            raise PluginError(
                f"plugin {owner!r}: uniform_base {uniform_base!r} of {spec_class.__name__} must "
                "be a class it inherits from"
            )
        return SpecKindEntry(kind=kind, spec_class=spec_class, uniform_base=base, owner=owner)

    def add(self, entry: SpecKindEntry) -> None:
        self._by_kind[entry.kind] = entry
        self._by_class[entry.spec_class] = entry

    def withdraw(self, kind: str, claimant: str) -> tuple[str, ...]:
        """Refuse ``kind`` to everyone: its owner (if it has one) loses it and ``claimant``
        joins those who claimed it. Returns every claimant so far."""
        entry = self._by_kind.pop(kind, None)
        if entry is not None:
            self._by_class.pop(entry.spec_class, None)
        earlier = self._contested.get(kind, (entry.owner,) if entry is not None else ())
        self._contested[kind] = (*earlier, claimant)
        return self._contested[kind]

    def contested_kinds(self) -> list[str]:
        """Kinds several plugins claimed, so that none has them."""
        return sorted(self._contested)

    def _contested_message(self, kind: str) -> str:
        claimants = ", ".join(repr(name) for name in self._contested[kind])
        return (
            f"spec kind {kind!r} is claimed by plugins {claimants}, so none of them provides "
            "it: uninstall all but one of them, or restrict loading with KVSPEC_PLUGINS"
        )

    def remove_owner(self, owner: str) -> None:
        for kind in [k for k, e in self._by_kind.items() if e.owner == owner]:
            entry = self._by_kind.pop(kind)
            self._by_class.pop(entry.spec_class, None)

    def _nearest_entry(self, cls: type, skip_self: bool = False) -> SpecKindEntry | None:
        for ancestor in cls.__mro__[1:] if skip_self else cls.__mro__:
            entry = self._by_class.get(ancestor)
            if entry is not None:
                return entry
        return None

    def entry_of(self, spec: KVSpec | type[KVSpec]) -> SpecKindEntry:
        """The registered entry for a spec or class, looked up through its class hierarchy."""
        cls = spec if isinstance(spec, type) else type(spec)
        entry = self._nearest_entry(cls)
        if self._contested and cls.__dict__.get("kind") in self._contested:
            raise PluginError(self._contested_message(cls.__dict__["kind"]))
        if entry is None:
            kind = getattr(cls, "kind", "")
            if kind in KIND_DISTRIBUTIONS:
                raise MissingFamilyError(
                    f"spec kind {kind!r} ({cls.__name__}) is not registered: its plugin is not "
                    f"loaded; {install_hint(KIND_DISTRIBUTIONS[kind])}"
                )
            raise UnknownNameError(
                f"{cls.__name__} is not a registered spec kind; register it through the "
                "kvspec_register_spec_kinds hook"
            )
        return entry

    def kind_of(self, spec: KVSpec | type[KVSpec]) -> str:
        return self.entry_of(spec).kind

    def uniform_base_of(self, spec: KVSpec | type[KVSpec]) -> type[KVSpec]:
        return self.entry_of(spec).uniform_base

    def class_of(self, kind: str) -> type[KVSpec]:
        """The class registered as ``kind``; a missing family names its distribution."""
        entry = self._by_kind.get(kind)
        if entry is not None:
            return entry.spec_class
        if kind in self._contested:
            raise PluginError(self._contested_message(kind))
        if kind in KIND_DISTRIBUTIONS:
            raise MissingFamilyError(
                f"spec kind {kind!r} is provided by {KIND_DISTRIBUTIONS[kind]}, which is not "
                f"installed or not loaded; {install_hint(KIND_DISTRIBUTIONS[kind])} (and check "
                "KVSPEC_PLUGINS)"
            )
        raise UnknownNameError(f"unknown spec kind {kind!r}; known: {', '.join(self.kinds())}")

    def owner_of(self, kind: str) -> str:
        self.class_of(kind)
        return self._by_kind[kind].owner

    def kinds(self, owner: str | None = None) -> list[str]:
        return sorted(k for k, e in self._by_kind.items() if owner is None or e.owner == owner)

    def __iter__(self) -> Iterator[SpecKindEntry]:
        return iter(list(self._by_kind.values()))

    def __contains__(self, kind: object) -> bool:
        return kind in self._by_kind
