"""Tiny random-weight checkpoints written from the real model configs, for vLLM to load.

vLLM's ``load_format="dummy"`` fills weights with values around 1e-3, so its output barely
depends on the context and two KV caches that differ could still give the same tokens. Here
the real ``config.json`` (``/work/shared/model-configs``, or the preset kvspec bundles) is
shrunk to a CPU size that keeps its attention pattern (sliding window, interleaved global
layers, softcapping), transformers builds the model with random weights of a larger spread,
and the weights go to ``model.safetensors`` beside the shrunk ``config.json``.

Head size 32 (the smallest the CPU attention backend takes); windows of 40 tokens, so that
with vLLM's CPU block of 32 tokens a window straddles blocks and prompts of ~100 tokens
leave blocks behind it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvspec_core.models.catalog import load_preset

#: Fields every shrunk config gets (float32 weights and cache: no rounding differences).
COMMON: Mapping[str, Any] = {
    "vocab_size": 512,
    "intermediate_size": 128,
    "torch_dtype": "float32",
    "dtype": "float32",
    "initializer_range": 0.2,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

#: Window of the sliding layers after shrinking (tokens).
WINDOW = 40

#: Per kvspec preset: the fields set on top of :data:`COMMON`.
SHRINK: Mapping[str, Mapping[str, Any]] = {
    "llama-3.1-8b": {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    "mistral-7b": {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": WINDOW,
    },
    "gemma-2-9b": {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": WINDOW,
        # Tied embeddings (vLLM's Gemma 2 always ties) of a wider spread make the model
        # repeat the last prompt token whatever came before; 0.02 keeps context visible.
        "initializer_range": 0.02,
    },
    # Gated delta-net (linear attention) + full attention: 4 layers, the full-attention
    # interval (4) giving 3 linear + 1 full layer; MoE with 4 experts.
    "qwen3-next-80b": {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "initializer_range": 0.02,
    },
    # MLA: the latent stays 512 + 64 wide (576), the only width vLLM's CPU MLA decode
    # kernel takes; layer 0 dense, layer 1 MoE with 4 routed experts, as the real model.
    "deepseek-v2-lite": {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "max_position_embeddings": 1024,
    },
}

_DROPPED = ("quantization_config", "rope_scaling_original", "auto_map")


def shrunk_config(preset: str) -> dict[str, Any]:
    """The real config of ``preset`` with :data:`SHRINK`'s fields (and a layer-type list
    cut to the shrunk depth)."""
    config = {**load_preset(preset), **COMMON, **SHRINK[preset]}
    for field in _DROPPED:
        config.pop(field, None)
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        config["layer_types"] = layer_types[: config["num_hidden_layers"]]
    return config


def write_checkpoint(preset: str, folder: Path, seed: int = 0) -> Path:
    """Write the shrunk ``preset`` with random weights (``torch.manual_seed(seed)``) as a
    safetensors checkpoint into ``folder``; returns ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = shrunk_config(preset)
    model_type = fields.pop("model_type")
    fields.pop("torch_dtype", None)
    hf_config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if not any(folder.glob("*.safetensors")):
        raise RuntimeError(f"transformers wrote no safetensors file into {folder}")
    return folder
