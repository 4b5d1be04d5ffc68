"""Hostile and careless inputs of the allocator fuzzer, built from plain JSON data.

An operation names its inputs as data (``["nan"]``, ``["hook", "hash", "tokens", "first"]``,
...), so a finding replays from one JSON line; each side of the differential run builds
its own objects from that data (a hostile object changes the one request it belongs to).

Token entries: an ``int``, or ``["h", kind]`` with kind one of :data:`TOKEN_KINDS`.
Request ids: ``["str", s]``, ``["int", n]`` or one of :data:`ID_KINDS` (see :func:`build_id`).
Salts: ``None`` or one of :data:`SALT_KINDS` (see :func:`build_salt`).
"""

from __future__ import annotations

import math
from typing import Any

from kvspec_core.runtime import Request

#: What a hook does when it fires: replace the request's token list, drop its cached
#: hashes, replace its id, empty its token list in place, raise, or nothing.
HOOK_ACTIONS = ("tokens", "hashes", "id", "clear", "raise", "none")
#: When a hook fires: on its first call, its second, or every call.
HOOK_WHEN = ("first", "second", "always")

TOKEN_KINDS = (
    "huge",
    "negative",
    "bool",
    "float",
    "nan",
    "int_sub",
    "index_ok",
    "index_raises",
    "index_mutates",
    "index_clears",
    "str",
    "none",
    "big",
)
ID_KINDS = ("nan", "float", "bool", "bytes", "list", "int_sub", "str_sub", "hook")
SALT_KINDS = ("str", "bytes", "str_sub", "bytearray", "int", "hook")


class Cell:
    """The request a hostile object acts on (set once the request exists)."""

    request: Request | None = None


class Hook:
    """Counts calls and, when due, does ``action`` to the cell's request."""

    def __init__(self, cell: Cell, action: str, when: str) -> None:
        self.cell, self.action, self.when, self.calls = cell, action, when, 0

    def fire(self) -> None:
        self.calls += 1
        due = {"first": self.calls == 1, "second": self.calls == 2, "always": True}[self.when]
        request = self.cell.request
        if not due or request is None:
            return
        if self.action == "tokens":
            request.token_ids = [7] * 3
        elif self.action == "hashes":
            request.block_hashes = []
        elif self.action == "id":
            request.request_id = "replacement"
        elif self.action == "clear":
            request.token_ids.clear()
        elif self.action == "raise":
            raise RuntimeError(f"hook raised on call {self.calls}")


class IntSub(int):
    """An int subclass (a numpy-like integer that really is an int)."""

    def __repr__(self) -> str:
        return f"IntSub({int(self)})"


class StrSub(str):
    def __repr__(self) -> str:
        return f"StrSub({str(self)!r})"


class IndexToken:
    """A token with ``__index__``: returns its value, raises, or rewrites its list first."""

    def __init__(self, value: int, mode: str, tokens: list[Any]) -> None:
        self.value, self.mode, self.tokens = value, mode, tokens

    def __index__(self) -> int:
        if self.mode == "raises":
            raise RuntimeError("token __index__ raised")
        if self.mode == "mutates":
            self.tokens[0:4] = [100, 101, 102, 103]
        elif self.mode == "clears":
            self.tokens.clear()
        return self.value

    def __repr__(self) -> str:
        return f"IndexToken({self.value}, {self.mode!r})"


class HookId:
    """A request id whose ``__hash__`` / ``__eq__`` run a hook; its hash may collide with
    another id's."""

    def __init__(self, hook: Hook, trigger: str, collide_with: object) -> None:
        self.hook, self.trigger, self.collide_with = hook, trigger, collide_with

    def __hash__(self) -> int:
        if self.trigger == "hash":
            self.hook.fire()
        try:
            return hash(self.collide_with)
        except TypeError:
            return 1

    def __eq__(self, other: object) -> bool:
        if self.trigger == "eq":
            self.hook.fire()
        return self is other

    def __repr__(self) -> str:
        return f"HookId({self.trigger}, {self.hook.action}, {self.hook.when})"


class HookSalt(str):
    """A str salt whose ``__hash__`` / ``__eq__`` run a hook."""

    hook: Hook
    trigger: str

    def __hash__(self) -> int:
        if self.trigger == "hash":
            self.hook.fire()
        return str.__hash__(self)

    def __eq__(self, other: object) -> bool:
        if self.trigger == "eq":
            self.hook.fire()
        return str.__eq__(self, other)

    def __repr__(self) -> str:
        return f"HookSalt({str(self)!r}, {self.trigger}, {self.hook.action}, {self.hook.when})"


def build_tokens(spec: list[Any]) -> list[Any]:
    """The token list ``spec`` describes (hostile entries built in place)."""
    tokens: list[Any] = []
    for entry in spec:
        tokens.append(entry if isinstance(entry, int) else build_token(entry, tokens))
    return tokens


def build_token(entry: list[Any], tokens: list[Any]) -> Any:
    kind = entry[1]
    simple = {
        "huge": 2**32,
        "negative": -1,
        "bool": True,
        "float": 1.0,
        "nan": math.nan,
        "str": "7",
        "none": None,
        "big": 2**64 + 3,
    }
    if kind in simple:
        return simple[kind]
    if kind == "int_sub":
        return IntSub(5)
    if kind.startswith("index_"):
        return IndexToken(5, kind.removeprefix("index_"), tokens)
    raise ValueError(f"unknown token kind {kind!r}")


def build_id(spec: list[Any], cell: Cell, collide_with: object) -> Any:
    """The request id ``spec`` describes; hooks act on ``cell``'s request."""
    kind = spec[0]
    if kind in ("str", "int"):
        return spec[1]
    if kind == "nan":
        return math.nan
    if kind == "float":
        return float(spec[1])
    if kind == "bool":
        return True
    if kind == "bytes":
        return str(spec[1]).encode()
    if kind == "list":
        return [spec[1]]
    if kind == "int_sub":
        return IntSub(spec[1])
    if kind == "str_sub":
        return StrSub(spec[1])
    if kind == "hook":
        # ["hook", trigger, action, when, collide]: collide gives it a running id's hash.
        _, trigger, action, when, collide = spec
        return HookId(
            Hook(cell, action, when), trigger, collide_with if collide else "no-collision"
        )
    raise ValueError(f"unknown id kind {kind!r}")


def build_salt(spec: list[Any] | None, cell: Cell) -> Any:
    if spec is None:
        return None
    kind = spec[0]
    if kind == "str":
        return spec[1]
    if kind == "bytes":
        return str(spec[1]).encode()
    if kind == "str_sub":
        return StrSub(spec[1])
    if kind == "bytearray":
        return bytearray(str(spec[1]).encode())
    if kind == "int":
        return int(spec[1])
    if kind == "hook":
        _, trigger, action, when = spec
        salt = HookSalt("tenant")
        salt.hook, salt.trigger = Hook(cell, action, when), trigger
        return salt
    raise ValueError(f"unknown salt kind {kind!r}")


def build_request(spec: dict[str, Any], collide_with: object) -> Request:
    """A fresh request from an admission's spec (``rid``, ``tokens``, ``salt``, ``lora``)."""
    cell = Cell()
    lora = spec.get("lora")
    request = Request(
        build_id(spec["rid"], cell, collide_with),
        build_tokens(spec["tokens"]),
        cache_salt=build_salt(spec.get("salt"), cell),
        lora_name=lora if not isinstance(lora, list) else str(lora[1]).encode(),  # type: ignore[arg-type]
    )
    cell.request = request
    return request


def is_hostile(spec: Any) -> bool:
    """Whether an id / salt / token entry is anything but a plain str, bytes or int."""
    if spec is None or isinstance(spec, int):
        return False
    return spec[0] not in ("str", "int", "bytes")


def features(op: dict[str, Any]) -> list[str]:
    """Tags of the hostile inputs an operation uses (a finding's identity includes them)."""
    tags: set[str] = set()
    request = op.get("request")
    if request:
        if is_hostile(request["rid"]):
            rid = request["rid"]
            tags.add("id:" + ("-".join(rid[:3]) if rid[0] == "hook" else rid[0]))
        salt = request.get("salt")
        if salt is not None and salt[0] != "str":
            tags.add("salt:" + ("-".join(salt[:3]) if salt[0] == "hook" else salt[0]))
        if isinstance(request.get("lora"), list):
            tags.add("lora:bytes")
        for entry in request["tokens"]:
            if not isinstance(entry, int):
                tags.add("token:" + entry[1])
    for entry in op.get("append", []) + op.get("tokens", []):
        if not isinstance(entry, int):
            tags.add("token:" + entry[1])
    if op.get("hostile"):
        tags.add("store:" + op["hostile"])
    for name in ("prefix", "target", "count", "valid", "lookahead", "ids"):
        value = op.get(name)
        if isinstance(value, (list, str)) and value not in ("find", "none", "rest"):
            tags.add(f"{name}:{value[0] if isinstance(value, list) else value}")
    return sorted(tags)


def simplified(op: dict[str, Any]) -> list[dict[str, Any]]:
    """``op`` with one hostile input made plain, for each hostile input it has, and with
    half its prompt (a shrunk finding keeps only the inputs it needs)."""
    import copy

    variants: list[dict[str, Any]] = []

    def variant(change: Any) -> None:
        candidate = copy.deepcopy(op)
        change(candidate)
        if candidate != op:
            variants.append(candidate)

    request = op.get("request")
    if request:
        if is_hostile(request["rid"]):
            variant(lambda o: o["request"].update(rid=["str", "plain"]))
        if request.get("salt") is not None:
            variant(lambda o: o["request"].update(salt=None))
        if request.get("lora") is not None:
            variant(lambda o: o["request"].update(lora=None))
        for position, entry in enumerate(request["tokens"]):
            if not isinstance(entry, int):
                variant(lambda o, p=position: o["request"]["tokens"].__setitem__(p, 1))
        if len(request["tokens"]) > 8:  # a shorter prompt (it may be all the finding needs)
            variant(
                lambda o: o["request"].update(
                    tokens=o["request"]["tokens"][: len(o["request"]["tokens"]) // 2]
                )
            )
    for field in ("append", "tokens"):
        for position, entry in enumerate(op.get(field, [])):
            if not isinstance(entry, int):
                variant(lambda o, f=field, p=position: o[f].__setitem__(p, 1))
    if isinstance(op.get("target"), list):
        variant(lambda o: o.update(target=0))
    if isinstance(op.get("prefix"), list):
        variant(lambda o: o.update(prefix="find"))
    if op.get("hostile"):
        variant(lambda o: o.update(hostile=None))
    for field, plain in (("count", 1), ("lookahead", 0), ("valid", "zero"), ("ids", None)):
        if isinstance(op.get(field), list):
            variant(lambda o, f=field, v=plain: o.update({f: v}))
    return variants
