"""Test-local spec kinds and model shapes for the planner tests.

The spec kinds here stand in for plugin families (window, chunked, recurrent state) with the
published per-request formulas, registered into a fresh manager, so the planner is tested
through the spec protocol alone, as it must work for any plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch

from kvspec_core import CONTRACT_VERSION, PluginManager, SizingContext, hookimpl
from kvspec_core.arithmetic import cdiv
from kvspec_core.planner import KVCachePlan, materialize
from kvspec_core.specs import AttentionSpec, FullAttentionSpec, KVSpec
from kvspec_core.validation import is_bool, positive_int

GiB = 1 << 30


@attrs.frozen(kw_only=True)
class WindowSpec(AttentionSpec):
    """Sliding-window-like: the window plus in-flight tokens, one extra block."""

    kind: ClassVar[str] = "planner_test_window"
    window: int = attrs.field(validator=positive_int)

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        tokens = min(self.window - 1 + ctx.max_in_flight_tokens, ctx.max_model_len)
        return cdiv(self.tokens_held_per_rank(ctx, tokens), self.block_size) + 1

    def is_uniform_with(self, specs: Mapping[str, KVSpec], registry: object) -> bool:
        return all(isinstance(s, WindowSpec) and s.window == self.window for s in specs.values())


@attrs.frozen(kw_only=True)
class ChunkSpec(AttentionSpec):
    """Chunked-local-like: one chunk plus in-flight tokens."""

    kind: ClassVar[str] = "planner_test_chunk"
    chunk: int = attrs.field(validator=positive_int)

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return cdiv(min(self.chunk + ctx.max_in_flight_tokens, ctx.max_model_len), self.block_size)

    def is_uniform_with(self, specs: Mapping[str, KVSpec], registry: object) -> bool:
        return all(isinstance(s, ChunkSpec) and s.chunk == self.chunk for s in specs.values())


@attrs.frozen(kw_only=True)
class StateSpec(KVSpec):
    """Mamba-like: one recurrent state per block, a fixed number of states per request."""

    kind: ClassVar[str] = "planner_test_state"
    state_bytes: int = attrs.field(validator=positive_int)
    states_per_request: int = attrs.field(default=2, validator=positive_int)

    @property
    def num_heads(self) -> int:
        return 1

    @property
    def tokens_per_state(self) -> int:
        return -1

    @property
    def state_content_size_bytes(self) -> int:
        return self.state_bytes

    @property
    def block_table_token_alignment(self) -> int | None:
        return None

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return self.states_per_request


@attrs.frozen(kw_only=True)
class RawSpec(KVSpec):
    """A spec without layer views: the engine lays out its raw pages itself."""

    kind: ClassVar[str] = "planner_test_raw"
    page_bytes: int = attrs.field(validator=positive_int)
    blocks: int = attrs.field(default=4, validator=positive_int)

    @property
    def page_size_bytes(self) -> int:
        return self.page_bytes

    @property
    def has_layer_views(self) -> bool:
        return False

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return self.blocks


@attrs.frozen(kw_only=True)
class HostSpec(FullAttentionSpec):
    """Full attention whose group lives in a host pool."""

    kind: ClassVar[str] = "planner_test_host"
    on_host: bool = attrs.field(default=True, validator=is_bool)

    @property
    def host_resident(self) -> bool:
        return self.on_host

    @property
    def transferable(self) -> bool:
        return False


class _TestKinds:
    kvspec_contract_version = CONTRACT_VERSION

    @hookimpl
    def kvspec_register_spec_kinds(self, register) -> None:  # type: ignore[no-untyped-def]
        for spec_class in (WindowSpec, ChunkSpec, StateSpec, RawSpec, HostSpec):
            register(spec_class)


def manager_with_test_kinds() -> PluginManager:
    """A fresh manager: the core's families plus this module's test kinds."""
    manager = PluginManager()
    manager.register(_TestKinds(), "planner_test_kinds")
    return manager


def full(**fields: object) -> FullAttentionSpec:
    values: dict[str, object] = dict(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    values.update(fields)
    return FullAttentionSpec(**values)  # type: ignore[arg-type]


def window(window: int, **fields: object) -> WindowSpec:
    values: dict[str, object] = dict(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, window=window
    )
    values.update(fields)
    return WindowSpec(**values)  # type: ignore[arg-type]


def chunk(size: int, **fields: object) -> ChunkSpec:
    values: dict[str, object] = dict(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, chunk=size
    )
    values.update(fields)
    return ChunkSpec(**values)  # type: ignore[arg-type]


def layers(specs: list[KVSpec], prefix: str = "model.layers") -> dict[str, KVSpec]:
    return {f"{prefix}.{index}": spec for index, spec in enumerate(specs)}


# ----------------------------------------------------------------- model shapes (40 GiB table)
def llama_3_1_8b() -> dict[str, KVSpec]:
    return layers([full() for _ in range(32)])


def gpt_oss_20b() -> dict[str, KVSpec]:
    # layer_types alternate sliding (128) and full; 8 KV heads of 64.
    return layers(
        [window(128, head_size=64) if i % 2 == 0 else full(head_size=64) for i in range(24)]
    )


def llama_4_scout() -> dict[str, KVSpec]:
    # chunked local attention (8192) with a global NoPE layer every 4th layer.
    return layers([full() if i % 4 == 3 else chunk(8192) for i in range(48)])


def gemma_2_9b() -> dict[str, KVSpec]:
    return layers(
        [window(4096, head_size=256) if i % 2 == 0 else full(head_size=256) for i in range(42)]
    )


def mistral_7b() -> dict[str, KVSpec]:
    return layers([window(4096) for _ in range(32)])


def jamba_1_5_mini() -> dict[str, KVSpec]:
    # attn_layer_period 8, offset 4; Mamba-1 state conv (3, 8192) + ssm (8192, 16) in bf16.
    state = StateSpec(block_size=16, state_bytes=(3 * 8192 + 8192 * 16) * 2)
    return layers([full() if i % 8 == 4 else state for i in range(32)])


def qwen3_next_80b() -> dict[str, KVSpec]:
    # full attention every 4th layer (2 KV heads of 256); gated delta-net state
    # conv (3, 2*16*128 + 32*128) + ssm (32, 128, 128), bf16.
    state = StateSpec(block_size=16, state_bytes=(3 * 8192 + 32 * 128 * 128) * 2)
    return layers([full(num_kv_heads=2, head_size=256) if i % 4 == 3 else state for i in range(48)])


def nemotron_h_56b() -> dict[str, KVSpec]:
    # hybrid_override_pattern: M = Mamba-2, * = attention, - = MLP (no cache).
    pattern = (
        "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-"
        "M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    )
    conv = 3 * (256 * 64 + 2 * 8 * 256) * 2
    ssm = 256 * 64 * 256 * 4  # the ssm state is kept in float32
    state = StateSpec(block_size=16, state_bytes=conv + ssm)
    specs: dict[str, KVSpec] = {}
    for index, symbol in enumerate(pattern):
        if symbol == "M":
            specs[f"backbone.layers.{index}"] = state
        elif symbol == "*":
            specs[f"backbone.layers.{index}"] = full()
    return specs


def vllm_inflated_concurrency(
    specs: Mapping[str, KVSpec], budget: int, ctx: SizingContext
) -> tuple[int, float]:
    """What block inflation gives (the seed's engine on attention + state hybrids): the
    attention block grows to the smallest multiple of 16 whose page holds a state, states
    are padded to that page, all layers are split into groups of the smallest type's layer
    count sharing one pool; concurrency = blocks / blocks per request, as its log reports.
    Returns (inflated attention block size, concurrency)."""
    attention = [s for s in specs.values() if isinstance(s, AttentionSpec)]
    states = [s for s in specs.values() if isinstance(s, StateSpec)]
    per_token = attention[0].page_size_bytes // attention[0].block_size
    state_bytes = states[0].page_size_bytes
    block = 16 * cdiv(cdiv(state_bytes, per_token), 16)
    page = block * per_token
    group = min(len(attention), len(states))
    num_blocks = budget // (group * page)
    attention_blocks = cdiv(len(attention), group) * cdiv(ctx.max_model_len, block)
    state_blocks = cdiv(len(states), group) * states[0].states_per_request
    return block, num_blocks / (attention_blocks + state_blocks)


# ----------------------------------------------------------------- view soundness
def _byte_addresses(view: torch.Tensor, buffer_size: int) -> torch.Tensor:
    as_bytes = view if view.dtype == torch.uint8 else view.view(torch.uint8)
    addresses = torch.arange(buffer_size, dtype=torch.int64)
    return torch.as_strided(
        addresses, as_bytes.shape, as_bytes.stride(), as_bytes.storage_offset()
    ).flatten()


def _planned_addresses(buffers, layer: str) -> torch.Tensor:
    """Bytes the plan gives ``layer`` (raw layers: their pages, not the whole buffer)."""
    info = buffers.layer_views[layer]
    size = buffers.plan.pools[info.pool].size_bytes
    if not info.raw:
        return _byte_addresses(buffers.views[layer], size)
    return torch.as_strided(
        torch.arange(size, dtype=torch.int64), info.shape, info.strides, info.offset
    ).flatten()


def assert_views_sound(plan: KVCachePlan) -> None:
    """Every view inside its buffer; distinct layers share bytes exactly where the plan
    declares aliasing (``plan.aliased_layers``, both ways); writing one layer changes no
    other's bytes except its aliases. Layers reading another's cache (``plan.kv_sharing``)
    are checked like the layers holding one."""
    planned = [layer for group in plan.groups for layer in group.layers]
    planned += [reader for reader, _ in plan.kv_sharing]
    buffers = materialize(plan)
    addresses = {}
    for layer in planned:
        info = buffers.layer_views[layer]
        size = plan.pools[info.pool].size_bytes
        found = _planned_addresses(buffers, layer)
        # Inside the buffer, and no byte twice within one layer.
        assert int(found.min()) >= 0 and int(found.max()) < size
        assert found.unique().numel() == found.numel()
        addresses[layer] = (info.pool, found)
    for a in planned:
        aliases = set(plan.aliased_layers(a))
        assert a not in aliases, a
        for b in planned:
            if a == b:
                continue
            overlap = addresses[a][0] == addresses[b][0] and bool(
                torch.isin(addresses[a][1], addresses[b][1]).any()
            )
            assert overlap == (b in aliases), (a, b, overlap)

    # Writing one layer changes no other layer's bytes, except its declared aliases.
    for pool_buffer in buffers.buffers:
        pool_buffer.zero_()
    for layer in planned:
        if buffers.layer_views[layer].raw:
            continue
        view = buffers.views[layer]
        (view if view.dtype == torch.uint8 else view.view(torch.uint8)).fill_(1)
        aliases = set(plan.aliased_layers(layer))
        for other in planned:
            if other == layer or other in aliases or buffers.layer_views[other].raw:
                continue
            other_view = buffers.views[other]
            other_bytes = (
                other_view if other_view.dtype == torch.uint8 else other_view.view(torch.uint8)
            )
            assert int(other_bytes.sum()) == 0, (layer, other)
        for pool_buffer in buffers.buffers:
            pool_buffer.zero_()


# ----------------------------------------------------------------- two-rank worker (gloo)
def agreement_worker(rank: int, port: int, out_dir: str) -> None:
    """One rank of the gloo test: plan with this rank's budget and agree, first with equal
    specs, then with rank 1's layer 2 changed; write both outcomes."""
    import json
    import os

    import torch.distributed as dist

    from kvspec_core.errors import PlanError
    from kvspec_core.planner import agree_plan_across_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for scenario in ("agree", "mismatch", "tiers"):
            state = StateSpec(block_size=4, state_bytes=1000)
            head = 16 if (scenario == "mismatch" and rank == 1) else 8
            specs = layers(
                [
                    full(num_kv_heads=2, head_size=8, block_size=4),
                    state,
                    full(num_kv_heads=2, head_size=head, block_size=4),
                    state,
                ]
            )
            ctx = SizingContext(max_model_len=64)
            # "tiers": rank 0 asks for a host tier four times rank 1's.
            tiers = {"host_offload_bytes": (256 >> (2 * rank)) << 10} if scenario == "tiers" else {}
            plan = plan_kv_with_budget(specs, (96 + 32 * rank) << 10, ctx, **tiers)
            try:
                agreed = agree_plan_across_ranks(plan)
                outcome = {
                    "blocks": [p.num_blocks for p in agreed.pools],
                    "own": [p.num_blocks for p in plan.pools],
                    "plan": agreed.to_dict(),
                    "tiers": [list(tier.blocks_per_pool) for tier in agreed.tiers],
                    "own_tiers": [list(tier.blocks_per_pool) for tier in plan.tiers],
                }
            except PlanError as error:
                outcome = {"error": str(error)}
            with open(os.path.join(out_dir, f"{scenario}{rank}.json"), "w") as handle:
                json.dump(outcome, handle)
    finally:
        dist.destroy_process_group()


def plan_kv_with_budget(
    specs: Mapping[str, KVSpec], budget: int, ctx: SizingContext, **tiers: Any
) -> KVCachePlan:
    from kvspec_core.planner import plan_kv_cache

    return plan_kv_cache(specs, budget, ctx, manager_with_test_kinds(), **tiers)
