"""Layer typing of encoder-decoder models (Whisper, BART-style, T5-style configs).

Each decoder layer caches its own tokens in self-attention (``full_attention``) and the
encoder's output in cross-attention (``cross_attention``); encoder layers run in one
bidirectional pass and cache nothing across steps (``encoder_only``). The decoder length is
``max_target_positions`` (else ``max_position_embeddings``); the encoder length cross-attention
holds is ``max_source_positions`` (else ``max_position_embeddings``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvspec_core.models.fields import MAX_LAYERS, optional_int, require_int
from kvspec_core.models.head_fields import DECODER_FIELDS, ENCODER_FIELDS
from kvspec_core.models.layer_typing import (
    CROSS_ATTENTION,
    ENCODER_ONLY,
    FULL_ATTENTION,
    LayerSlot,
)


def is_encoder_decoder(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` describes an encoder-decoder model."""
    if config.get("is_encoder_decoder") is True:
        return True
    return config.get("encoder_layers") is not None and config.get("decoder_layers") is not None


def encoder_decoder_slots(config: Mapping[str, Any]) -> list[LayerSlot]:
    """Encoder layers (``encoder_only``), then per decoder layer its self-attention
    (``full_attention``) and cross-attention (``cross_attention``)."""
    encoder_layers = require_int(
        config,
        "encoder_layers",
        "num_layers",
        needed_for="the encoder's layer count",
        maximum=MAX_LAYERS,
    )
    decoder_layers = require_int(
        config,
        "decoder_layers",
        "num_decoder_layers",
        "num_layers",
        needed_for="the decoder's layer count",
        maximum=MAX_LAYERS,
    )
    slots = [
        LayerSlot(
            index=i,
            name=f"model.encoder.layers.{i}.self_attn",
            layer_type=ENCODER_ONLY,
            head_fields=ENCODER_FIELDS,
        )
        for i in range(encoder_layers)
    ]
    for i in range(decoder_layers):
        prefix = f"model.decoder.layers.{i}"
        slots.append(
            LayerSlot(
                index=i,
                name=f"{prefix}.self_attn",
                layer_type=FULL_ATTENTION,
                head_fields=DECODER_FIELDS,
            )
        )
        slots.append(
            LayerSlot(
                index=i,
                name=f"{prefix}.encoder_attn",
                layer_type=CROSS_ATTENTION,
                head_fields=DECODER_FIELDS,
            )
        )
    return slots


def decoder_max_len(config: Mapping[str, Any]) -> int | None:
    """The longest decoder sequence the config declares, or ``None``."""
    return optional_int(
        config,
        "max_target_positions",
        "max_position_embeddings",
        needed_for="the default max model length",
    )


def encoder_max_len(config: Mapping[str, Any]) -> int | None:
    """The encoder length cross-attention layers hold, or ``None``."""
    return optional_int(
        config,
        "max_source_positions",
        "max_position_embeddings",
        needed_for="the encoder length cross-attention holds",
    )
