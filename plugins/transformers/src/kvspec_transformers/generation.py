"""What a finished (or, in :attr:`EngineError.partial`, a failed) request produced."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class Generation:
    """One finished request.

    Attributes:
        request_id: the id it ran under.
        prompt_token_ids: the prompt.
        token_ids: the generated tokens (greedy).
        cached_tokens: prompt tokens found in the prefix cache (not recomputed).
        cached_tokens_by_tier: the same tokens by the tier they came from: ``"device"``,
            then the engine's offload tiers (``"host"``, ``"disk"``) if any; a token counts
            for the slowest tier any layer group loaded it from.
        prefill_tokens: prompt tokens the prefill step computed (``len(prompt) - cached``).
        finish_reason: why generation stopped, as vLLM reports it: ``"stop"`` (a stop
            token, the last of ``token_ids``), ``"length"`` (``max_new_tokens`` reached, or
            the sequence reached ``max_model_len``: then fewer tokens than asked), or
            ``"error"`` (only in :attr:`EngineError.partial`).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int] = attrs.field(hash=False)
    prefill_tokens: int
    finish_reason: str
