"""KV-cache dtypes other than the model's: an explicit ``kv_cache_dtype`` stores K/V (or the
MLA latent) rounded to it, and the engine must compute exactly what transformers computes
from K/V rounded the same way; a config dtype that merely disagrees with the model's under
``kv_cache_dtype`` "auto" is refused (it rounded K/V silently).

The reference is transformers' own greedy ``generate`` with a :class:`DynamicCache` that
rounds every K/V (DeepSeek-V2: the latent and the roped key) through the cache dtype on
``update``: the cache contents the engine's views hold, read by transformers' attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from transformers import DynamicCache
from transformers_testkit import NEW_TOKENS, PROMPT, PROMPT_A, PROMPT_B, SHARED_PREFIX, fresh_model

from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_transformers import EngineError, TransformersEngine

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}


class RoundingCache(DynamicCache):
    """transformers' DynamicCache, storing each K/V rounded through ``kv_dtype`` (and back
    to the model's dtype, in which transformers' attention computes)."""

    def __init__(self, kv_dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kv_dtype = kv_dtype

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def rounded(states: torch.Tensor) -> torch.Tensor:
            return states.to(self.kv_dtype).to(states.dtype)

        return super().update(rounded(key_states), rounded(value_states), *args, **kwargs)


def rounded_reference(
    model: torch.nn.Module, prompt: Sequence[int], kv_dtype: torch.dtype
) -> tuple[int, ...]:
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    cache = RoundingCache(kv_dtype, config=model.config)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache=cache)
    return tuple(out[0, len(prompt) :].tolist())


@pytest.mark.parametrize("kv_cache_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("name", ["llama", "deepseek_v2"])
def test_a_kv_cache_dtype_other_than_the_models_matches_transformers_rounding_the_same(
    name: str, kv_cache_dtype: str
) -> None:
    """Found in review: DeepSeek-V2 (MLA) with fp8, or bfloat16 under a float32 model,
    crashed in kv_b_proj (the latent was expanded in the cache's dtype). Llama is the
    control of the same comparison; both also with a 48-token prefix hit."""
    kv_dtype = KV_DTYPES[kv_cache_dtype]
    config, model = fresh_model(name)
    _, reference_model = fresh_model(name)
    expected = {
        "prompt": rounded_reference(reference_model, PROMPT, kv_dtype),
        "b": rounded_reference(reference_model, PROMPT_B, kv_dtype),
    }
    engine = TransformersEngine(
        model, kvspec_config=config, options=PlanOptions(kv_cache_dtype=kv_cache_dtype)
    )
    assert {view.dtype for view in engine.views.values()} == {kv_dtype}
    assert engine.generate(PROMPT, NEW_TOKENS).token_ids == expected["prompt"]
    engine.generate(PROMPT_A, NEW_TOKENS)
    hit = engine.generate(PROMPT_B, NEW_TOKENS)
    assert hit.cached_tokens == SHARED_PREFIX
    assert hit.token_ids == expected["b"]


def test_fp8_rounding_changes_the_reference() -> None:
    """The comparison above can fail: fp8 K/V change transformers' own tokens for both
    models (bfloat16's rounding is too small to move these greedy tokens)."""
    from transformers_testkit import reference_generate

    for name in ("llama", "deepseek_v2"):
        _, model = fresh_model(name)
        assert rounded_reference(model, PROMPT, torch.float8_e4m3fn) != reference_generate(
            model, PROMPT
        )


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_a_config_dtype_other_than_the_models_is_refused_under_auto(name: str) -> None:
    """Found in review: a float32 model planned from a config saying bfloat16 (as the real
    config.json files do) started, stored K/V rounded to bfloat16, and 1 prompt in 12
    gave other tokens than transformers'."""
    config, model = fresh_model(name)
    bf16_config = {**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    with pytest.raises(
        EngineError,
        match=r"parameters are float32 but kvspec_config's 'torch_dtype' is bfloat16.*Set "
        r"kvspec_config's 'dtype' / 'torch_dtype' to 'float32', or pass "
        r"options=PlanOptions\(kv_cache_dtype=",
    ):
        TransformersEngine(model, kvspec_config=bf16_config)
    # Choosing the cache dtype explicitly is allowed: the rounding is then asked for.
    engine = TransformersEngine(
        model, kvspec_config=bf16_config, options=PlanOptions(kv_cache_dtype="bfloat16")
    )
    assert {view.dtype for view in engine.views.values()} == {torch.bfloat16}


def test_a_model_config_of_another_dtype_than_the_parameters_is_refused() -> None:
    """Without kvspec_config the engine plans model.config: a model cast after it was built
    whose config still names the old dtype is refused the same way, naming model.config."""
    _, model = fresh_model("llama")
    model.config.dtype = "bfloat16"
    with pytest.raises(EngineError, match=r"but model.config's 'dtype' is bfloat16"):
        TransformersEngine(model)


def test_a_model_config_naming_no_dtype_plans_the_parameters_dtype() -> None:
    """A model built as ``Model(config)`` has a config whose dtype is None, for which kvspec
    assumes bfloat16: planning model.config, the engine names the parameters' float32
    instead (a silent bfloat16 cache before), and answers as transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers_testkit import reference_generate

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    assert model.config.to_dict()["dtype"] is None and model.dtype == torch.float32
    expected = reference_generate(model, PROMPT)
    engine = TransformersEngine(model)
    assert {view.dtype for view in engine.views.values()} == {torch.float32}
    assert engine.generate(PROMPT, NEW_TOKENS).token_ids == expected
