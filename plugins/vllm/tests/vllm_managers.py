"""vLLM's ``KVCacheManager`` built and driven without an engine, as vLLM's scheduler drives
it, with a kvspec shadow attached: small deterministic scenarios for shadow mode.

The manager is built as the engine core builds it for the tiny test models (block 32, hash
block 32, one block pool) from vLLM's own specs: a Mistral-like model (one sliding-window
group) or a Gemma-2-like one (a sliding-window group and a full-attention group). The
sliding window is :data:`tiny_models.WINDOW`. ``retention_interval`` is
``KVCacheConfig.prefix_cache_retention_interval`` as vLLM's engine sets it from
``CacheConfig`` (default ``0``: a sliding-window group caches only the blocks a replay of
the prompt can resume from).

:class:`Scheduler` makes the calls ``vllm.v1.core.sched.scheduler.Scheduler`` makes for a
greedy ``LLM.generate`` (no chunked prefill, no speculative decoding, synchronous
scheduling): a waiting request is looked up (``get_computed_blocks``) and admitted with
``allocate_slots(..., full_sequence_must_fit=True)``; a running one appends its sampled
token and gets ``allocate_slots(request, 1)``; a request whose step finds too few blocks is
preempted (``free``, back to waiting with nothing computed); a finished one is freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tiny_models
import vllm_engines
from kvspec_vllm import shadow

from kvspec_core.context import SizingContext

BLOCK_SIZE = vllm_engines.BLOCK_SIZE
MAX_MODEL_LEN = vllm_engines.MAX_MODEL_LEN
#: The engine's ``max_num_batched_tokens`` default for these tests' engines.
MAX_IN_FLIGHT_TOKENS = 4096


def vllm_manager(num_blocks: int, *, hybrid: bool, retention_interval: int | None = 0) -> Any:
    """vLLM's manager over ``num_blocks`` blocks (null block included) for the Mistral-like
    model, or with ``hybrid`` the Gemma-2-like one."""
    import torch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    attention = dict(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(
            ["model.layers.0.self_attn"],
            SlidingWindowSpec(sliding_window=tiny_models.WINDOW, **attention),
        )
    ]
    if hybrid:
        groups.append(
            KVCacheGroupSpec(["model.layers.1.self_attn"], FullAttentionSpec(**attention))
        )
    page = groups[0].kv_cache_spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * num_blocks,
        layers=[group.layer_names[0] for group in groups],
        layer_stride=0,
        block_stride=page,
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention_interval,
    )
    init_none_hash(get_hash_fn_by_name("sha256"))
    return KVCacheManager(
        config,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        max_in_flight_tokens=MAX_IN_FLIGHT_TOKENS,
        enable_caching=True,
    )


class Scheduler:
    """vLLM's manager with a kvspec shadow, driven as vLLM's scheduler drives it."""

    def __init__(
        self, num_blocks: int, *, hybrid: bool = False, retention_interval: int | None = 0
    ) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher

        self.manager = vllm_manager(
            num_blocks, hybrid=hybrid, retention_interval=retention_interval
        )
        ctx = SizingContext(
            max_model_len=MAX_MODEL_LEN,
            max_in_flight_tokens=MAX_IN_FLIGHT_TOKENS,
            prefix_caching=True,
        )
        self.shadow = shadow.shadow_manager(self.manager, ctx, BLOCK_SIZE)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, get_hash_fn_by_name("sha256"))
        self._sampling = SamplingParams(max_tokens=MAX_MODEL_LEN)
        self.requests: dict[str, Any] = {}
        self.running: list[str] = []

    @property
    def report(self) -> shadow.ShadowReport:
        return self.shadow.report

    def request(self, request_id: str, prompt: Sequence[int]) -> Any:
        """A new waiting request, built as vLLM's engine core builds it."""
        from vllm.v1.request import Request

        request = Request(request_id, list(prompt), self._sampling, None, block_hasher=self._hasher)
        self.requests[request_id] = request
        return request

    def admit(self, request_id: str, chunk: int | None = None) -> int | None:
        """Look the waiting request up and admit it (its first ``chunk`` uncached tokens
        when given: chunked prefill); its hit in tokens, or None when vLLM refused it (it
        stays waiting)."""
        from vllm.v1.request import RequestStatus

        request = self.requests[request_id]
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        num_new = (
            request.num_tokens - hit if chunk is None else min(chunk, request.num_tokens - hit)
        )
        admitted = self.manager.allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            full_sequence_must_fit=True,
            has_scheduled_reqs=bool(self.running),
        )
        if admitted is None:
            return None
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit + num_new
        self.running.append(request_id)
        return int(hit)

    def decode(self, request_id: str, token: int) -> bool:
        """One decode step of a running request that sampled ``token``; a step vLLM
        cannot allocate preempts it (False)."""
        request = self.requests[request_id]
        request.append_output_token_ids(token)
        if self.manager.allocate_slots(request, 1) is None:
            self.preempt(request_id)
            return False
        request.num_computed_tokens += 1
        return True

    def preempt(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus

        request = self.requests[request_id]
        self.manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.running.remove(request_id)

    def finish(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus

        request = self.requests[request_id]
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.manager.free(request)
        self.running.remove(request_id)
