"""Defaults the published modeling code applies when a config leaves a field out.

Partial configs (trimmed presets, configs written by older tools) omit fields whose default
lives in the model's Hugging Face config class. When transformers is installed
(``kvspec-core[hf]``) its config class fills every such field
(:mod:`kvspec_core.models.normalized`); the list below is what kvspec fills by itself, with
or without it, so the layer typing and the plugins read the values the model really runs with.
Per model_type, each field with its default (the published source in parentheses):

* gemma2: ``sliding_window_pattern`` = 2 (``Gemma2DecoderLayer``: layer i slides when
  ``not i % 2``)
* gemma3, gemma3_text: ``sliding_window_pattern`` = 6, ``max_position_embeddings`` = 131072
  (``Gemma3TextConfig``)
* cohere2: ``sliding_window_pattern`` = 4 (``Cohere2Config``)
* qwen2, qwen2_moe, qwen3, qwen3_moe: ``use_sliding_window`` = false,
  ``max_window_layers`` = 28 (``Qwen2Config`` & co.; ``sliding_window`` unused unless
  switched on)
* jamba: ``attn_layer_period`` = 8, ``attn_layer_offset`` = 4 (``JambaConfig``)
* qwen3_next: ``full_attention_interval`` = 4 (``Qwen3NextConfig``)
* llama4, llama4_text: ``no_rope_layer_interval`` = 4 (``Llama4TextConfig``: every 4th
  layer global NoPE)
* whisper: ``max_source_positions`` = 1500, ``max_target_positions`` = 448
  (``WhisperConfig``)
* gemma3n_text: ``num_kv_shared_layers`` = 15 (``Gemma3nTextConfig``: the last 15 layers
  read an earlier layer's KV cache; read as absent, it would plan a cache for every layer)

Defaults every family shares (applied where the fields are read, not here):
``num_key_value_heads`` = ``num_attention_heads``; ``head_dim`` = ``hidden_size //
num_attention_heads``; the model dtype is bfloat16 when ``torch_dtype``/``dtype`` is absent
(see :data:`kvspec_core.models.fields.DEFAULT_MODEL_DTYPE`); a config with
``attention_chunk_size`` but no global-layer information takes Llama-4's interval of 4.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

_GEMMA3 = MappingProxyType({"sliding_window_pattern": 6, "max_position_embeddings": 131072})
_LLAMA4 = MappingProxyType({"no_rope_layer_interval": 4})
_QWEN = MappingProxyType({"use_sliding_window": False, "max_window_layers": 28})

#: model_type -> field defaults of its published config class.
PUBLISHED_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "gemma2": MappingProxyType({"sliding_window_pattern": 2}),
        "gemma3": _GEMMA3,
        "gemma3_text": _GEMMA3,
        "cohere2": MappingProxyType({"sliding_window_pattern": 4}),
        "qwen2": _QWEN,
        "qwen2_moe": _QWEN,
        "qwen3": _QWEN,
        "qwen3_moe": _QWEN,
        "jamba": MappingProxyType({"attn_layer_period": 8, "attn_layer_offset": 4}),
        "qwen3_next": MappingProxyType({"full_attention_interval": 4}),
        "llama4": _LLAMA4,
        "llama4_text": _LLAMA4,
        "whisper": MappingProxyType({"max_source_positions": 1500, "max_target_positions": 448}),
        "gemma3n_text": MappingProxyType({"num_kv_shared_layers": 15}),
    }
)

#: Interval of global (NoPE, full-attention) layers in a chunked-attention model whose config
#: says nothing else: Llama-4's published default.
DEFAULT_NO_ROPE_LAYER_INTERVAL = 4


def with_published_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` where fields its ``model_type`` defaults are filled in when
    absent (or ``null``); fields the config sets are never changed."""
    filled = dict(config)
    defaults = PUBLISHED_DEFAULTS.get(str(config.get("model_type", "")), {})
    for field, value in defaults.items():
        if filled.get(field) is None:
            filled[field] = value
    return filled
