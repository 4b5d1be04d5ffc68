"""Jamba (Mamba-1 + attention): token-identical to transformers without prefix caching;
with it, refused at engine start, because transformers' Mamba-1 scan cannot resume a
multi-token step from a saved state (a prefix hit or a split prefill would drop the state).

The random weights get slow-decaying SSM states (``A_log`` = -4) so that the state a layer
carries really changes the tokens; with the init's fast decay a dropped state goes unseen.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("kvspec_mamba", reason="kvspec-mamba (the state family) is not installed")
from transformers_testkit import (
    CONFIGS,
    INITIALIZER_RANGE,
    NEW_TOKENS,
    PROMPT,
    PROMPT_A,
    PROMPT_B,
    reference_generate,
)

from kvspec_transformers import (
    EngineError,
    TransformersEngine,
    build_model,
    read_config,
    shrink_config,
)
from kvspec_transformers.state_layers import StateLayer

#: AI21-Jamba-1.5-Mini's published config, shrunk: Mamba-1 at 0, 1, 3, attention at 2.
CONFIG = {
    **shrink_config(read_config(CONFIGS / "ai21labs__AI21-Jamba-1.5-Mini.json")),
    "initializer_range": INITIALIZER_RANGE,
}


def jamba_model() -> torch.nn.Module:
    model = build_model(CONFIG, seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = getattr(layer, "mamba", None)
            if mixer is not None:
                mixer.A_log.fill_(-4.0)  # A = -exp(-4): the SSM state persists
    return model


@functools.cache
def references() -> dict[str, tuple[int, ...]]:
    model = jamba_model()
    return {
        "prompt": reference_generate(model, PROMPT),
        "a": reference_generate(model, PROMPT_A),
        "b": reference_generate(model, PROMPT_B),
    }


def test_jamba_without_prefix_caching_is_token_identical_to_transformers() -> None:
    engine = TransformersEngine(jamba_model(), kvspec_config=CONFIG, enable_prefix_caching=False)
    assert [type(layer).__name__ for layer in engine.cache.layers] == [
        "StateLayer",
        "StateLayer",
        "PagedAttentionLayer",
        "StateLayer",
    ]
    assert {
        layer.spec.mamba_type for layer in engine.cache.layers if isinstance(layer, StateLayer)
    } == {"mamba1"}
    for key, prompt in (("prompt", PROMPT), ("a", PROMPT_A), ("b", PROMPT_B)):
        result = engine.generate(prompt, NEW_TOKENS)
        assert result.cached_tokens == 0
        assert result.token_ids == references()[key]


def test_jamba_with_prefix_caching_is_refused_at_start() -> None:
    with pytest.raises(
        EngineError,
        match=r"layer model.layers.0: transformers' Mamba-1 scan "
        r".* zero SSM state.*enable_prefix_caching=False",
    ):
        TransformersEngine(jamba_model(), kvspec_config=CONFIG)


def test_why_resuming_jamba_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal's reason, kept as a canary: let the engine resume Mamba-1 states anyway
    and a split prefill (40 tokens: steps of 32 and 8) and a prefix hit (48 tokens) both
    answer wrong. When transformers' scan takes an initial state, this fails: then lift the
    refusal."""
    monkeypatch.setattr("kvspec_transformers.state_layers.NO_MULTI_TOKEN_RESUME", {})
    engine = TransformersEngine(jamba_model(), kvspec_config=CONFIG)
    assert engine.generate(PROMPT, NEW_TOKENS).token_ids != references()["prompt"]
    engine.generate(PROMPT_A, 1)
    result = engine.generate(PROMPT_B, NEW_TOKENS)
    assert result.cached_tokens == 48
    assert result.token_ids != references()["b"]
