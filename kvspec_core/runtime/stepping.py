"""The step entry points: ``allocate_slots`` (its no-block fast path inline, else admission
or growth), ``allocate_step`` and ``decode_step`` (a whole engine step in one call).
Compiled twins: ``_native_src/step.c`` (``native.SlotsFastPath``, ``native.step``,
``native.decode_step``); the fast path calls ``_allocate_slots`` for every step it does not
answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.admission import Admission
from kvspec_core.runtime.growth import Growth
from kvspec_core.runtime.hashing import _describe
from kvspec_core.runtime.native import native
from kvspec_core.runtime.request import Request
from kvspec_core.runtime.results import Allocated, CachedPrefix, NotNow
from kvspec_core.runtime.running import _id_error, _is_id, _Running


class Stepping(Admission, Growth):
    """``allocate_slots``, ``allocate_step``, ``decode_step`` (part of
    ``KVCacheAllocator``; methods for the reasons in ``base.py``)."""

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        lookahead: int = 0,
        prefix: CachedPrefix | None = None,
    ) -> Allocated | NotNow:
        """Slots for ``num_new_tokens`` tokens after the computed ones (plus ``lookahead``
        speculative slots); they count as computed once this returns :class:`Allocated`.

        The first call for a request admits it; pass the :class:`CachedPrefix` found for
        it (``num_new_tokens`` then counts tokens after the hit). Returns :class:`NotNow`
        (falsy, nothing changed) when blocks are short, the request would exceed the
        admission cap or ``max_model_len``, or the prefix went stale.
        """
        rid = request.request_id
        if rid.__class__ is not str and rid.__class__ is not int:
            # Other ids could run code in a dict lookup (and NaN is not equal to itself).
            raise AllocatorError(_id_error(rid, "allocate_slots"))
        state = self._running.get(rid)
        if state is None:
            return self._admit(request, num_new_tokens, lookahead, prefix)
        computed = state.computed
        if (
            # Exact ints only (no bool, no float): ``__class__`` is cheaper than ``type()``.
            num_new_tokens.__class__ is int is lookahead.__class__
            and num_new_tokens >= 0
            and lookahead >= 0
            and prefix is None
            and (known := computed + num_new_tokens) + lookahead < state.end_limit
            and known < state.known_limit
            and computed < state.computed_limit
        ):
            state.computed = known
            return self._no_new_blocks
        if prefix is not None:
            raise AllocatorError(
                f"request {request.request_id!r} is already running; a prefix applies only "
                "to its first allocate_slots"
            )
        if (
            self._dense
            and num_new_tokens.__class__ is int is lookahead.__class__
            and num_new_tokens >= 0
            and lookahead >= 0
        ):
            return self._grow_dense(state, num_new_tokens, lookahead)
        return self._grow(state, num_new_tokens, lookahead)

    #: The method itself, also under this name: what an instance's compiled fast path
    #: (``native.SlotsFastPath``, its ``allocate_slots`` when the kernels are built) calls
    #: for every step it does not answer itself.
    _allocate_slots = allocate_slots

    def allocate_step(
        self, steps: Iterable[tuple[Request, int] | Request], lookahead: int = 0
    ) -> list[Allocated | NotNow]:
        """Slots for every request of one engine step: ``steps`` holds ``(request,
        num_new_tokens)`` pairs, e.g. each running request with the tokens scheduled for it;
        a bare :class:`Request` stands for ``(request, 1)`` (a decode step).

        Exactly ``[allocate_slots(request, n, lookahead) for request, n in steps]``, in that
        order (results, block tables, hits and pool state alike), in one call: the steps
        that need no block cost a few integer comparisons each. A request not running yet
        is admitted without a cached prefix (admit with :meth:`allocate_slots` to pass one).
        If a pair raises (a bad count, say), the error propagates as from the loop and the
        pairs before it stay allocated.
        """
        if lookahead.__class__ is not int or lookahead < 0:
            raise AllocatorError(f"allocate_step: lookahead={lookahead!r} must be an int >= 0")
        results: list[Allocated | NotNow] = []
        if native is not None:
            # The same loop compiled; every pair it does not finish goes to _step_pair.
            try:
                native.step(
                    steps,
                    self._running,
                    lookahead,
                    self._no_new_blocks,
                    self.allocate_slots,
                    lambda pair, position: self._step_pair(pair, position, lookahead),
                    results,
                )
            except AllocatorError as error:
                raise _at_item("allocate_step", error, len(results)) from None
            return results
        try:
            return self._step_loop(steps, lookahead, results)
        except AllocatorError as error:
            raise _at_item("allocate_step", error, len(results)) from None

    def _step_loop(
        self,
        steps: Iterable[tuple[Request, int] | Request],
        lookahead: int,
        results: list[Allocated | NotNow],
    ) -> list[Allocated | NotNow]:
        """:meth:`allocate_step`'s loop (``native.step`` in Python)."""
        no_new_blocks = self._no_new_blocks
        append = results.append
        for pair in steps:
            request, num_new_tokens, state = self._step_item(pair, len(results))
            if state is not None and num_new_tokens.__class__ is int and num_new_tokens >= 0:
                # allocate_slots' no-block fast path, inlined.
                computed = state.computed
                known = computed + num_new_tokens
                if (
                    known + lookahead < state.end_limit
                    and known < state.known_limit
                    and computed < state.computed_limit
                ):
                    state.computed = known
                    append(no_new_blocks)
                    continue
            append(self.allocate_slots(request, num_new_tokens, lookahead))
        return results

    def decode_step(
        self, request_ids: Sequence[str | int], token_ids: Sequence[int], lookahead: int = 0
    ) -> list[Allocated | NotNow]:
        """One decode step of running requests, given as an engine's sampler reports it:
        request ``request_ids[i]`` sampled ``token_ids[i]``.

        Exactly ``request.token_ids.append(token); allocate_slots(request, 1, lookahead)``
        for each, in order (results, block tables, hits and pool state alike), in one call:
        the engine's own loop over the step's requests is not needed. Refuses, with
        :class:`AllocatorError`, lists of different lengths and a sampled token that can never
        be hashed (an int outside ``[0, 2**32)``, an object without ``__index__``), before
        anything is done, and an id that names no running request (the requests before it
        were stepped). When ``allocate_slots`` refuses a request's step (a token whose
        ``__index__`` gives a value that cannot be hashed), that token is taken back off its
        list and the error raised, naming the item: the requests before it were stepped, it
        and those after it are as they were.
        """
        if lookahead.__class__ is not int or lookahead < 0:
            raise AllocatorError(f"decode_step: lookahead={lookahead!r} must be an int >= 0")
        # Copies: code the step runs (a token's __index__) cannot change what is stepped.
        ids = tuple(request_ids)
        tokens = tuple(token_ids)
        if len(ids) != len(tokens):
            raise AllocatorError(
                f"decode_step: {len(ids)} request ids but {len(tokens)} tokens; pass the "
                "token each request sampled, in the order of request_ids"
            )
        _check_sampled(ids, tokens)
        results: list[Allocated | NotNow] = []
        try:
            if native is not None:
                stopped = native.decode_step(
                    ids,
                    tokens,
                    self._running,
                    lookahead,
                    self._no_new_blocks,
                    self.allocate_slots,
                    results,
                )
            else:
                stopped = self._decode_loop(ids, tokens, lookahead, results)
        except AllocatorError as error:
            raise _at_item("decode_step", error, len(results), ids) from None
        if stopped >= 0:
            raise AllocatorError(
                f"decode_step: item {stopped}: {self._not_running_message(ids[stopped])}; the "
                f"{stopped} requests before it were stepped"
            )
        return results

    def _decode_loop(
        self,
        ids: Sequence[str | int],
        tokens: Sequence[int],
        lookahead: int,
        results: list[Allocated | NotNow],
    ) -> int:
        """:meth:`decode_step`'s loop (``native.decode_step`` in Python): the position of the
        first id that names no running request, or -1."""
        running = self._running
        append = results.append
        for position, rid in enumerate(ids):
            state = running.get(rid) if rid.__class__ is str or rid.__class__ is int else None
            if state is None:
                return position
            request = state.request
            token = tokens[position]
            token_list = request.token_ids
            token_list.append(token)
            try:
                append(self.allocate_slots(request, 1, lookahead))
            except BaseException:
                if token_list and token_list[-1] is token:  # refused: nothing changes
                    token_list.pop()
                raise
        return -1

    def _step_pair(self, pair: Any, position: int, lookahead: int) -> Allocated | NotNow:
        """``allocate_slots`` for item ``position`` of an :meth:`allocate_step`."""
        request, num_new_tokens, _ = self._step_item(pair, position)
        return self.allocate_slots(request, num_new_tokens, lookahead)

    def _step_item(self, pair: Any, position: int) -> tuple[Request, int, _Running | None]:
        """Item ``position`` of an :meth:`allocate_step` as ``(request, num_new_tokens,
        its running state or None)``; refuses what is not a Request or a pair."""
        try:
            if isinstance(pair, Request):
                request, num_new_tokens = pair, 1
            else:
                request, num_new_tokens = pair
            rid = request.request_id
            # An id of another type is refused by allocate_slots, before any lookup.
            return request, num_new_tokens, self._running.get(rid) if _is_id(rid) else None
        except (TypeError, ValueError, AttributeError):
            raise AllocatorError(
                f"allocate_step: item {position} is {pair!r}, not a Request or a "
                "(Request, int) pair; the items before it were allocated"
            ) from None


def _check_sampled(ids: Sequence[str | int], tokens: Sequence[object]) -> None:
    """Refuse, before any request is stepped, a sampled token that can never be hashed: an
    int outside ``[0, 2**32)`` or an object without ``__index__`` (found by review: such a
    token was appended and refused only once its block filled, steps later, and every later
    step stopped at its request). Another integer type (numpy) is read through
    ``__index__`` when its block is hashed, as a prompt token is."""
    for position, token in enumerate(tokens):
        kind = token.__class__
        if kind is int:
            if 0 <= token < 2**32:  # type: ignore[operator]
                continue
        elif kind is not bool and hasattr(kind, "__index__"):
            continue
        raise AllocatorError(
            f"decode_step: item {position} (request {_describe(ids[position])}): the sampled "
            f"token {_describe(token)} is not an int in [0, 2**32); nothing was stepped"
        )


def _at_item(
    call: str, error: AllocatorError, position: int, ids: Sequence[object] | None = None
) -> AllocatorError:
    """``error`` (refusing item ``position`` of a batched ``call``) naming the item and what
    was done before it; an error of a subclass (a plugin's, a sizing one) as it is."""
    if type(error) is not AllocatorError or str(error).startswith(f"{call}:"):
        return error  # another kind of error, or one naming the item already
    which = f"item {position}" + (
        f" (request {_describe(ids[position])})" if ids is not None and position < len(ids) else ""
    )
    return AllocatorError(f"{call}: {which}: {error}; the {position} items before it were stepped")
