"""kvspec-transformers against transformers' own generate, side by side in one run.

For each shrunk model (random weights from kvspec's bundled real configs, float32, CPU):
transformers' greedy ``generate`` (its DynamicCache), then the engine on kvspec's paged cache
with the same prompt (same tokens required), then a second request sharing a prefix with the
first: the hit tokens and the time of its prefill against computing the whole prompt.
Usage::

    python benchmarks/transformers_engine.py [--prompt 128] [--shared 96] [--new 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from kvspec_core.cli.arguments import positive_int
from kvspec_core.models.catalog import load_preset
from kvspec_transformers import TransformersEngine, build_model, shrink_config

PRESETS = ("llama-3.1-8b", "mistral-7b", "gemma-2-9b", "llama-4-scout", "deepseek-v2-lite")


def timed(function: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def measure(preset: str, prompt_len: int, shared: int, new_tokens: int) -> dict[str, Any]:
    config = {**shrink_config(load_preset(preset)), "initializer_range": 0.1}
    model = build_model(config, seed=0)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 512, (prompt_len,), generator=generator).tolist()
    other = (
        prompt[:shared]
        + torch.randint(0, 512, (prompt_len - shared,), generator=generator).tolist()
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        reference, hf_seconds = timed(
            lambda: model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        )
    engine = TransformersEngine(model, kvspec_config=config)
    first, engine_seconds = timed(lambda: engine.generate(prompt, new_tokens))
    second, hit_seconds = timed(lambda: engine.generate(other, 1))
    cold = TransformersEngine(model, kvspec_config=config, enable_prefix_caching=False)
    _, cold_seconds = timed(lambda: cold.generate(other, 1))
    return {
        "model": preset,
        "identical": list(first.token_ids) == reference[0, prompt_len:].tolist(),
        "transformers_s": round(hf_seconds, 3),
        "engine_s": round(engine_seconds, 3),
        "hit_tokens": second.cached_tokens,
        "prefill_tokens": second.prefill_tokens,
        "prefill_hit_s": round(hit_seconds, 3),
        "prefill_cold_s": round(cold_seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=positive_int, default=128)
    parser.add_argument("--shared", type=positive_int, default=96)
    parser.add_argument("--new", type=positive_int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.shared >= args.prompt:
        parser.error(f"--shared {args.shared} must be below --prompt {args.prompt}")
    rows = [measure(preset, args.prompt, args.shared, args.new) for preset in PRESETS]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"prompt {args.prompt} tokens, {args.new} generated; second request shares {args.shared}")
    header = (
        "model",
        "identical",
        "transformers s",
        "engine s",
        "hit tokens",
        "prefill tokens",
        "prefill s (hit)",
        "prefill s (no cache)",
    )
    print("  ".join(f"{h:>14}" for h in header))
    for row in rows:
        print("  ".join(f"{value!s:>14}" for value in row.values()))


if __name__ == "__main__":
    main()
