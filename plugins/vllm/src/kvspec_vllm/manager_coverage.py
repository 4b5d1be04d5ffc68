"""What kvspec's allocator behind vLLM's scheduler (:mod:`kvspec_vllm.manager`) covers,
checked where vLLM hands things over: the scheduler's features and the KV-cache groups when
the manager is built, a request's inputs when it first reaches the manager. Anything else is
refused with :class:`~kvspec_vllm.errors.KVSpecVLLMError` naming it and the way out, before
kvspec's allocator holds anything for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from kvspec_core.runtime import Request
from kvspec_core.specs.base import KVSpec
from kvspec_vllm.errors import KVSpecVLLMError, NotRepresentable
from kvspec_vllm.specs import kvspec_spec_of

#: kvspec kinds of the groups this manager runs.
COVERED_KINDS = frozenset({"full_attention", "sliding_window"})


def refuse(what: str, fix: str) -> NoReturn:
    """Raise the manager's refusal of ``what``, with ``fix`` (or turning the switch off)."""
    raise KVSpecVLLMError(
        f"kvspec-vllm: kvspec's allocator behind vLLM's scheduler does not cover {what}. "
        f"{fix}, or unset KVSPEC_VLLM_ALLOCATOR to run vLLM's own KV-cache manager"
    )


def check_scheduler_features(
    kv_cache_config: Any,
    *,
    use_eagle: bool,
    num_prefill_lookahead: int,
    dcp_world_size: int,
    pcp_world_size: int,
    watermark: float,
) -> None:
    """Refuse the scheduler features the manager does not cover (the arguments of vLLM's
    ``KVCacheManager`` constructor, and the blocks the config would have it zero)."""
    if use_eagle or num_prefill_lookahead:
        refuse("speculative decoding (EAGLE / MTP drafts)", "Drop speculative_config")
    if dcp_world_size != 1 or pcp_world_size != 1:
        refuse(
            f"context parallelism (DCP {dcp_world_size}, PCP {pcp_world_size})",
            "Run with decode_context_parallel_size=1",
        )
    if watermark:
        refuse(f"an admission watermark (watermark={watermark})", "Set watermark=0")
    if kv_cache_config.has_mamba_layers or kv_cache_config.needs_kv_cache_zeroing:
        refuse(
            "Mamba / linear-attention layers or mixed-precision caches (blocks vLLM zeroes)",
            "Use a full-attention or sliding-window model",
        )


def covered_specs(groups: Sequence[Any], hash_block_size: int) -> list[KVSpec]:
    """kvspec's spec of each of vLLM's KV-cache ``groups`` (one per group, in order), each
    of a covered kind and hashed in its own block size, else refused naming the group."""
    specs = []
    for index, group in enumerate(groups):
        vllm_spec = group.kv_cache_spec
        try:
            spec = kvspec_spec_of(group.layer_names[0], vllm_spec)
        except NotRepresentable as refusal:
            refuse(
                f"group {index}: {refusal.reason}",
                "Use a full-attention or sliding-window model",
            )
        if spec.kind not in COVERED_KINDS:
            refuse(
                f"group {index} ({type(vllm_spec).__name__}, kvspec kind {spec.kind!r}); "
                f"covered: {', '.join(sorted(COVERED_KINDS))}",
                "Use a full-attention or sliding-window model",
            )
        if vllm_spec.block_size != hash_block_size:
            refuse(
                f"group {index}'s block of {vllm_spec.block_size} tokens hashed in "
                f"{hash_block_size}-token blocks (partial-block hits)",
                "Use one block size for every group",
            )
        specs.append(spec)
    return specs


def kvspec_request_of(request: Any) -> Request:
    """kvspec's view of vLLM's ``request``, sharing its token list (the tokens vLLM appends
    are the ones kvspec hashes); prompt embeddings and multimodal inputs are refused."""
    rid = request.request_id
    if request.prompt_embeds is not None or request.prompt_is_token_ids is not None:
        refuse(f"request {rid!r}: prompt embeddings", "Send token ids")
    if request.mm_features:
        refuse(f"request {rid!r}: multimodal inputs", "Send text-only requests")
    lora = request.lora_request
    return Request(
        rid,
        request._all_token_ids,
        cache_salt=request.cache_salt,
        # vLLM hashes the adapter's name and path: a name pointed at another adapter
        # must not hit the K/V the previous one computed.
        lora_name=repr((lora.lora_name, lora.lora_path)) if lora is not None else None,
        # Built again on a resume, its token ids then hold its output too.
        num_prompt_tokens=request.num_prompt_tokens,
    )
