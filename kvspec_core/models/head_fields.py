"""Which config fields hold the head counts and sizes of one side of a model."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class HeadFields:
    """Config field names, in lookup order, for attention heads, KV heads, head size and
    hidden size. They differ between decoder-only configs and the encoder / decoder sides of
    encoder-decoder ones (``encoder_attention_heads``, ``d_model``...)."""

    heads: tuple[str, ...] = ("num_attention_heads", "n_head", "n_heads", "num_heads")
    # vLLM's order (ModelConfig.get_total_num_kv_heads): Falcon's legacy n_head_kv first,
    # ChatGLM's multi_query_group_num last.
    kv_heads: tuple[str, ...] = (
        "n_head_kv",
        "num_kv_heads",
        "num_key_value_heads",
        "multi_query_group_num",
    )
    head_dim: tuple[str, ...] = ("head_dim", "attention_head_dim")
    hidden: tuple[str, ...] = ("hidden_size", "d_model", "n_embd")


#: Fields of a decoder-only model (Llama, Qwen, Mistral, Gemma, Nemotron-H, ...).
DECODER_ONLY_FIELDS = HeadFields()
#: Encoder side of an encoder-decoder model (Whisper, BART; T5's ``num_heads``/``d_kv``).
ENCODER_FIELDS = HeadFields(
    heads=("encoder_attention_heads", "num_heads"),
    kv_heads=("encoder_num_key_value_heads",),
    head_dim=("d_kv", "head_dim"),
    hidden=("d_model", "hidden_size"),
)
#: Decoder side of an encoder-decoder model.
DECODER_FIELDS = HeadFields(
    heads=("decoder_attention_heads", "num_heads"),
    kv_heads=("decoder_num_key_value_heads",),
    head_dim=("d_kv", "head_dim"),
    hidden=("d_model", "hidden_size"),
)
