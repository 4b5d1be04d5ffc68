"""Exception types. Every error kvspec raises on bad input is a :class:`KVSpecError`.

They subclass ``ValueError`` or ``TypeError`` as fits so that callers that already catch
those keep working, while ``except KVSpecError`` catches exactly what kvspec refuses.
"""

from __future__ import annotations


class KVSpecError(Exception):
    """Base class of every error kvspec raises on purpose."""


class InvalidFieldError(KVSpecError, ValueError):
    """A spec or value object was given a field value it cannot hold.

    The message names the class, the field, the value given and what is allowed.
    """

    def __init__(self, owner: str, field: str, value: object, allowed: str) -> None:
        self.owner = owner
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{owner}.{field}={value!r} is invalid: {allowed}")


class InvalidFieldTypeError(KVSpecError, TypeError):
    """A field was given a value of the wrong type."""

    def __init__(self, owner: str, field: str, value: object, allowed: str) -> None:
        self.owner = owner
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{owner}.{field}={value!r} has type {type(value).__name__}: {allowed}")


class MergeError(KVSpecError, ValueError):
    """Layers that cannot share one KV cache group were asked to.

    The message names the differing field, the values and the layers holding each value.
    """


class UnknownNameError(KVSpecError, ValueError):
    """A name (KV dtype, spec kind, preset, ...) that nothing registered."""


class MissingFamilyError(KVSpecError, LookupError):
    """A spec kind or model layer needs a family plugin that is not installed or not loaded."""


class PluginError(KVSpecError, RuntimeError):
    """A plugin failed to load, broke the hook contract, or conflicts with another."""


class ConfigError(KVSpecError, ValueError):
    """A model configuration cannot be turned into layer specs."""


class CapacityError(KVSpecError, ValueError):
    """The budget cannot hold what was asked for; the message states needed and available bytes."""


class PlanError(KVSpecError, ValueError):
    """A plan cannot be built or expressed (layout, alignment, block sizes)."""


class AllocatorError(KVSpecError, RuntimeError):
    """The runtime allocator was asked for something that would corrupt its state."""


class RulesSizingError(AllocatorError):
    """A group's runtime rules keep more blocks than its spec is sized for (the check of
    ``kvspec_core.runtime.rules_for``): ``shortfall`` says what, ``fix`` what to do; a caller
    that knows a better fix (a HiSparse group, which cannot reach plugin rules) gives its
    own beside ``shortfall``."""

    def __init__(self, shortfall: str, fix: str) -> None:
        super().__init__(f"{shortfall}; {fix}")
        self.shortfall = shortfall
        self.fix = fix


class KindConflictError(PluginError):
    """Several plugins register one spec kind. ``claimants`` are their plugin names, the
    first one holding the kind (if any) first."""

    def __init__(self, message: str, *, kind: str, claimants: tuple[str, ...]) -> None:
        super().__init__(message)
        self.kind = kind
        self.claimants = claimants
