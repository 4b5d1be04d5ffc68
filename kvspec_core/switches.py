"""On/off environment switches (``KVSPEC_STRICT_PLUGINS``, kvspec-vllm's ``KVSPEC_VLLM*``):
one reading of their values, so that every switch takes the same words."""

from __future__ import annotations

#: Values that turn a switch on, and off (unset reads as ""), after strip() and lower().
SWITCH_ON = frozenset({"1", "true", "yes", "on"})
SWITCH_OFF = frozenset({"", "0", "false", "no", "off"})


def switch_value(raw: str | None) -> bool | None:
    """``raw`` (a variable's value, None when unset) as on / off, or None when it is
    neither: the caller refuses it, naming its variable (a typo must not silently mean off)."""
    value = (raw or "").strip().lower()
    if value in SWITCH_ON:
        return True
    if value in SWITCH_OFF:
        return False
    return None
