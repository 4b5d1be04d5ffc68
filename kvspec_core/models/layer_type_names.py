"""The layer types the core normalises every layer to (:mod:`kvspec_core.models.layer_typing`),
and the families of types the core treats alike."""

from __future__ import annotations

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"
MLA_ATTENTION = "mla_attention"
SLIDING_MLA_ATTENTION = "sliding_mla_attention"
LINEAR_ATTENTION = "linear_attention"
MAMBA = "mamba"
CROSS_ATTENTION = "cross_attention"
ENCODER_ONLY = "encoder_only"

#: Every layer type the core normalises to.
NORMALISED_LAYER_TYPES = (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    CHUNKED_ATTENTION,
    MLA_ATTENTION,
    SLIDING_MLA_ATTENTION,
    LINEAR_ATTENTION,
    MAMBA,
    CROSS_ATTENTION,
    ENCODER_ONLY,
)
#: Layer types whose cache is a fixed-size recurrent state rather than per-token K/V.
STATE_LAYER_TYPES = frozenset({MAMBA, LINEAR_ATTENTION})
#: Layer types whose geometry is attention heads (the core resolves an AttentionShape).
ATTENTION_LAYER_TYPES = frozenset(
    {
        FULL_ATTENTION,
        SLIDING_ATTENTION,
        CHUNKED_ATTENTION,
        MLA_ATTENTION,
        SLIDING_MLA_ATTENTION,
        CROSS_ATTENTION,
        ENCODER_ONLY,
    }
)
