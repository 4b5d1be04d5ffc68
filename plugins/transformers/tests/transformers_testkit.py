"""Shared set-up of the kvspec-transformers tests: shrunk real configs, models with random
weights, and transformers' own greedy outputs (its default DynamicCache and attention)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from kvspec_core.models.catalog import load_preset
from kvspec_transformers import build_model, shrink_config

#: The shared folder of real configs (kvspec's presets hold the same files).
CONFIGS = Path("/work/shared/model-configs")
#: Test name -> kvspec's bundled preset: the real Hugging Face config.json, byte for byte
#: the files of the shared model-configs folder (meta-llama/Llama-3.1-8B-Instruct,
#: mistralai/Mistral-7B-v0.1, google/gemma-2-9b-it, Llama-4-Scout-17B-16E-Instruct,
#: deepseek-ai/DeepSeek-V2-Lite).
MODEL_PRESETS = {
    "llama": "llama-3.1-8b",
    "mistral": "mistral-7b",
    "gemma2": "gemma-2-9b",
    "llama4": "llama-4-scout",
    "deepseek_v2": "deepseek-v2-lite",
}
#: Generated tokens compared per request.
NEW_TOKENS = 8
#: Tokens A and B share: three blocks of 16, past the shrunk window (24) and chunk (32).
SHARED_PREFIX = 48


def token_ids(count: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (count,), generator=generator).tolist()


PROMPT = token_ids(40, seed=1)
PREFIX = token_ids(SHARED_PREFIX, seed=2)
PROMPT_A = PREFIX + token_ids(9, seed=3)
PROMPT_B = PREFIX + token_ids(10, seed=4)
#: A prompt long enough that a window of 24 frees blocks while decoding.
LONG_PROMPT = token_ids(80, seed=6)


#: Std of the random weights: the configs' 0.02 leaves a tiny model's attention so flat
#: that greedy decoding repeats one or two tokens and a softcap never binds; at 0.1 attention
#: is sharp, outputs vary and every rule (window, chunk, softcap, latent) changes tokens.
INITIALIZER_RANGE = 0.1


def config_of(name: str, **overrides: Any) -> dict[str, Any]:
    """The shrunk preset of test model ``name`` with sharp random weights."""
    config = shrink_config(load_preset(MODEL_PRESETS[name]))
    return {**config, "initializer_range": INITIALIZER_RANGE, **overrides}


def reference_generate(
    model: torch.nn.Module, prompt: Sequence[int], new_tokens: int = NEW_TOKENS
) -> tuple[int, ...]:
    """transformers' own greedy ``generate`` (default DynamicCache, default attention)."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tuple(out[0, len(prompt) :].tolist())


@attrs.frozen
class ModelCase:
    """A shrunk model, the config kvspec plans, and transformers' reference outputs."""

    name: str
    config: dict[str, Any]
    model: torch.nn.Module
    reference: dict[str, tuple[int, ...]]


@functools.cache
def model_case(name: str) -> ModelCase:
    """Built once per test session: the references are computed before any engine switches
    the model to the paged attention."""
    config = config_of(name)
    model = build_model(config, seed=0)
    reference = {
        "prompt": reference_generate(model, PROMPT),
        "b": reference_generate(model, PROMPT_B),
    }
    if name == "mistral":
        reference["long"] = reference_generate(model, LONG_PROMPT)
    return ModelCase(name=name, config=config, model=model, reference=reference)


def fresh_model(name: str, **overrides: Any) -> tuple[dict[str, Any], torch.nn.Module]:
    """A new model of test model ``name`` (same weights as :func:`model_case`'s) that no
    engine has switched to the paged attention yet, so transformers' ``generate`` runs."""
    config = config_of(name, **overrides)
    return config, build_model(config, seed=0)


def fail_on_call(
    model: torch.nn.Module, layer: int, call: int, error: type[BaseException] = RuntimeError
) -> Any:
    """Make decoder layer ``layer`` raise ``error("injected failure")`` on its ``call``-th
    forward (1-based), after the layers before it wrote their K/V or state for the step (a
    half-computed step). Returns the hook handle (``.remove()`` it)."""
    calls = [0]

    def explode(module: torch.nn.Module, args: Any) -> None:
        calls[0] += 1
        if calls[0] == call:
            raise error("injected failure")

    return model.model.layers[layer].register_forward_pre_hook(explode)


@contextlib.contextmanager
def forward_lengths(model: torch.nn.Module) -> Iterator[list[int]]:
    """The token count of each forward ``model`` runs inside the block, in order."""
    lengths: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: lengths.append(int(inputs[0].shape[1]))
    )
    try:
        yield lengths
    finally:
        hook.remove()
