"""Tiny, randomly initialised transformers models built from real Hugging Face configs.

A real config (``/work/shared/model-configs`` style ``config.json``) is *shrunk* for CPU
speed while keeping what makes its architecture distinctive: the layer-type pattern, the
sliding window / attention chunk (shortened so that a few dozen tokens cross them), logit
softcapping, MoE routing, and the MLA latent geometry (``kv_lora_rank + qk_rope_head_dim``
stays 512 + 64 = 576 values per token). See :data:`SHRINK_RULES` and the README.

The shrunk dict is both what kvspec plans (through its own config ingestion, so the specs are
kvspec's, not this bridge's) and what transformers builds the model from, in ``float32``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvspec_core.errors import ConfigError

#: Fields overwritten in every shrunk config (CPU-sized; dtype float32 so kvspec's views and
#: the model agree on the cache dtype).
COMMON_SHRINK: Mapping[str, Any] = {
    "vocab_size": 512,
    "intermediate_size": 128,
    "torch_dtype": "float32",
    "dtype": "float32",
    "tie_word_embeddings": False,
}

#: Per ``model_type``: the fields set on top of :data:`COMMON_SHRINK`.
SHRINK_RULES: Mapping[str, Mapping[str, Any]] = {
    # Llama 3.1: GQA 4:1 kept (8 query heads, 2 KV heads), llama3 rope scaling kept.
    "llama": {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
    # Mistral: every layer sliding, window 4096 -> 24 tokens (block 16: windows straddle blocks).
    "mistral": {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 24,
    },
    # Gemma 2: alternating sliding/full (4 layers), softcapping 50/30 kept, window 4096 -> 24,
    # head_dim and query_pre_attn_scalar shrunk together (scaling stays 1/sqrt(head_dim)).
    "gemma2": {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 24,
        "sliding_window_size": 24,
    },
    # Llama 4 text: 4 layers so the no-rope interval (4) gives 3 chunked + 1 full layer;
    # chunk 8192 -> 32 tokens (two blocks of 16); MoE kept with 4 experts.
    "llama4_text": {
        "num_hidden_layers": 4,
        "hidden_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_chunk_size": 32,
        "intermediate_size_mlp": 128,
        "num_local_experts": 4,
    },
    # DeepSeek-V2-Lite: MLA latent geometry kept exactly (kv_lora_rank 512, rope 64, nope
    # 128, v 128); 2 layers (first dense, second MoE with 8 routed + 1 shared expert).
    "deepseek_v2": {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
    },
    # Qwen3-Next: 4 layers so the full-attention interval (4) gives 3 gated delta-net + 1
    # full-attention layer; value heads twice the key heads (32:16 kept as 4:2), conv kernel
    # 4, gated attention with partial rope (0.25) kept; MoE with 4 experts.
    "qwen3_next": {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    # Bamba-9B: 4 layers, attention at index 2 (attn_layer_indices [9, 18, 27] -> [2]), the
    # rest Mamba-2; heads 128 -> 8 of head dim 16 (expand 2 kept), d_state 128 -> 16, one
    # group, conv kernel 4; SSM chunk 256 -> 16 so prompts span several chunks.
    "bamba": {
        "num_hidden_layers": 4,
        "attn_layer_indices": [2],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attn_rotary_emb": 8,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
    },
    # GPT-OSS-20B: 4 layers alternating sliding / full (layer_types cut to the first 4),
    # window 128 -> 24, attention sinks (one logit per query head) kept, 4 experts (top 2);
    # the checkpoint's mxfp4 quantization_config is dropped (random float32 weights).
    "gpt_oss": {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 24,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
    },
    # Jamba-1.5-Mini: 4 layers, attention at index 2 (period 8 / offset 4 -> 4 / 2), Mamba-1
    # elsewhere, MoE on odd layers (4 experts, top 2); d_state 16 and d_conv 4 kept, expand 2
    # kept (128 channels), dt rank 256 -> 8.
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "mamba_dt_rank": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
}

#: Fields of a real checkpoint's config that a randomly initialised model must not carry
#: (a quantization of weights it does not have; Jamba's ``use_mamba_kernels``, deprecated in
#: transformers 5, where it only warns).
DROPPED_FIELDS = ("quantization_config", "use_mamba_kernels")


def read_config(path: str | Path) -> dict[str, Any]:
    """A ``config.json`` read into a dict (a :class:`ConfigError` names an unreadable file)."""
    try:
        loaded = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read model config {str(path)!r}: {error}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"model config {str(path)!r} is not a JSON object")
    return loaded


def text_config_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language-model part of ``config`` (Llama 4 nests it under ``text_config``)."""
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        return dict(nested)
    return dict(config)


def shrink_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The CPU-sized text config of ``config``: :data:`COMMON_SHRINK` plus its type's rules.

    Refuses a ``model_type`` without shrink rules, naming the known ones.
    """
    text = text_config_of(config)
    model_type = text.get("model_type")
    rules = SHRINK_RULES.get(str(model_type))
    if rules is None:
        raise ConfigError(
            f"no shrink rules for model_type={model_type!r}; "
            f"known: {', '.join(sorted(SHRINK_RULES))}"
        )
    shrunk = {**text, **COMMON_SHRINK, **rules}
    for field in DROPPED_FIELDS:
        shrunk.pop(field, None)
    layer_types = shrunk.get("layer_types")
    if isinstance(layer_types, list):
        # An explicit per-layer list keeps its pattern, cut to the shrunk depth.
        shrunk["layer_types"] = layer_types[: shrunk["num_hidden_layers"]]
    # Token ids of the real tokenizer do not exist in a 512-token vocabulary.
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        shrunk[field] = None
    return shrunk


def build_model(config: Mapping[str, Any], seed: int = 0) -> torch.nn.Module:
    """A causal LM with random weights (``torch.manual_seed(seed)``) built from a shrunk text
    config, in ``float32``, in eval mode, with its default attention implementation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    model_type = fields.pop("model_type")
    # transformers >= 5 reads ``dtype`` and warns on the older ``torch_dtype`` key.
    if "dtype" in fields:
        fields.pop("torch_dtype", None)
    hf_config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.eval()
    return model
