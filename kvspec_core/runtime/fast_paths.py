"""Wiring the compiled kernels into an allocator: what ``native.SlotsFastPath`` (its
``allocate_slots``) and ``native.find_prefix`` (its ``find_cached_prefix``) are given, and
when they apply (the core's own methods, pools, hasher and rule shapes; any override runs
the Python code). The kernels read nothing of the allocator by name: everything they use
crosses in the tuples built here (see the runtime README, "The C mirror").
"""

from __future__ import annotations

import functools
from typing import Any

from kvspec_core.runtime.hashing import PrefixHasher
from kvspec_core.runtime.native import native
from kvspec_core.runtime.pool import BlockPool
from kvspec_core.runtime.prefix_lookup import PrefixLookup
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.results import CachedPrefix
from kvspec_core.runtime.rules import compiled_shape
from kvspec_core.runtime.stepping import Stepping

#: What an admission runs: a subclass overriding one of them admits through its Python code.
_ADMISSION_METHODS = (
    "_admit",
    "_admit_checked",
    "_check_counts",
    "_check_prefix",
    "_preflight",
    "_cache_new_blocks",
    "_update_limits",
    "_shortfall",
)


class CompiledFastPaths(Stepping, PrefixLookup):
    """Chooses and installs the compiled steps (part of ``KVCacheAllocator``; methods for the
    reasons in ``base.py``: tests ask ``_compiled_group_step`` / ``_compiled_admission``)."""

    def _use_compiled_kernels(self) -> None:
        """Install the compiled ``allocate_slots`` / ``find_cached_prefix`` on this instance
        where they apply (the last step of ``KVCacheAllocator.__init__``)."""
        if native is not None and type(self).allocate_slots is CompiledFastPaths.allocate_slots:
            # Decode steps that need no block are answered without a Python frame, and so
            # are most block-boundary steps of a one-group full-attention allocator; every
            # other call reaches the method (stepping.py).
            dense = self._compiled_dense_step()
            groups = self._compiled_group_step()
            self.allocate_slots = native.SlotsFastPath(  # type: ignore[method-assign]
                self._running,
                self._no_new_blocks,
                self._allocate_slots,
                dense,
                None if dense is not None else groups,
                self._compiled_admission(groups),
            )
            if (
                dense is not None
                and len(self.pools) == 1
                and self._cacheable
                and type(self).find_cached_prefix is CompiledFastPaths.find_cached_prefix
            ):
                # Prefix lookups too (every one the kernel does not answer reaches the method).
                compiled_find = functools.partial(
                    native.find_prefix,
                    (
                        self._running,
                        dense[0],
                        self._hasher,
                        self._caches[0],
                        dense[2],
                        self._handed_out,
                    ),
                    self._find_cached_prefix,
                )
                self.find_cached_prefix = (  # type: ignore[method-assign]
                    compiled_find
                    if self._tiers is None
                    else functools.partial(_find_across_tiers, self, compiled_find)
                )

    def _compiled_dense_step(self) -> tuple[Any, ...] | None:
        """What ``native.SlotsFastPath`` needs to do :meth:`_grow_dense` itself, or None
        where the compiled step does not apply: it serves one full-attention group whose
        block is one hash block, in a pool built with the kernels, with the core's own
        allocator, pool and hasher methods (a subclass's override runs as Python)."""
        pool = self._group_pools[0]
        if not (
            self._single_full
            and type(pool) is BlockPool
            and pool._compiled
            and type(self._hasher) is PrefixHasher
            and type(self)._grow_dense is CompiledFastPaths._grow_dense
        ):
            return None
        return (
            pool,
            self._hasher,
            self._block_tokens[0],
            self.admission_caps[0],
            self.max_model_len,
            self.hash_block_size,
            self._cacheable,
        )

    def _compiled_group_step(self) -> tuple[Any, ...] | None:
        """What ``native.SlotsFastPath`` needs to do :meth:`_grow_checked` itself, or None
        where the compiled step does not apply: it serves allocators recording no events
        whose holding groups' rules all keep the step methods of one of the core's
        parametric shapes (:func:`~kvspec_core.runtime.rules.compiled_shape`), each
        group's block one hash block, in pools built with the kernels, with the core's own
        allocator, pool and hasher methods."""
        methods = (
            "_grow",
            "_grow_checked",
            "_grow_dense",
            "_preflight",
            "_cache_new_blocks",
            "_update_limits",
        )
        if (
            self._events is not None
            or not self._holding
            or type(self._hasher) is not PrefixHasher
            or any(
                getattr(type(self), name) is not getattr(CompiledFastPaths, name)
                for name in methods
            )
        ):
            return None
        groups = []
        for gid in self._holding:
            rules = self.rules[gid]
            pool = self._group_pools[gid]
            shape = compiled_shape(rules)
            retained = getattr(rules, "retained_tokens", 0)
            if (
                shape is None
                or type(pool) is not BlockPool
                or not pool._compiled
                or self._hash_stride[gid] != 1
                or retained.__class__ is not int
                or not 0 <= retained < self.max_model_len + 1
            ):
                return None
            groups.append(
                (
                    gid,
                    shape,
                    self._block_tokens[gid],
                    self.admission_caps[gid],
                    retained,
                    self._is_state_group[gid],
                    pool,
                )
            )
        return (
            self._hasher,
            self.max_model_len,
            self.hash_block_size,
            self._cacheable,
            len(self.specs),
            tuple(groups),
        )

    def _compiled_admission(self, groups: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        """What ``native.SlotsFastPath`` needs to do :meth:`_admit_checked` itself (the
        allocator's freed ids, :class:`CachedPrefix`, its pools, and ``groups``, what
        :meth:`_compiled_group_step` gave), or None where the compiled admission does not
        apply: where the group steps are not compiled, or a subclass changes how
        admissions are made."""
        if groups is None or any(
            getattr(type(self), name) is not getattr(CompiledFastPaths, name)
            for name in _ADMISSION_METHODS
        ):
            return None
        return (self._freed, CachedPrefix, tuple(self.pools), groups, self._handed_out)


def _find_across_tiers(
    allocator: CompiledFastPaths, compiled_find: Any, request: Request
) -> CachedPrefix:
    """The compiled lookup of a one-group full-attention allocator with offload tiers: the
    device's run, unless a tier holds the block after it (then the lookup across tiers,
    in Python). The same answer: the group's hit is the device run continued in the tiers."""
    prefix: CachedPrefix = compiled_find(request)
    tiers = allocator._tiers
    assert tiers is not None
    found = len(prefix.block_ids[0])
    tokens = allocator._block_tokens[0]
    if found < (len(request.token_ids) - 1) // tokens:
        digest = allocator._hasher.hashes(request, (found + 1) * tokens)[found]
        for _, cache in tiers.views[0].tiers:
            if digest in cache:
                return allocator._find_cached_prefix(request)
    return prefix
