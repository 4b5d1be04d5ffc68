"""Where a prefill may save a reusable Mamba state, and whether a backend can export it.

In ``align`` prefix caching a prefill saves the state at a block boundary so a later request
sharing the prefix can resume there instead of recomputing it. :func:`state_columns` and
:func:`prefill_step_ends` tell an engine which block a step reads and writes and where to end
prefill steps, so it does not restate the family's rules.
"""

from __future__ import annotations

import attrs

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import MAMBA_CACHE_MODES
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError


def _int_arg(function: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldTypeError(function, name, value, "expected an int")
    if value < minimum:
        raise InvalidFieldError(function, name, value, f"must be an int >= {minimum}")
    return value


def prefill_checkpoint_position(
    num_tokens: int, hash_block_size: int, drop_eagle_block: bool
) -> int:
    """The reusable checkpoint boundary of a prefill of ``num_tokens`` tokens.

    The last full hash block boundary strictly before the final token (whose state the
    request is still producing); one hash block earlier when an EAGLE draft model shifts its
    input by a block (``drop_eagle_block``); never below 0.
    """
    _int_arg("prefill_checkpoint_position", "num_tokens", num_tokens, 0)
    _int_arg("prefill_checkpoint_position", "hash_block_size", hash_block_size, 1)
    if not isinstance(drop_eagle_block, bool):
        raise InvalidFieldTypeError(
            "prefill_checkpoint_position", "drop_eagle_block", drop_eagle_block, "expected a bool"
        )
    position = (num_tokens - 1) // hash_block_size * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


def is_prefill_checkpoint_valid(
    query_start: int,
    query_end: int,
    checkpoint_position: int,
    hash_block_size: int,
    mamba_block_size: int,
    checkpoint_alignment: int | None,
) -> bool:
    """Whether a backend can export the checkpoint at ``checkpoint_position`` while running
    the query over tokens ``[query_start, query_end)``.

    Never when the backend exports no mid-query checkpoints (``checkpoint_alignment`` is
    ``None``). Otherwise all must hold: the query starts on a hash block boundary; it writes
    a state column past the one it started from; the checkpoint lies at least one hash block
    after the query start and strictly inside the query; and it is a multiple of the
    backend's alignment away from the query start.
    """
    function = "is_prefill_checkpoint_valid"
    _int_arg(function, "query_start", query_start, 0)
    _int_arg(function, "query_end", query_end, query_start)
    _int_arg(function, "checkpoint_position", checkpoint_position, 0)
    _int_arg(function, "hash_block_size", hash_block_size, 1)
    _int_arg(function, "mamba_block_size", mamba_block_size, 1)
    if checkpoint_alignment is None:
        return False
    _int_arg(function, "checkpoint_alignment", checkpoint_alignment, 1)

    initial_state_column = (query_start - 1) // mamba_block_size
    checkpoint_column = cdiv(query_end, mamba_block_size) - 2
    return (
        query_start % hash_block_size == 0
        and checkpoint_column > initial_state_column
        and query_start + hash_block_size <= checkpoint_position
        and query_start < checkpoint_position < query_end
        and (checkpoint_position - query_start) % checkpoint_alignment == 0
    )


@attrs.frozen
class StateColumns:
    """The block-table columns one step of a request uses for a state layer.

    Attributes:
        read: the column holding the state the step starts from; ``None`` when the request
            has computed nothing yet (the step starts from a zero state).
        write: the column the state after the step is stored in. Equal to ``read`` when the
            step stays inside one block (the state is updated in place); otherwise the engine
            copies the state from ``read`` to ``write`` (or reads one and writes the other).
    """

    read: int | None
    write: int


def state_columns(
    num_computed: int, num_new_tokens: int, block_size: int, mamba_cache_mode: str
) -> StateColumns:
    """Which block-table columns a step over tokens ``[num_computed, num_computed +
    num_new_tokens)`` reads its start state from and writes its end state to.

    In ``align`` mode the state after ``n`` tokens lives in column ``(n - 1) // block_size``,
    the block the allocator's rules keep when the request advances and cache when a step
    ends on its boundary; a prefix hit of ``h`` tokens hands that block back in column
    ``h // block_size - 1``, so ``read`` is the hit block. Other modes keep one running
    state, always in column 0. Speculative columns are not covered.
    """
    function = "state_columns"
    _int_arg(function, "num_computed", num_computed, 0)
    _int_arg(function, "num_new_tokens", num_new_tokens, 1)
    _int_arg(function, "block_size", block_size, 1)
    if mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise InvalidFieldError(
            function,
            "mamba_cache_mode",
            mamba_cache_mode,
            f"must be one of {', '.join(MAMBA_CACHE_MODES)}",
        )
    if mamba_cache_mode != "align":
        return StateColumns(read=0 if num_computed else None, write=0)
    read = (num_computed - 1) // block_size if num_computed else None
    return StateColumns(read=read, write=(num_computed + num_new_tokens - 1) // block_size)


def prefill_step_ends(
    num_computed: int, num_tokens: int, block_size: int, checkpoint_at: int | None = None
) -> tuple[int, ...]:
    """Where to end the prefill steps of a prompt of ``num_tokens`` tokens (``num_computed``
    of them already computed, e.g. a prefix hit) so that ``align`` prefix caching saves the
    states later requests resume from, on a backend that exports no mid-query checkpoints
    (``prefill_checkpoint_alignment`` ``None``, e.g. Hugging Face transformers' modules).

    A state is saved only where a step ends on a block boundary, so the steps end at
    ``checkpoint_at`` (:class:`~kvspec_core.runtime.CachedPrefix`'s hint: earlier prompts
    share the content up to there but no state was saved), at the last block boundary
    before the final token (:func:`prefill_checkpoint_position`: the next request sharing
    this prompt resumes there) and at ``num_tokens``. Ascending, each past ``num_computed``.
    """
    function = "prefill_step_ends"
    _int_arg(function, "num_computed", num_computed, 0)
    _int_arg(function, "num_tokens", num_tokens, num_computed + 1)
    _int_arg(function, "block_size", block_size, 1)
    ends = {num_tokens, prefill_checkpoint_position(num_tokens, block_size, False)}
    if checkpoint_at is not None:
        _int_arg(function, "checkpoint_at", checkpoint_at, num_computed + 1)
        if checkpoint_at >= num_tokens or checkpoint_at % block_size:
            raise InvalidFieldError(
                function,
                "checkpoint_at",
                checkpoint_at,
                f"must be a multiple of block_size={block_size} strictly between "
                f"num_computed={num_computed} and num_tokens={num_tokens} (pass the "
                "CachedPrefix.checkpoint_at found for this prompt)",
            )
        ends.add(checkpoint_at)
    return tuple(sorted(end for end in ends if end > num_computed))
