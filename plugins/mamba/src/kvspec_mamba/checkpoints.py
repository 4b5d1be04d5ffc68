"""Where a prefill may save a reusable Mamba state, and whether a backend can export it.

In ``align`` prefix caching a prefill saves the state at a block boundary so a later request
sharing the prefix can resume there instead of recomputing it.
"""

from __future__ import annotations

from kvspec_core.arithmetic import cdiv
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError


def _int_arg(function: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldTypeError(function, name, value, "expected an int")
    if value < minimum:
        raise InvalidFieldError(function, name, value, f"must be an int >= {minimum}")
    return value


def prefill_checkpoint_position(num_tokens: int, hash_block_size: int,
                                drop_eagle_block: bool) -> int:
    """The reusable checkpoint boundary of a prefill of ``num_tokens`` tokens.

    The last full hash block boundary strictly before the final token (whose state the
    request is still producing); one hash block earlier when an EAGLE draft model shifts its
    input by a block (``drop_eagle_block``); never below 0.
    """
    _int_arg("prefill_checkpoint_position", "num_tokens", num_tokens, 0)
    _int_arg("prefill_checkpoint_position", "hash_block_size", hash_block_size, 1)
    if not isinstance(drop_eagle_block, bool):
        raise InvalidFieldTypeError("prefill_checkpoint_position", "drop_eagle_block",
                                    drop_eagle_block, "expected a bool")
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
