"""Random programs of public allocator operations, and one interpreter that carries them out
in lockstep on two allocators: one on the compiled kernels, one on the pure-Python code
(``KVSPEC_PURE_PYTHON=1``'s path, turned on per call in this same process).

After every operation the two must agree on every answer (results, block ids, the type of
an exception), on usage, on each running request's block table and computed tokens, and on
``check_invariants``. Two checks need no second side: a prefix hit must be backed by
tokens some earlier request of the same tenant really had (else it is a false hit), and a
prefix the allocator did not hand out for this request (edited or forged) must never be
accepted.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import torch
from fuzz_hostile import (
    HOOK_ACTIONS,
    ID_KINDS,
    SALT_KINDS,
    TOKEN_KINDS,
    IndexToken,
    IntSub,
    build_id,
    build_request,
    build_tokens,
)

from kvspec_core import PluginManager, SizingContext
from kvspec_core.runtime import (
    Allocated,
    CachedPrefix,
    KVCacheAllocator,
    NotNow,
    OffloadTier,
    Request,
    TieredPrefix,
    Transfer,
)
from kvspec_core.runtime import (
    native as native_switch,
)
from kvspec_core.runtime.pool import EVICTION_POLICIES
from kvspec_core.runtime.tier_victims import store_victims as tier_store_victims
from kvspec_core.specs.base import KVSpec

# The runtime tests' spec builders (small full / sliding / chunked / Mamba specs).
_RUNTIME_TESTS = str(Path(__file__).resolve().parent.parent / "runtime")
if _RUNTIME_TESTS not in sys.path:
    sys.path.append(_RUNTIME_TESTS)

from runtime_testkit import chunked as _chunked  # noqa: E402
from runtime_testkit import full as _full  # noqa: E402
from runtime_testkit import mamba as _mamba  # noqa: E402
from runtime_testkit import sliding as _sliding  # noqa: E402

Op = dict[str, Any]

#: Bad counts for ``num_new_tokens`` / ``lookahead`` / ``num_valid_tokens``.
BAD_COUNTS: dict[str, Any] = {
    "negative": -1,
    "bool": True,
    "float": 1.5,
    "none": None,
    "huge": 2**70,
    "int_sub": IntSub(2),
}
#: Ways to edit a prefix the allocator handed out (issue 18 item 3), and "other": one
#: handed out for another request.
FORGERIES = (
    "negative",
    "others_blocks",
    "more_tokens",
    "past_prompt",
    "out_of_range",
    "nulls",
    "not_prefix",
    "wrong_groups",
    "strings",
    "request_id",
    "epochs",
    "bools",
    "other",
)
#: Edits of a :class:`TieredPrefix`'s tier loads (allocators with offload tiers): another
#: slot, a tier that does not exist, a position the group's table holds already, a load
#: dropped (its null entry then claims nothing), and the tiers' epochs (a staleness hint,
#: like ``epochs``: the allocator may only look again).
TIER_FORGERIES = ("tier_slot", "tier_number", "load_position", "load_dropped", "tier_epochs")
#: Bad ``transfer_ids`` entries for ``complete_transfers``.
#: Hostile inputs of a direct store of victims into a tier (``store_victims``): containers
#: of other types, a hash that is no exact bytes, a source that is no exact int, lists of
#: different lengths, a bad transfer id (all refused alike, nothing changed); and, in the
#: configurations whose sides are not compared, a key of the tier's cache colliding with
#: the victims whose ``__eq__`` empties the victim lists, replaces one of the pool's
#: containers by a copy or another type, empties its cache, or raises.
STORE_HOSTILE = (
    "in_flight_list",
    "hashes_tuple",
    "out_tuple",
    "hash_str",
    "hash_bytes_sub",
    "source_bool",
    "source_int_sub",
    "length",
    "transfer_bool",
    "key_clear",
    "key_ref_counts",
    "key_caches",
    "key_evictable",
    "key_fresh",
    "key_retype",
    "key_reset",
    "key_raise",
)
BAD_TRANSFER_IDS = ("unknown", "twice", "bool", "str", "int_sub", "negative")


# ----------------------------------------------------------------- allocators
def manager() -> PluginManager:
    """A fresh manager with every family the configurations use."""
    from kvspec_chunked_local import plugin as chunked_plugin
    from kvspec_mamba import plugin as mamba_plugin
    from kvspec_mla import plugin as mla_plugin
    from kvspec_sliding_window import plugin as sliding_plugin

    plugins = PluginManager()
    plugins.register(sliding_plugin, "sliding_window")
    plugins.register(chunked_plugin, "chunked_local")
    plugins.register(mamba_plugin, "mamba")
    plugins.register(mla_plugin, "mla")
    return plugins


def _mla(block: int, window: int | None = None) -> KVSpec:
    from kvspec_mla import MLAAttentionSpec, SlidingWindowMLASpec

    fields: dict[str, Any] = dict(
        block_size=block, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1
    )
    if window is None:
        return MLAAttentionSpec(**fields)
    return SlidingWindowMLASpec(sliding_window=window, **fields)


#: name -> (specs, blocks per pool, pool of each group or None, allocator options).
CONFIGS: dict[str, Callable[[], tuple[list[KVSpec], Any, list[int] | None, dict[str, Any]]]] = {
    "full": lambda: ([_full(4)], 40, None, {}),
    "full-coarse": lambda: ([_full(8)], 24, None, {"hash_block_size": 4}),
    "sliding": lambda: ([_sliding(4, 8), _full(4)], 64, None, {}),
    "mamba": lambda: ([_mamba(4), _full(4)], 64, None, {}),
    "chunked": lambda: ([_chunked(4, 8), _full(4)], 64, None, {}),
    "mla": lambda: ([_mla(4), _mla(4, window=8)], 64, None, {}),
    "two-pools": lambda: ([_full(4), _sliding(4, 8)], [36, 36], [0, 1], {}),
    "two-pools-mamba": lambda: ([_full(4), _mamba(4)], [36, 20], [0, 1], {}),
    # Offload tiers, small so that evictions and demotions are frequent.
    "full-tiers": lambda: ([_full(4)], 16, None, {"offload_tiers": (OffloadTier("host", 12),)}),
    "full-tiers-disk": lambda: (
        [_full(4)],
        16,
        None,
        {
            "offload_tiers": (
                OffloadTier("host", 6, "segmented", "write_through"),
                OffloadTier("disk", 12),
            )
        },
    ),
    "sliding-tiers": lambda: (
        [_sliding(4, 8), _full(4)],
        28,
        None,
        {
            "offload_tiers": (
                OffloadTier("host", 12, keep="family_rules"),
                OffloadTier("disk", 10, "segmented"),
            )
        },
    ),
    "two-pools-tiers": lambda: (
        [_full(4), _sliding(4, 8)],
        [16, 16],
        [0, 1],
        {"offload_tiers": (OffloadTier("host", (12, 8), write_policy="write_through"),)},
    ),
    # As full-tiers-disk, with an eviction hook that replaces the pool's containers by
    # copies (same content) after the tiers' own hook ran: what the kernels read across the
    # hook's call must be held, not borrowed from the pool.
    "tiers-hostile-hook": lambda: (
        [_full(4)],
        20,
        None,
        {"offload_tiers": (OffloadTier("host", 4), OffloadTier("disk", 5, "segmented"))},
    ),
}
#: The groups of each tiered configuration whose every hit block is needed (full
#: attention): an edited load there must be refused (a window group may skip a load).
FULL_GROUPS: dict[str, tuple[int, ...]] = {
    "full-tiers": (0,),
    "full-tiers-disk": (0,),
    "sliding-tiers": (1,),
    "two-pools-tiers": (0,),
    "tiers-hostile-hook": (0,),
}


def build_allocator(config: str, eviction: str, events: bool) -> KVCacheAllocator:
    specs, blocks, pools, options = CONFIGS[config]()
    ctx = SizingContext(max_model_len=64, max_in_flight_tokens=16, mamba_cache_mode="align")
    allocator = KVCacheAllocator(
        specs,
        blocks,
        ctx,
        pool_of_group=pools,
        manager=manager(),
        hash_salt=b"fuzz",
        eviction=eviction,
        enable_kv_events=events,
        **options,
    )
    if config in CRASH_ONLY_CONFIGS:
        tiers = allocator._tiers
        tier_pools = [pool for row in tiers.tier_pools for pool in row] if tiers else []
        for pool in [*allocator.pools, *tier_pools]:
            if pool is not None:
                _hostile_eviction_hook(pool, allocator)
    return allocator


#: Configurations whose allocators are tampered with through private API (a hostile
#: eviction hook): the pure-Python code, the reference, does not promise sensible answers
#: then, so the sides are not compared; the kernels must only not crash (any Python
#: exception is fine).
CRASH_ONLY_CONFIGS = frozenset({"tiers-hostile-hook"})
#: What the hostile eviction hook does, call after call, after the tiers' hook ran: replace
#: one of the pool's containers the kernels read (``pool_access.c``) by a copy (the old one
#: freed), empty the pool's prefix cache, free a running request (maybe the one the kernel
#: is allocating for), take the transfers, raise, or retype a container (:data:`_RETYPED`).
_HOOK_ACTIONS = (
    "ref_counts",
    "_evictable",
    "caches",
    "_block_hash",
    "_fresh",
    "_protected",
    "_reused",
    "reset",
    "free",
    "take",
    "raise",
    "retype",
)
#: ``retype``: a container of the pool replaced by one of another type with the same
#: entries (each in turn), put back at the hook's next call.
_RETYPED = (
    ("ref_counts", tuple),
    ("_block_hash", tuple),
    ("_fresh", list),
    ("_evictable", dict),
    ("caches", lambda old: tuple(old.items())),
    ("_reused", bytes),
)


def _hostile_eviction_hook(pool: Any, allocator: KVCacheAllocator) -> None:
    """Wrap ``pool``'s eviction hook (the tiers': a device pool's, or a tier pool's that
    demotes to the tier below) with one that then mutates the pool or the allocator
    (one of :data:`_HOOK_ACTIONS` per call)."""
    import copy

    inner = pool._on_evict
    if inner is None:  # the last tier's pools: their evictions drop, no hook to call
        return
    calls = [0]
    retyped: list[tuple[str, Any]] = []

    def hook(groups: list[int], hashes: list[bytes], blocks: list[int]) -> None:
        while retyped:
            name, old = retyped.pop()
            setattr(pool, name, old)
        inner(groups, hashes, blocks)
        # Chosen by the call count and the victims (varied, and the same in a replay).
        choice = calls[0] + sum(blocks) + len(hashes)
        action = _HOOK_ACTIONS[choice % len(_HOOK_ACTIONS)]
        calls[0] += 1
        if action == "retype":
            name, kind = _RETYPED[choice % len(_RETYPED)]
            old = getattr(pool, name)
            retyped.append((name, old))
            setattr(pool, name, kind(old))
        elif action == "reset":
            pool.reset_prefix_cache(record_event=False)
        elif action == "free":
            running = list(allocator._running)
            if running:
                allocator.free(running[-1])
        elif action == "take":
            allocator.take_transfers()
        elif action == "raise":
            raise RuntimeError("hostile eviction hook")
        else:
            old = getattr(pool, action)
            setattr(pool, action, dict(old) if action == "caches" else copy.copy(old))

    pool._on_evict = hook


_taking_kernels: tuple[int, list[Any]] = (-1, [])


def _modules_taking_kernels(kernels: Any) -> list[Any]:
    """Every kvspec module that took the compiled module (``from
    kvspec_core.runtime.native import native``); looked up again when modules were added."""
    global _taking_kernels
    if _taking_kernels[0] != len(sys.modules):
        modules = [
            module
            for name, module in list(sys.modules.items())
            if name.startswith("kvspec") and getattr(module, "native", None) is kernels
        ]
        _taking_kernels = (len(sys.modules), modules)
    return _taking_kernels[1]


@contextlib.contextmanager
def kernels_off() -> Iterator[None]:
    """The pure-Python code for the duration: every module that took the compiled module
    sees ``None``, as under ``KVSPEC_PURE_PYTHON=1``."""
    kernels = native_switch.native
    patched = _modules_taking_kernels(kernels) if kernels is not None else []
    for module in patched:
        module.native = None
    try:
        yield
    finally:
        for module in patched:
            module.native = kernels


# ----------------------------------------------------------------- random programs
class Generator:
    """Random operations over a few shared token stems (so prefixes hit)."""

    def __init__(self, rng: random.Random, tiered: bool = False) -> None:
        self.rng = rng
        #: Offload tiers: transfers taken and completed, and tier loads forged too (the
        #: other configurations' programs stay what they were for a seed).
        self.tiered = tiered
        self.next_id = 0
        self.stems = [[rng.randrange(50_000) for _ in range(40)] for _ in range(3)]

    def program(self, length: int) -> list[Op]:
        kinds = (
            ["admit"] * 30
            + ["grow"] * 18
            + ["step"] * 8
            + ["decode"] * 12
            + ["free"] * 10
            + ["discard"] * 4
            + ["find"] * 7
            + ["reset"] * 2
            + ["events"] * 3
            + ["query"] * 6
        )
        if self.tiered:
            kinds += ["take"] * 14 + ["complete"] * 12 + ["free"] * 8 + ["find"] * 4
            kinds += ["store"] * 6
        return [getattr(self, self.rng.choice(kinds))() for _ in range(length)]

    def _hostile(self, share: float = 0.3) -> bool:
        return self.rng.random() < share

    def token(self) -> Any:
        if self._hostile(0.08):
            return ["h", self.rng.choice(TOKEN_KINDS)]
        return self.rng.randrange(50_000)

    def tokens(self) -> list[Any]:
        rng = self.rng
        # With tiers, mostly long stem prefixes: a tier hit needs a prefix's first blocks.
        cut = (
            rng.randrange(0, 41) if not self.tiered or rng.random() < 0.3 else rng.randrange(24, 41)
        )
        stem = rng.choice(self.stems)[:cut]
        tokens: list[Any] = stem + [rng.randrange(50_000) for _ in range(rng.randrange(0, 21))]
        if rng.random() < 0.05:
            # Past max_model_len (64), and now and then a long prompt (lookups of any length).
            tokens += [rng.randrange(50_000) for _ in range(rng.choice((30, 40, 300)))]
        if tokens and self._hostile(0.12):
            tokens[rng.randrange(len(tokens))] = ["h", rng.choice(TOKEN_KINDS)]
        return tokens or [rng.randrange(50_000)]

    def hook(self, *triggers: str) -> list[Any]:
        """A hook spec, weighted towards what frees an object a kernel may be reading."""
        rng = self.rng
        action = rng.choice(
            (
                "tokens",
                "tokens",
                "tokens",
                "hashes",
                "hashes",
                "id",
                "id",
                "clear",
                "clear",
                "raise",
                "none",
            )
        )
        assert set(HOOK_ACTIONS) >= {action}
        return [
            "hook",
            rng.choice(triggers),
            action,
            rng.choice(("first", "first", "first", "second", "second", "always")),
        ]

    def request_id(self) -> list[Any]:
        rng = self.rng
        self.next_id += 1
        if self._hostile(0.04):
            return ["dup", rng.randrange(8)]
        if not self._hostile(0.05 if self.tiered else 0.15):
            return ["str", f"r{self.next_id}"] if rng.random() < 0.7 else ["int", self.next_id]
        if rng.random() < 0.5:
            return [*self.hook("hash", "hash", "eq"), rng.random() < 0.5]
        kind = rng.choice([kind for kind in ID_KINDS if kind != "hook"])
        return [kind, f"r{self.next_id}" if kind in ("bytes", "str_sub", "list") else self.next_id]

    def salt(self) -> list[Any] | None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.6 or (self.tiered and rng.random() < 0.6):
            return None
        if roll < 0.75:
            return ["str", rng.choice("ab")]
        if roll < 0.82:
            return ["bytes", rng.choice("ab")]
        if rng.random() < 0.6:
            return self.hook("hash", "hash", "eq")
        kind = rng.choice([kind for kind in SALT_KINDS if kind != "hook"])
        return [kind, rng.choice("ab") if kind != "int" else 7]

    def request(self) -> dict[str, Any]:
        roll = self.rng.random()
        lora: Any = None if roll < 0.9 else "l1" if roll < 0.98 else ["bytes", "x"]
        return {
            "rid": self.request_id(),
            "tokens": self.tokens(),
            "salt": self.salt(),
            "lora": lora,
        }

    def count(self, usual: Any) -> Any:
        if self._hostile(0.05):
            return ["bad", self.rng.choice(sorted(BAD_COUNTS))]
        return usual

    def lookahead(self) -> Any:
        if self._hostile(0.03):
            return ["bad", self.rng.choice(sorted(BAD_COUNTS))]
        return self.rng.choice((0, 0, 0, 1, 2))

    def target(self) -> Any:
        rng = self.rng
        if self._hostile(0.08):
            return ["freed", rng.randrange(4)] if rng.random() < 0.5 else ["id", self.request_id()]
        return rng.randrange(8)

    def admit(self) -> Op:
        rng = self.rng
        prefix: Any = rng.choice(("find", "find", "find", "none"))
        if self._hostile(0.12):
            prefix = ["forge", rng.choice(FORGERIES)]
        elif self.tiered and self._hostile(0.3):
            prefix = ["forge", rng.choice(TIER_FORGERIES)]
        count: Any = rng.choice(("rest", "rest", rng.randrange(1, 17)))
        return {
            "op": "admit",
            "request": self.request(),
            "prefix": prefix,
            "count": self.count(count),
            "lookahead": self.lookahead(),
        }

    def grow(self) -> Op:
        rng = self.rng
        append = [self.token() for _ in range(rng.choice((0, 1, 1, 1, 3, 8)))]
        return {
            "op": "grow",
            "target": self.target(),
            "append": append,
            "count": self.count(rng.choice(("pending", "pending", 1, rng.randrange(0, 9)))),
            "lookahead": self.lookahead(),
        }

    def step(self) -> Op:
        rng = self.rng
        items: list[Any] = []
        for _ in range(rng.randrange(1, 5)):
            roll = rng.random()
            items.append(
                [rng.randrange(8)]
                if roll < 0.4
                else ["junk"]
                if roll < 0.45
                else [rng.randrange(8), self.count(rng.randrange(0, 6))]
            )
        return {"op": "step", "items": items, "lookahead": self.lookahead()}

    def decode(self) -> Op:
        rng = self.rng
        targets = [self.target() for _ in range(rng.randrange(1, 4))]
        tokens = [self.token() for _ in targets]
        if self._hostile(0.04):
            tokens.append(1)
        return {"op": "decode", "targets": targets, "tokens": tokens, "lookahead": self.lookahead()}

    def free(self) -> Op:
        return {"op": "free", "target": self.target()}

    def discard(self) -> Op:
        valid: Any = self.rng.choice(("computed", "half", "zero"))
        return {"op": "discard", "target": self.target(), "valid": self.count(valid)}

    def find(self) -> Op:
        return {"op": "find", "request": self.request()}

    def reset(self) -> Op:
        return {"op": "reset"}

    def events(self) -> Op:
        return {"op": "events"}

    def query(self) -> Op:
        return {"op": "query", "target": self.target()}

    def take(self) -> Op:
        return {"op": "take"}

    def store(self) -> Op:
        """A batch of victims stored into the last tier (its pools have no tier below: the
        compiled side stores a one-group pool's batch with ``native.store_victims``):
        hashes the tier caches, copies in flight to it, repeats and new hashes, more of
        them than it has free slots now and then; now and then a hostile input
        (:data:`STORE_HOSTILE`)."""
        rng = self.rng
        kinds = ("cached", "flying", "repeat", "new")
        victims = [
            [rng.choice(kinds), rng.randrange(1_000)] for _ in range(rng.choice((1, 3, 8, 20)))
        ]
        sources = [rng.randrange(1, 16) for _ in victims]
        hostile = rng.choice(STORE_HOSTILE) if self._hostile(0.3) else None
        return {
            "op": "store",
            "pool": rng.randrange(2),
            "victims": victims,
            "sources": sources,
            "hostile": hostile,
        }

    def complete(self) -> Op:
        """Complete some of the pending transfers (by their place in the pending list, any
        order), confirmed or failed; now and then with a bad id among them."""
        rng = self.rng
        picks: Any = (
            "all"
            if rng.random() < 0.5
            else [rng.randrange(8) for _ in range(rng.choice((1, 2, 3)))]
        )
        ids: Any = ["bad", rng.choice(BAD_TRANSFER_IDS)] if self._hostile(0.06) else None
        return {"op": "complete", "picks": picks, "ok": rng.random() < 0.75, "ids": ids}


# ----------------------------------------------------------------- one side
def show(value: Any) -> str:
    """A comparable text of an answer (a hostile id inside a prefix is left out: each side
    has its own object)."""
    if isinstance(value, BaseException):
        return f"raise {type(value).__name__}"
    if isinstance(value, TieredPrefix):
        return (
            f"tiered {value.num_tokens} {value.block_ids} {value.epochs} "
            f"{value.checkpoint_at} loads={value.loads} by_tier={value.tokens_by_tier} "
            f"tier_epochs={value.tier_epochs}"
        )
    if isinstance(value, Transfer):
        return (
            f"transfer {value.transfer_id} {value.kind} g{value.group} p{value.pool} "
            f"{value.source_tier}->{value.destination_tier} {value.source_blocks}->"
            f"{value.destination_blocks} for {_request_name(value.request_id)} "
            f"hashes={len(value.block_hashes)}"
        )
    if isinstance(value, CachedPrefix):
        return f"prefix {value.num_tokens} {value.block_ids} {value.epochs} {value.checkpoint_at}"
    if isinstance(value, Allocated):
        return f"allocated {value.new_block_ids}"
    if isinstance(value, NotNow):
        return (
            f"notnow {value.reason} group={value.group} needed={value.blocks_needed} "
            f"free={value.blocks_free}"
        )
    if isinstance(value, list):
        return "[" + ", ".join(show(item) for item in value) + "]"
    return repr(value)


def _request_name(rid: Any) -> str:
    """A request id as both sides would print it (a hostile id is each side's own object)."""
    if rid is None or type(rid) in (str, int):
        return repr(rid)
    return type(rid).__name__


def tenant(request: Request) -> tuple[Any, ...]:
    """Who may share cache entries with ``request`` (salts of different types never)."""

    def tagged(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, (bytes, bytearray)):
            return ("bytes", bytes(value))
        if isinstance(value, str):
            return ("str", str(value))
        return ("other", id(value))

    return tagged(request.cache_salt), tagged(request.lora_name)


def content(tokens: list[Any]) -> tuple[Any, ...]:
    """What a block computed from ``tokens`` holds, token by token (a token with no one
    clear value matches nothing)."""
    values: list[Any] = []
    for token in list(tokens):
        if type(token) is int or type(token) is bool or type(token) is IntSub:
            values.append(int(token))
        elif type(token) is IndexToken and token.mode == "ok":
            values.append(token.value)
        else:
            values.append(object())
    return tuple(values)


class Side:
    """One allocator, on the kernels or on the pure-Python code, and the requests it runs."""

    def __init__(self, name: str, kernels: bool, config: str, eviction: str, events: bool) -> None:
        self.name = name
        self.kernels = kernels
        self.allocator = self.call(lambda: build_allocator(config, eviction, events))
        self.running: list[Request] = []
        self.freed: list[Any] = []
        #: Transfer ids taken and not yet completed, oldest first.
        self.pending: list[int] = []
        self.config = config
        # (tenant, tokens) of every request the allocator gave slots to: what a cached
        # block can hold.
        self.seen: set[tuple[Any, ...]] = set()
        self.notes: list[str] = []

    def call(self, action: Callable[[], Any]) -> Any:
        if self.kernels:
            return action()
        with kernels_off():
            return action()

    def attempt(self, action: Callable[[], Any]) -> Any:
        """``action()``'s answer, or the exception it raised (as a value)."""
        try:
            return self.call(action)
        except Exception as error:  # every exception is an answer to compare
            return error

    # -- resolving an operation's references to this side's objects
    def pick(self, target: Any) -> Any:
        """The request id an operation's target names, or None (no running request)."""
        if isinstance(target, int):
            return self.running[target % len(self.running)].request_id if self.running else None
        if target[0] == "freed":
            return self.freed[target[1] % len(self.freed)] if self.freed else None
        return build_id(self.resolve_id(target[1]), _NoCell(), self.collide_with())

    def resolve_id(self, spec: list[Any]) -> list[Any]:
        if spec[0] == "dup":
            if not self.running:
                return ["str", "dup-of-nothing"]
            rid = self.running[spec[1] % len(self.running)].request_id
            return ["int", rid] if type(rid) is int else ["str", rid]
        return spec

    def collide_with(self) -> Any:
        return self.running[0].request_id if self.running else "nothing-running"

    def request_of(self, rid: Any) -> Request | None:
        for request in self.running:
            if request.request_id is rid:
                return request
        return None

    # -- operations
    def apply(self, op: Op) -> list[str]:
        kind = op["op"]
        return getattr(self, "op_" + kind)(op)

    def new_request(self, spec: dict[str, Any]) -> Request:
        spec = dict(spec, rid=self.resolve_id(spec["rid"]))
        return build_request(spec, self.collide_with())

    def op_find(self, op: Op) -> list[str]:
        request = self.attempt(lambda: self.new_request(op["request"]))
        if isinstance(request, BaseException):  # Request itself refused the inputs
            return [show(request)]
        found = self.attempt(lambda: self.allocator.find_cached_prefix(request))
        self.check_hit(request, found)
        return [show(found)]

    def op_admit(self, op: Op) -> list[str]:
        allocator = self.allocator
        request = self.attempt(lambda: self.new_request(op["request"]))
        if isinstance(request, BaseException):  # Request itself refused the inputs
            return [show(request)]
        answers: list[str] = []
        prefix: Any = None
        forged = False
        if op["prefix"] != "none":
            found = self.attempt(lambda: allocator.find_cached_prefix(request))
            answers.append(show(found))
            if isinstance(found, BaseException):
                return answers
            self.check_hit(request, found)
            prefix = found
            if isinstance(op["prefix"], list):
                prefix = self.attempt(lambda: self.forge(op["prefix"][1], found, request))
                if isinstance(prefix, BaseException):  # e.g. a block table of a lost id
                    return [*answers, "forging: " + show(prefix)]
                # Epochs are a staleness hint: an edited one may only make the allocator
                # look again. Every other edit claims blocks or tokens it was not given.
                forged = (
                    not _same_prefix(prefix, found)
                    and op["prefix"][1] not in ("epochs", "tier_epochs")
                    and not self.same_content_as_other(op["prefix"][1], request, found)
                )
                answers.append("forged" if forged else "forgery equals the prefix")
        count = self.count(op["count"], request, prefix)
        lookahead = self.count(op["lookahead"], request, prefix)
        result = self.attempt(
            lambda: allocator.allocate_slots(request, count, lookahead, prefix=prefix)
        )
        answers.append(show(result))
        if isinstance(result, Allocated):
            if forged:
                self.notes.append(f"a forged prefix ({op['prefix'][1]}) was accepted")
            if all(request is not running for running in self.running):
                self.running.append(request)
        return answers

    def same_content_as_other(self, how: str, request: Request, genuine: CachedPrefix) -> bool:
        """An ``others_blocks`` table is no forgery when the other request is of the same
        tenant and holds this request's very tokens over the hit: its blocks then hold what
        this request's would (a window group may also hand over a block the admission does
        not use). The allocator may accept it; a real false hit is still caught by
        ``check_hit`` and ``check_invariants``."""
        if how != "others_blocks" or not self.running:
            return False
        other = self.running[0]
        if tenant(other) != tenant(request):
            return False
        claimed = max(genuine.num_tokens, 0)
        try:  # its blocks hold those tokens only once they are computed
            if self.allocator.num_computed_tokens(other.request_id) < claimed:
                return False
        except Exception:
            return False
        mine = content(request.token_ids[:claimed])
        theirs = content(other.token_ids[:claimed])
        return len(mine) == claimed and _common(mine, theirs) == claimed

    def forge(self, how: str, genuine: CachedPrefix, request: Request) -> Any:
        others = [self.allocator.block_ids(r.request_id) for r in self.running[:1]]
        other = others[0] if others else tuple((1, 2) for _ in genuine.block_ids)
        evolve = attrs.evolve
        if how in TIER_FORGERIES:
            return self.forge_loads(how, genuine)
        if how == "negative":
            return evolve(genuine, num_tokens=-16, block_ids=other)
        if how == "others_blocks":
            # A forgery: another request's tables cut to this prefix's lengths (any shape
            # will do, so a table count that differs is not an error here).
            return evolve(
                genuine,
                block_ids=tuple(
                    table[: max(len(mine), 1)]
                    for table, mine in zip(other, genuine.block_ids, strict=False)
                ),
            )
        if how == "more_tokens":
            return evolve(genuine, num_tokens=genuine.num_tokens + 4)
        if how == "past_prompt":
            return evolve(genuine, num_tokens=len(request.token_ids))
        if how == "out_of_range":
            return evolve(
                genuine, block_ids=tuple((10**6,) * len(ids) for ids in genuine.block_ids)
            )
        if how == "nulls":
            return evolve(genuine, block_ids=tuple((0,) * len(ids) for ids in genuine.block_ids))
        if how == "not_prefix":
            return object()
        if how == "wrong_groups":
            return evolve(genuine, block_ids=genuine.block_ids + ((),))
        if how == "strings":
            return evolve(
                genuine, block_ids=tuple(tuple(str(b) for b in ids) for ids in genuine.block_ids)
            )
        if how == "request_id":
            return evolve(genuine, request_id="someone-else")
        if how == "epochs":
            return evolve(genuine, epochs=tuple(epoch + 1 for epoch in genuine.epochs))
        if how == "bools":
            return evolve(genuine, num_tokens=bool(genuine.num_tokens))
        # "other": a genuine lookup, for another request with the same tokens.
        twin = Request(
            "twin-of-" + str(id(request)),
            list(request.token_ids),
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
        )
        return evolve(self.call(lambda: self.allocator.find_cached_prefix(twin)), request_id="twin")

    def forge_loads(self, how: str, genuine: CachedPrefix) -> Any:
        """``genuine`` with the last tier load of each full-attention group edited (the
        prefix itself when it loads nothing there: no edit to make)."""
        if not isinstance(genuine, TieredPrefix):
            return genuine
        if how == "tier_epochs":
            return attrs.evolve(
                genuine, tier_epochs=tuple(tuple(e + 1 for e in row) for row in genuine.tier_epochs)
            )
        full = FULL_GROUPS.get(self.config, ())
        loads = [list(group) for group in genuine.loads]
        block_ids = list(genuine.block_ids)
        edited = False
        for gid, group in enumerate(loads):
            if gid not in full or not group:
                continue
            index, tier, slot = group[-1]
            edited = True
            if how == "tier_slot":
                group[-1] = (index, tier, slot + 1)
            elif how == "tier_number":
                group[-1] = (index, len(genuine.tier_epochs) + 1, slot)
            elif how == "load_position":
                held = [i for i, block in enumerate(block_ids[gid]) if block]
                if not held:
                    edited = False
                    continue
                group[-1] = (held[-1], tier, slot)
            else:  # load_dropped: the null entry stays, nothing loads it
                del group[-1]
        if not edited:
            return genuine
        return attrs.evolve(genuine, loads=tuple(tuple(group) for group in loads))

    def count(self, spec: Any, request: Request, prefix: Any) -> Any:
        if isinstance(spec, int):
            return spec
        if isinstance(spec, list):
            return BAD_COUNTS[spec[1]]
        if spec == "rest":
            hit = prefix.num_tokens if isinstance(prefix, CachedPrefix) else 0
            return max(len(request.token_ids) - hit, 0) if isinstance(hit, int) else 1
        computed = self.attempt(lambda: self.allocator.num_computed_tokens(request.request_id))
        computed = computed if isinstance(computed, int) else 0
        if spec == "pending":
            return max(len(request.token_ids) - computed, 0)
        if spec == "computed":
            return computed
        if spec == "half":
            return computed // 2
        return 0  # "zero"

    def op_grow(self, op: Op) -> list[str]:
        rid = self.pick(op["target"])
        request = self.request_of(rid)
        if request is None:
            return (
                ["skip"]
                if rid is None
                else [show(self.attempt(lambda: self.allocator.num_computed_tokens(rid)))]
            )
        request.token_ids.extend(build_tokens(op["append"]))
        count = self.count(op["count"], request, None)
        lookahead = self.count(op["lookahead"], request, None)
        return [
            show(self.attempt(lambda: self.allocator.allocate_slots(request, count, lookahead)))
        ]

    def op_step(self, op: Op) -> list[str]:
        if not self.running:
            return ["skip"]
        items: list[Any] = []
        for item in op["items"]:
            if item == ["junk"]:
                items.append(("not", "a", "pair"))
                continue
            request = self.running[item[0] % len(self.running)]
            items.append(
                request if len(item) == 1 else (request, self.count(item[1], request, None))
            )
        lookahead = self.count(op["lookahead"], self.running[0], None)
        return [show(self.attempt(lambda: self.allocator.allocate_step(items, lookahead)))]

    def op_decode(self, op: Op) -> list[str]:
        ids = [self.pick(target) for target in op["targets"]]
        if any(rid is None for rid in ids):
            return ["skip"]
        tokens = build_tokens(op["tokens"])
        lookahead = self.count(
            op["lookahead"], self.running[0] if self.running else Request("none", [1]), None
        )
        return [show(self.attempt(lambda: self.allocator.decode_step(ids, tokens, lookahead)))]

    def op_free(self, op: Op) -> list[str]:
        rid = self.pick(op["target"])
        if rid is None:
            return ["skip"]
        answer = self.attempt(lambda: self.allocator.free(rid))
        if not isinstance(answer, BaseException):
            self.forget(rid)
        return [show(answer)]

    def op_discard(self, op: Op) -> list[str]:
        rid = self.pick(op["target"])
        if rid is None:
            return ["skip"]
        request = self.request_of(rid) or Request("none", [1])
        valid = self.count(op["valid"], request, None)
        answer = self.attempt(lambda: self.allocator.discard_uncomputed(rid, valid))
        if not isinstance(answer, BaseException):
            self.forget(rid)
        return [show(answer)]

    def forget(self, rid: Any) -> None:
        self.running = [request for request in self.running if request.request_id is not rid]
        self.freed.append(rid)

    def op_reset(self, op: Op) -> list[str]:
        # What was cached before stays in self.seen: the hit check is an upper bound.
        return [show(self.attempt(self.allocator.reset_prefix_cache))]

    def op_events(self, op: Op) -> list[str]:
        answer = self.attempt(self.allocator.take_events)
        if isinstance(answer, list):
            return [repr(answer)]
        return [show(answer)]

    def op_query(self, op: Op) -> list[str]:
        rid = self.pick(op["target"])
        if rid is None:
            return ["skip"]
        allocator = self.allocator
        return [
            show(self.attempt(lambda: allocator.num_computed_tokens(rid))),
            show(self.attempt(lambda: allocator.block_ids(rid))),
            show(self.attempt(lambda: allocator.is_running(rid))),
        ]

    def op_take(self, op: Op) -> list[str]:
        answer = self.attempt(self.allocator.take_transfers)
        if isinstance(answer, list):
            self.pending += [transfer.transfer_id for transfer in answer]
        return [show(answer)]

    def op_store(self, op: Op) -> list[str]:
        tiers = self.allocator._tiers
        if tiers is None:
            return ["skip"]
        index = len(tiers.tiers) - 1
        pools = [
            (number, pool)
            for number, pool in enumerate(tiers.tier_pools[index])
            if pool is not None and len(pool.caches) == 1
        ]
        if not pools:
            return ["skip"]
        number, pool = pools[op["pool"] % len(pools)]
        (gid,) = pool.caches
        cached = sorted(pool.caches[gid])
        in_flight = tiers._storing[index][gid]
        flying = sorted(in_flight)
        hashes: list[Any] = []
        for kind, pick in op["victims"]:
            if kind == "cached" and cached:
                hashes.append(cached[pick % len(cached)])
            elif kind == "flying" and flying:
                hashes.append(flying[pick % len(flying)])
            elif kind == "repeat" and hashes:
                hashes.append(hashes[pick % len(hashes)])
            else:  # 32 bytes no block hash is (content nothing can hit)
                hashes.append(b"new" + pick.to_bytes(29, "little"))
        sources: list[Any] = list(op["sources"])
        hostile = op["hostile"]
        # Copied from the tier's own slots (source tier = destination): a source no rule
        # reads (a device source would be held by the write-through bookkeeping).
        store = partial(tiers._store, index, number, [gid] * len(hashes), hashes, index + 1)
        if hostile is None:
            return [show(self.attempt(lambda: store(sources))), repr(sorted(in_flight.items()))]
        if hostile.startswith("key_"):
            if self.config not in CRASH_ONLY_CONFIGS:
                return ["skip"]
            # Inserted disarmed (it collides with hashes[0], which the cache may hold:
            # the insert itself compares them), armed for the store only.
            key = _StoreKey(None, pool, hashes, sources, hashes[0])
            pool.caches[gid][key] = 1
            key.action = hostile[4:]
            answer = self.attempt(lambda: store(sources))
            key.action = None
            for cache in list(getattr(pool, "caches", {}).values()):
                with contextlib.suppress(Exception):
                    cache.pop(key, None)
            return [show(answer)]
        compiled = native_switch.native
        kernel = compiled.store_victims if self.kernels and compiled else tier_store_victims
        args: list[Any] = [pool, in_flight, hashes, sources, [], [], [], 10**6]
        if hostile == "in_flight_list":
            args[1] = list(in_flight)
        elif hostile == "hashes_tuple":
            args[2] = tuple(hashes)
        elif hostile == "out_tuple":
            args[4 + op["pool"] % 3] = ()
        elif hostile == "hash_str":
            hashes[-1] = "not bytes"
        elif hostile == "hash_bytes_sub":
            hashes[-1] = _BytesSub(hashes[-1])
        elif hostile == "source_bool":
            sources[-1] = True
        elif hostile == "source_int_sub":
            sources[-1] = IntSub(sources[-1])
        elif hostile == "length":
            sources.append(1)
        elif hostile == "transfer_bool":
            args[7] = True
        return [show(self.attempt(lambda: kernel(*args)))]

    def op_complete(self, op: Op) -> list[str]:
        if not self.pending:
            return ["skip"]
        chosen: list[Any] = []
        for pick in range(len(self.pending)) if op["picks"] == "all" else op["picks"]:
            transfer_id = self.pending[pick % len(self.pending)]
            if transfer_id not in chosen:
                chosen.append(transfer_id)
        if isinstance(op["ids"], list):
            chosen.append(
                {
                    "unknown": 10**9,
                    "twice": chosen[0],
                    "bool": True,
                    "str": str(chosen[0]),
                    "int_sub": IntSub(chosen[0]),
                    "negative": -1,
                }[op["ids"][1]]
            )
        answer = self.attempt(lambda: self.allocator.complete_transfers(chosen, op["ok"]))
        if not isinstance(answer, BaseException):
            done = set(chosen)
            self.pending = [tid for tid in self.pending if tid not in done]
            for rid in answer:  # failed loads' requests were discarded and freed
                self.forget(rid)
            return [f"({', '.join(_request_name(rid) for rid in answer)})"]
        return [show(answer)]

    # -- checks after each operation
    def state(self) -> list[str]:
        """Usage, running requests with their tables, and check_invariants."""
        allocator = self.allocator
        lines = [
            show(self.attempt(lambda: allocator.usage)),
            f"running {self.attempt(lambda: allocator.num_running)}",
        ]
        for request in self.running:
            rid = request.request_id
            block_ids = show(self.attempt(partial(allocator.block_ids, rid)))
            computed = show(self.attempt(partial(allocator.num_computed_tokens, rid)))
            lines.append(f"{block_ids} computed {computed}")
        lines.append("invariants " + show(self.attempt(allocator.check_invariants)))
        return lines

    def record_content(self) -> None:
        for request in self.running:
            self.seen.add((tenant(request), content(request.token_ids)))

    def check_hit(self, request: Request, found: Any) -> None:
        """A hit of ``n`` tokens needs an earlier request of the same tenant whose first
        ``n`` tokens are this request's: blocks hold only what requests computed."""
        if not isinstance(found, CachedPrefix) or not isinstance(found.num_tokens, int):
            return
        mine = content(request.token_ids)
        who = tenant(request)
        backed = max(
            (_common(mine, tokens) for owner, tokens in self.seen if owner == who), default=0
        )
        if found.num_tokens > backed:
            self.notes.append(
                f"false hit: {found.num_tokens} tokens found, at most {backed} of them held "
                "by an earlier request of the same tenant"
            )


class _BytesSub(bytes):
    """A bytes subclass (its own __eq__ / __hash__ could run code: refused)."""


class _StoreKey(bytes):
    """A key of a tier's cache colliding with a victim's hash: its ``__eq__`` (run by the
    lookup of that hash) does ``action`` to the pool or the victim lists, then says no."""

    action: str | None  # None: disarmed (no action)
    pool: Any
    lists: tuple[list[Any], list[Any]]
    collide: bytes

    def __new__(
        cls,
        action: str | None,
        pool: Any,
        hashes: list[Any],
        sources: list[Any],
        collide: bytes,
    ) -> _StoreKey:
        key = super().__new__(cls, b"hostile-store-key")
        key.action, key.pool, key.lists, key.collide = action, pool, (hashes, sources), collide
        return key

    def __hash__(self) -> int:
        return hash(self.collide)

    def __eq__(self, other: object) -> bool:
        import copy

        pool, action = self.pool, self.action
        if action is None:
            return False
        if action == "clear":
            for victims in self.lists:
                victims.clear()
        elif action == "retype":
            pool.ref_counts = tuple(pool.ref_counts)
        elif action == "reset":
            pool.reset_prefix_cache(record_event=False)
        elif action == "raise":
            raise RuntimeError("hostile cache key")
        else:
            name = {"ref_counts": "ref_counts", "caches": "caches"}.get(action, "_" + action)
            old = getattr(pool, name)
            setattr(pool, name, dict(old) if name == "caches" else copy.copy(old))
        return False


def _same_prefix(first: Any, second: CachedPrefix) -> bool:
    """Field by field, without running a hostile request id's ``__eq__``."""
    return (
        type(first) is type(second)
        and first.request_id is second.request_id
        and all(
            type(getattr(first, name)) is type(getattr(second, name))
            and getattr(first, name) == getattr(second, name)
            for name in ("num_tokens", "block_ids", "epochs", "checkpoint_at")
            + (("loads", "tokens_by_tier", "tier_epochs") if type(second) is TieredPrefix else ())
        )
    )


def _common(first: tuple[Any, ...], second: tuple[Any, ...]) -> int:
    count = 0
    for a, b in zip(first, second, strict=False):
        if a is not b and a != b:
            break
        count += 1
    return count


class _NoCell:
    request = None


# ----------------------------------------------------------------- lockstep
@attrs.frozen
class Divergence:
    """The first operation of a program where something went wrong."""

    index: int
    key: str
    detail: str


def make_sides(config: str, eviction: str, events: bool) -> tuple[Side, Side]:
    """The compiled-kernel side and the pure-Python side of one configuration."""
    if native_switch.native is None:
        raise RuntimeError("kvspec_core.runtime._native is not built: nothing to compare")
    return (
        Side("kernels", True, config, eviction, events),
        Side("python", False, config, eviction, events),
    )


SideFactory = Callable[[str, str, bool], tuple[Side, Side]]


def run_program(
    setup: dict[str, Any],
    ops: list[Op],
    progress: Callable[[int], None] = lambda index: None,
    sides: SideFactory = make_sides,
) -> tuple[int, Divergence | None]:
    """Carry ``ops`` out on both sides of ``setup`` (config, eviction, events); the number
    of operations done and the first divergence (or other finding), if any."""
    from fuzz_hostile import features

    first, second = sides(setup["config"], setup["eviction"], setup["events"])
    crash_only = setup["config"] in CRASH_ONLY_CONFIGS
    for index, op in enumerate(ops):
        progress(index)
        answers = [first.apply(op), second.apply(op)]
        states = [first.state(), second.state()]
        if crash_only:
            continue
        tags = ",".join(features(op))
        where = f"{op['op']}[{tags}]" if tags else op["op"]
        if answers[0] != answers[1]:
            summary = " / ".join(
                f"{side.name} {_kinds(answer)}"
                for side, answer in zip((first, second), answers, strict=True)
            )
            return index + 1, Divergence(
                index,
                f"answers differ: {where}: {summary}",
                f"kernels: {answers[0]}\npython:  {answers[1]}",
            )
        if states[0] != states[1]:
            differing = [f"{a} != {b}" for a, b in zip(*states, strict=False) if a != b] or [
                f"{len(states[0])} != {len(states[1])} lines"
            ]
            field = differing[0].split(" ")[0].split("(")[0]
            return index + 1, Divergence(
                index,
                f"state differs after {where}: {field}",
                "\n".join(differing[:4] + _invariant_errors((first, second))),
            )
        for side in (first, second):
            if side.notes:
                note = side.notes[0]
                return index + 1, Divergence(
                    index, f"{note.split(':')[0]} ({side.name}) at {where}", note
                )
        broken = [line for line in states[0] if line.startswith("invariants raise")]
        if broken:
            return index + 1, Divergence(index, f"check_invariants fails after {where}", broken[0])
        for side in (first, second):
            side.record_content()
    return len(ops), None


def _invariant_errors(sides: tuple[Side, Side]) -> list[str]:
    """What check_invariants says on each side where it fails (for the report)."""
    errors = []
    for side in sides:
        failure = side.attempt(side.allocator.check_invariants)
        if isinstance(failure, BaseException):
            errors.append(
                f"{side.name} check_invariants: {type(failure).__name__}: {str(failure)[:300]}"
            )
    return errors


def _kinds(answers: list[str]) -> str:
    """The kinds of a list of answers (without figures): what a finding is keyed by."""
    kinds = []
    for answer in answers:
        words = answer.split(" ")
        if answer.startswith("["):
            kinds.append("list")
            continue
        kinds.append(" ".join(words[:2]) if words[0] in ("raise", "notnow") else words[0])
    return "(" + "; ".join(kinds) + ")"


def random_setup(rng: random.Random, config: str) -> dict[str, Any]:
    return {
        "config": config,
        "eviction": rng.choice(EVICTION_POLICIES),
        "events": rng.random() < 0.3,
    }
