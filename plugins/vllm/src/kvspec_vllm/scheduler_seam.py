"""Where kvspec's allocator enters vLLM 0.32's scheduler (``KVSPEC_VLLM_ALLOCATOR=1``).

The seam is the name ``KVCacheManager`` in ``vllm.v1.core.sched.scheduler``, which
``Scheduler.__init__`` calls (with keyword arguments) to build its manager: :func:`install`
points it at :class:`~kvspec_vllm.manager.KVSpecKVCacheManager`, so vLLM's ``Scheduler``
(and any ``scheduler_cls`` subclassing it) runs on kvspec's allocator. ``Scheduler.__init__``
is wrapped only to check, before anything is built, that the engine's configuration is one
the allocator covers (:func:`check_supported`); a configuration it does not cover is refused
there, naming the feature and the fix, never run half on kvspec.
"""

from __future__ import annotations

import functools
from typing import Any

from kvspec_vllm.errors import KVSpecVLLMError
from kvspec_vllm.manager import KVSpecKVCacheManager
from kvspec_vllm.specs import vllm_module

_SCHEDULER = "vllm.v1.core.sched.scheduler"


def check_supported(vllm_config: Any) -> None:
    """Refuse, naming each, the features of ``vllm_config`` kvspec's allocator behind the
    scheduler does not cover."""
    refused: list[str] = []
    if vllm_config.kv_transfer_config is not None:
        refused.append("KV connectors (kv_transfer_config): drop it")
    if getattr(vllm_config, "ec_transfer_config", None) is not None:
        refused.append("encoder-cache connectors (ec_transfer_config): drop it")
    if vllm_config.speculative_config is not None:
        refused.append("speculative decoding (speculative_config): drop it")
    elif getattr(vllm_config, "diffusion_config", None) is not None or (
        vllm_config.num_speculative_tokens
    ):
        # A diffusion LM's canvas rides the draft-token path (vLLM's num_speculative_tokens
        # is its canvas_length): the scheduler rolls back rejected rows, which kvspec's
        # allocator would meet mid-run, inside schedule().
        refused.append(
            "diffusion language models (diffusion_config, "
            f"{vllm_config.num_speculative_tokens} draft tokens a step): run an "
            "autoregressive model"
        )
    scheduler_config = vllm_config.scheduler_config
    if scheduler_config.async_scheduling:
        refused.append(
            "asynchronous scheduling (vLLM frees sliding-window blocks a step late and caches "
            "tokens after their step): set async_scheduling=False"
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        refused.append("pipeline parallelism (steps in flight): set pipeline_parallel_size=1")
    model_config = vllm_config.model_config
    if model_config is not None:
        if model_config.is_encoder_decoder:
            refused.append("encoder-decoder models (cross-attention blocks)")
        if model_config.is_multimodal_model:
            refused.append("multimodal models (their inputs salt block hashes)")
        if model_config.enable_prompt_embeds:
            refused.append("prompt embeddings (enable_prompt_embeds): send token ids")
    if refused:
        raise KVSpecVLLMError(
            "kvspec-vllm: kvspec's allocator behind vLLM's scheduler (KVSPEC_VLLM_ALLOCATOR=1) "
            "does not cover: " + "; ".join(refused) + ". Unset KVSPEC_VLLM_ALLOCATOR to run "
            "vLLM's own KV-cache manager"
        )


def installed() -> bool:
    """Whether vLLM's scheduler builds kvspec's manager now."""
    return vllm_module(_SCHEDULER).KVCacheManager is KVSpecKVCacheManager


def install() -> None:
    """Make vLLM's scheduler build :class:`KVSpecKVCacheManager` (idempotent); refuses
    when shadow mode (or another plugin) replaced vLLM's manager already."""
    scheduler = vllm_module(_SCHEDULER)
    if installed():
        return
    current = scheduler.KVCacheManager
    original = vllm_module("vllm.v1.core.kv_cache_manager").KVCacheManager
    if current is not original:
        raise KVSpecVLLMError(
            "kvspec-vllm: vLLM's scheduler builds another KV-cache manager already "
            f"({getattr(current, '__qualname__', current)!r}: shadow mode, KVSPEC_VLLM_SHADOW=1, "
            "or another plugin); kvspec's allocator and shadow mode exclude each other. Unset "
            "KVSPEC_VLLM_SHADOW or KVSPEC_VLLM_ALLOCATOR"
        )
    init = scheduler.Scheduler.__init__

    @functools.wraps(init)
    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        check_supported(vllm_config)
        init(self, *args, **kwargs)

    checked_init.kvspec_checked = True  # type: ignore[attr-defined]
    scheduler.Scheduler.__init__ = checked_init
    scheduler.KVCacheManager = KVSpecKVCacheManager


def uninstall() -> None:
    """Let vLLM's scheduler build its own ``KVCacheManager`` again."""
    scheduler = vllm_module(_SCHEDULER)
    if not installed():
        return
    scheduler.KVCacheManager = vllm_module("vllm.v1.core.kv_cache_manager").KVCacheManager
    init = scheduler.Scheduler.__init__
    if getattr(init, "kvspec_checked", False):
        scheduler.Scheduler.__init__ = init.__wrapped__
