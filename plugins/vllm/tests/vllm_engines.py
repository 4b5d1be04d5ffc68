"""Real vLLM engines on the CPU for the tests: one in-process engine at a time, greedy
generation of token-id prompts, what the engine reports about its KV cache.

The engine core runs in the test process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, with
``VLLM_CPU_OMP_THREADS_BIND=nobind`` to start in seconds), so its scheduler's
``KVCacheConfig`` and the plugin's :func:`kvspec_vllm.last_outcome` are readable here.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

#: The CPU attention backend needs a block size that is a multiple of 32.
BLOCK_SIZE = 32
#: KV-cache bytes every test engine gets (2,048 blocks of the 2-layer Llama).
KV_BYTES = 64 << 20
MAX_MODEL_LEN = 512


def prompts() -> list[list[int]]:
    """Token-id prompts longer than the shrunk windows (40 tokens), two sharing a 96-token
    prefix (three blocks), one unrelated."""
    shared = [(7 * i + 3) % 500 + 1 for i in range(96)]
    return [
        shared + [11, 12, 13, 14, 15, 16, 17],
        shared + [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
        [(13 * i + 5) % 500 + 1 for i in range(120)],
    ]


@attrs.frozen
class Run:
    """One engine's greedy outputs over two rounds of :func:`prompts` (the second round
    hits the prefix cache) and what it reported of its KV cache."""

    tokens: tuple[tuple[int, ...], ...]
    cached_tokens: tuple[int, ...]
    num_gpu_blocks: int
    kv_cache_config: Any
    vllm_config: Any


@contextmanager
def engine(folder: Path, **options: Any) -> Iterator[Any]:
    """A vLLM ``LLM`` on the checkpoint in ``folder`` (float32, eager, prefix caching on),
    shut down and collected on exit."""
    from vllm import LLM

    settings: dict[str, Any] = {
        "model": str(folder),
        "skip_tokenizer_init": True,
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": KV_BYTES,
        "max_model_len": MAX_MODEL_LEN,
        "dtype": "float32",
        "enable_prefix_caching": True,
        "enforce_eager": True,
        "seed": 0,
    }
    settings.update(options)
    llm = LLM(**settings)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm: Any, batch: Sequence[Sequence[int]], max_tokens: int = 8) -> list[Any]:
    """Greedy ``RequestOutput`` of each token-id prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in batch]
    return list(llm.generate(requests, params, use_tqdm=False))


def scheduler_of(llm: Any) -> Any:
    """The in-process engine core's scheduler."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def run(folder: Path, **options: Any) -> Run:
    """Start an engine, generate two rounds of :func:`prompts`, record, shut it down."""
    with engine(folder, **options) as llm:
        outputs = generate(llm, prompts()) + generate(llm, prompts())
        return Run(
            tokens=tuple(tuple(output.outputs[0].token_ids) for output in outputs),
            cached_tokens=tuple(int(output.num_cached_tokens or 0) for output in outputs),
            num_gpu_blocks=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            kv_cache_config=scheduler_of(llm).kv_cache_config,
            vllm_config=llm.llm_engine.vllm_config,
        )
