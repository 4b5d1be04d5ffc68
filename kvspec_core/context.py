"""The engine-neutral facts the sizing formulas need, as one small frozen value."""

from __future__ import annotations

import attrs

from kvspec_core.validation import is_bool, non_negative_int, one_of, positive_int

#: Mamba prefix-caching modes: ``none`` keeps only the running state, ``align`` also keeps
#: block-aligned checkpoints so a cached prefix can resume, ``all`` keeps a state per block.
MAMBA_CACHE_MODES = ("none", "align", "all")


@attrs.frozen(kw_only=True)
class SizingContext:
    """Workload limits every sizing formula reads; replaces an engine's config object.

    Attributes:
        max_model_len: longest request (prompt plus output, plus encoder tokens for
            encoder-decoder models) the plan must hold.
        max_in_flight_tokens: tokens scheduled but not yet settled across one engine step
            (the batched-token budget); bounds how far chunked prefill runs ahead of frees.
        dcp_size: decode context parallel world size; DCP-sharded caches hold
            ``1/dcp_size`` of each request's tokens per rank.
        mamba_cache_mode: ``none``, ``align`` or ``all`` (see :data:`MAMBA_CACHE_MODES`).
        max_encoder_tokens: encoder input tokens held by cross-attention layers.
        prefix_caching: whether the runtime caches prefixes (affects Mamba checkpoints).
    """

    max_model_len: int = attrs.field(validator=positive_int)
    max_in_flight_tokens: int = attrs.field(default=16384, validator=positive_int)
    dcp_size: int = attrs.field(default=1, validator=positive_int)
    mamba_cache_mode: str = attrs.field(default="none", validator=one_of(*MAMBA_CACHE_MODES))
    max_encoder_tokens: int = attrs.field(default=0, validator=non_negative_int)
    prefix_caching: bool = attrs.field(default=True, validator=is_bool)
