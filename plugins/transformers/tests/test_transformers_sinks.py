"""GPT-OSS attention sinks on kvspec's cache: one learned logit per query head joins the
softmax's denominator (``s_aux``). The paged attention must apply them, else the tokens are
those of a model without sinks."""

from __future__ import annotations

import functools

import torch
from transformers_testkit import (
    INITIALIZER_RANGE,
    LONG_PROMPT,
    NEW_TOKENS,
    PROMPT,
    PROMPT_A,
    PROMPT_B,
    SHARED_PREFIX,
    reference_generate,
)

from kvspec_core.models.catalog import load_preset
from kvspec_transformers import TransformersEngine, build_model, shrink_config

#: GPT-OSS-20B's published config (kvspec's bundled preset), shrunk: 4 layers alternating
#: sliding (window 24) and full attention.
CONFIG = {**shrink_config(load_preset("gpt-oss-20b")), "initializer_range": INITIALIZER_RANGE}
#: Std of the sink logits: the checkpoint's init (std 0.1 here) barely moves a tiny model's
#: greedy tokens; sinks of this size do, so ignoring them shows.
SINK_STD = 3.0


def model_with_sinks(sinks: str = "learned") -> torch.nn.Module:
    """The shrunk model with sharp sinks (``"learned"``) or sinks of -inf (``"none"``: the
    same model as if it had no sinks)."""
    model = build_model(CONFIG, seed=0)
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for layer in model.model.layers:
            sink = layer.self_attn.sinks
            if sinks == "learned":
                sink.copy_(torch.randn(sink.shape, generator=generator) * SINK_STD)
            else:
                sink.fill_(float("-inf"))
    return model


@functools.cache
def references() -> dict[str, tuple[int, ...]]:
    model = model_with_sinks()
    return {
        "prompt": reference_generate(model, PROMPT),
        "long": reference_generate(model, LONG_PROMPT),
        "b": reference_generate(model, PROMPT_B),
        "no sinks": reference_generate(model_with_sinks("none"), PROMPT),
    }


def test_the_sinks_change_transformers_own_tokens() -> None:
    """Without this, the identity below would not show that the sinks are applied."""
    assert references()["no sinks"] != references()["prompt"]


def test_gpt_oss_with_sinks_is_token_identical_to_transformers() -> None:
    engine = TransformersEngine(model_with_sinks(), kvspec_config=CONFIG)
    assert [group.kind for group in engine.plan.groups] == ["sliding_window", "full_attention"]
    assert engine.generate(PROMPT, NEW_TOKENS).token_ids == references()["prompt"]
    assert engine.generate(LONG_PROMPT, NEW_TOKENS).token_ids == references()["long"]
    engine.generate(PROMPT_A, NEW_TOKENS)
    result = engine.generate(PROMPT_B, NEW_TOKENS)
    assert result.cached_tokens == SHARED_PREFIX
    assert result.token_ids == references()["b"]
