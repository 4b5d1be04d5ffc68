"""Prompt token ids as the engine accepts them: Python, numpy or torch integers.

A tokenizer hands back lists, numpy arrays or torch tensors; all are accepted as long as each
id is an integer (``operator.index``) in ``[0, vocab)``. Bools (``True`` would pass as 1),
floats, strings and bytes (``list(b"ab")`` is a list of ints, but not token ids), batches
(a 2-d ``input_ids``), sets and mappings (no token order: a set's is its hashing's) and
negative or out-of-vocabulary ids are refused, naming the item.

Stop token ids are the same items, in any iterable (a set too: their order does not
matter), or one bare token id (``tokenizer.eos_token_id`` is an int).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Set
from typing import Any

import numpy
import torch

from kvspec_transformers.errors import EngineError


def _is_bool(token: Any) -> bool:
    if isinstance(token, (bool, numpy.bool_)):
        return True
    return isinstance(token, (torch.Tensor, numpy.ndarray)) and token.dtype in (
        torch.bool,
        numpy.dtype(bool),
    )


def _integer_of(value: Any) -> int | None:
    """``value`` as a Python int if it is an integer (Python, numpy or a one-element torch
    integer tensor) and not a bool, else None."""
    if _is_bool(value):
        return None
    try:
        return operator.index(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def token_id_of(token: Any, index: int, vocab: int, field: str = "prompt_token_ids") -> int:
    """``token`` (item ``index`` of ``field``) as a Python int in ``[0, vocab)``."""
    value = _integer_of(token)
    if value is None:
        raise EngineError(
            f"{field}[{index}]={token!r} ({type(token).__name__}{_dtype_of(token)}) must be "
            f"a token id in [0, {vocab}): an integer (Python, numpy or a one-element torch "
            "integer tensor), not a bool or float"
        )
    if not 0 <= value < vocab:
        raise EngineError(
            f"{field}[{index}]={token!r} must be a token id in [0, {vocab}) (the model's "
            "vocab_size)"
        )
    return value


def _dtype_of(token: Any) -> str:
    dtype = getattr(token, "dtype", None)
    return f", dtype {dtype}" if dtype is not None else ""


def prompt_token_ids_of(prompt: Iterable[Any], vocab: int) -> list[int]:
    """The prompt's ids as Python ints; refuses what is not one prompt of token ids."""
    if isinstance(prompt, (str, bytes, bytearray)):
        raise EngineError(
            f"prompt_token_ids is a {type(prompt).__name__}; pass token ids (tokenize the text "
            "first)"
        )
    if isinstance(prompt, (Set, Mapping)):
        # A set would run in its hashing's order, a dict as its keys: a wrong prompt, no error.
        raise EngineError(
            f"prompt_token_ids is a {type(prompt).__name__}, which has no token order; pass "
            "the ids in order (a list, tuple, 1-d array or tensor)"
        )
    shape = getattr(prompt, "shape", None)
    if shape is not None and len(shape) != 1:
        raise EngineError(
            f"prompt_token_ids has shape {tuple(shape)}; pass one prompt's 1-d token ids "
            "(e.g. input_ids[0] of a batch of one)"
        )
    try:
        items = list(prompt)
    except TypeError:
        raise EngineError(f"prompt_token_ids={prompt!r} is not a sequence of token ids") from None
    if not items:
        raise EngineError("prompt_token_ids is empty; give at least one token")
    return [token_id_of(token, index, vocab) for index, token in enumerate(items)]


def max_new_tokens_of(value: Any) -> int:
    """``max_new_tokens`` as a Python int >= 1: an integer (Python, numpy or a one-element
    torch integer tensor), not a bool."""
    count = _integer_of(value)
    if count is None or count < 1:
        raise EngineError(f"max_new_tokens={value!r} must be an int >= 1")
    return count


def stop_token_ids_of(stop_token_ids: Any, vocab: int) -> frozenset[int]:
    """Stop token ids as a set of Python ints: None (none), an iterable of token ids, or
    one token id (an integer, as ``tokenizer.eos_token_id`` is)."""
    if stop_token_ids is None:
        return frozenset()
    single = _integer_of(stop_token_ids)
    if single is not None:
        return frozenset({token_id_of(single, 0, vocab, field="stop_token_ids")})
    if isinstance(stop_token_ids, (str, bytes, bytearray, Mapping)):
        raise EngineError(
            f"stop_token_ids is a {type(stop_token_ids).__name__}; pass token ids (a list or "
            "set of ints), one token id, or None"
        )
    try:
        items = list(stop_token_ids)
    except TypeError:
        raise EngineError(
            f"stop_token_ids={stop_token_ids!r} ({type(stop_token_ids).__name__}) is not token "
            "ids; pass a list or set of ints, one token id, or None"
        ) from None
    field = "stop_token_ids"
    return frozenset(token_id_of(token, index, vocab, field) for index, token in enumerate(items))


def request_id_of(request_id: Any) -> str | None:
    """``request_id``: None (the engine numbers the request) or a non-empty str."""
    if request_id is None or (isinstance(request_id, str) and request_id):
        return request_id
    raise EngineError(
        f"request_id={request_id!r} ({type(request_id).__name__}) must be a non-empty str, or "
        "None for a generated one"
    )
