"""The bridge never answers wrong silently (issue 18, item 6): threads, failed forwards,
``max_model_len``, and prompts of numpy / torch integers.

Every output is compared with transformers' own greedy ``generate`` on the same weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch
from transformers_testkit import (
    NEW_TOKENS,
    PREFIX,
    PROMPT,
    fail_on_call,
    fresh_model,
    model_case,
    reference_generate,
    token_ids,
)

from kvspec_core.runtime import Request
from kvspec_transformers import EngineError, Generation, TransformersEngine


def engine_for(name: str, **options: Any) -> TransformersEngine:
    case = model_case(name)
    return TransformersEngine(case.model, kvspec_config=case.config, **options)


# --------------------------------------------------------------------------- threads
def test_concurrent_generate_calls_answer_as_sequential_ones() -> None:
    """Threads calling ``generate`` at once run one after the other: each gets
    transformers' tokens, and the prefix cache they leave holds no mixed-up blocks (the
    second round hits it)."""
    config, model = fresh_model("llama")
    prompts = [PREFIX + token_ids(5 + index, seed=20 + index) for index in range(3)]
    prompts += [token_ids(40 + 7 * index, seed=30 + index) for index in range(3)]
    expected = [reference_generate(model, prompt) for prompt in prompts]
    engine = TransformersEngine(model, kvspec_config=config)
    active = [0]
    peak = [0]

    def enter(module: torch.nn.Module, args: Any) -> None:
        active[0] += 1
        peak[0] = max(peak[0], active[0])

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        active[0] -= 1

    def run(
        index: int,
        barrier: threading.Barrier,
        results: list[Generation | None],
        errors: list[BaseException],
    ) -> None:
        barrier.wait()
        try:
            results[index] = engine.generate(prompts[index], NEW_TOKENS)
        except BaseException as error:  # reported below
            errors.append(error)

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    try:
        for round_ in range(2):
            results: list[Generation | None] = [None] * len(prompts)
            errors: list[BaseException] = []
            barrier = threading.Barrier(len(prompts))
            threads = [
                threading.Thread(target=run, args=(index, barrier, results, errors))
                for index in range(len(prompts))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not errors
            assert [result.token_ids for result in results if result] == expected
            if round_:
                assert all(result and result.cached_tokens >= 32 for result in results)
    finally:
        for handle in handles:
            handle.remove()
    assert peak[0] == 1  # no two forwards ever overlapped
    assert engine.allocator.num_running == 0
    engine.allocator.check_invariants()


def test_generate_from_inside_a_forward_is_refused_not_deadlocked() -> None:
    config, model = fresh_model("llama")
    expected = reference_generate(model, PROMPT)
    engine = TransformersEngine(model, kvspec_config=config)
    refusals: list[str] = []

    def nested(module: torch.nn.Module, args: Any) -> None:
        try:
            engine.generate([1, 2, 3], 1)
        except EngineError as error:
            refusals.append(str(error))

    handle = model.register_forward_pre_hook(nested)
    try:
        result = engine.generate(PROMPT, NEW_TOKENS)
    finally:
        handle.remove()
    assert len(refusals) == NEW_TOKENS
    assert "called from inside a running generate on the same thread" in refusals[0]
    assert result.token_ids == expected


# --------------------------------------------------------------------------- failed forwards
def assert_failed_request_left_nothing(
    engine: TransformersEngine, prompt: list[int], expected: tuple[int, ...]
) -> Generation:
    """After a generate of ``prompt`` that failed: nothing runs, the allocator is sound, no
    block of the prompt can be hit, and a re-run answers ``expected``; returns the re-run."""
    assert engine.allocator.num_running == 0
    engine.allocator.check_invariants()
    assert engine.allocator.find_cached_prefix(Request("peek", prompt)).num_tokens == 0
    again = engine.generate(prompt, NEW_TOKENS)
    assert again.token_ids == expected
    return again


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_prefill_that_raises_leaves_no_block_cached(error: type[BaseException]) -> None:
    """The prefill's allocation cached the prompt's four full blocks before the forward;
    the forward raised half way: none of them may be hit afterwards."""
    config, model = fresh_model("llama")
    prompt = token_ids(70, seed=40)
    expected = reference_generate(model, prompt)
    engine = TransformersEngine(model, kvspec_config=config)
    handle = fail_on_call(model, 1, 1, error)
    with pytest.raises(error, match="injected failure"):
        engine.generate(prompt, NEW_TOKENS)
    handle.remove()
    again = assert_failed_request_left_nothing(engine, prompt, expected)
    assert again.cached_tokens == 0


def test_an_interrupt_right_after_the_admission_leaves_no_block_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The admission cached the prompt's full blocks; an interrupt lands before the first
    forward: the request is not left running and none of its blocks can be hit."""
    config, model = fresh_model("llama")
    prompt = token_ids(70, seed=43)
    expected = reference_generate(model, prompt)
    engine = TransformersEngine(model, kvspec_config=config)
    admit = engine._allocate

    def admit_then_interrupt(*args: Any) -> None:
        admit(*args)
        raise KeyboardInterrupt("injected failure after the admission")

    monkeypatch.setattr(engine, "_allocate", admit_then_interrupt)
    with pytest.raises(KeyboardInterrupt, match="injected failure"):
        engine.generate(prompt, NEW_TOKENS)
    monkeypatch.undo()
    assert_failed_request_left_nothing(engine, prompt, expected)


def test_a_decode_step_that_raises_keeps_only_the_written_blocks() -> None:
    """Prompt of 61: the third decode step computes position 63, the last of block 3, whose
    allocation cached the block; its forward raises. A follow-up turn (prompt + the three
    tokens + one) resumes from block 2 (48 tokens, all written), not from block 3."""
    config, model = fresh_model("llama")
    prompt = token_ids(61, seed=41)
    first = reference_generate(model, prompt)
    follow_up = prompt + list(first[:3]) + token_ids(1, seed=42)
    expected = reference_generate(model, follow_up)
    engine = TransformersEngine(model, kvspec_config=config)
    handle = fail_on_call(model, 1, 4)  # prefill, decode 1, 2, then 3 raises
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.generate(prompt, NEW_TOKENS)
    handle.remove()
    engine.allocator.check_invariants()
    result = engine.generate(follow_up, NEW_TOKENS)
    assert result.cached_tokens == 48
    assert result.token_ids == expected


# --------------------------------------------------------------------------- max_model_len
def test_generation_stops_at_max_model_len_with_finish_reason_length() -> None:
    """vLLM's rule: a sequence (prompt + generated) never grows past max_model_len; the
    request finishes with what it generated and ``finish_reason`` "length"."""
    config, model = fresh_model("llama")
    prompt = token_ids(60, seed=43)
    expected = reference_generate(model, prompt, 12)
    engine = TransformersEngine(model, kvspec_config=config, max_model_len=64)
    result = engine.generate(prompt, 12)
    assert result.token_ids == expected[:4]
    assert result.finish_reason == "length"
    assert engine.allocator.num_running == 0
    engine.allocator.check_invariants()
    assert len(engine.generate(token_ids(64, seed=44), 12).token_ids) == 1
    with pytest.raises(EngineError, match="65 tokens, more than max_model_len=64"):
        engine.generate(token_ids(65, seed=44), 1)
    short = engine.generate(prompt, 2)
    assert short.token_ids == expected[:2] and short.finish_reason == "length"
    stop = expected[2]
    stopped = engine.generate(prompt, 12, stop_token_ids=[stop])
    assert stopped.token_ids == expected[: expected.index(stop) + 1]
    assert stopped.finish_reason == "stop"


def hog_all_blocks_but(engine: TransformersEngine, keep: int) -> None:
    """Admit requests straight on the allocator until only ``keep`` blocks are free."""
    allocator = engine.allocator
    block = allocator.specs[0].block_size
    index = 0
    while allocator.usage.free_blocks > keep:
        count = min(allocator.usage.free_blocks - keep, allocator.admission_caps[0])
        request = Request(f"hog-{index}", token_ids(count * block, seed=100 + index))
        assert allocator.allocate_slots(request, count * block)
        index += 1


def test_running_out_of_blocks_mid_decode_raises_the_engine_error_with_the_partial_output() -> None:
    config, model = fresh_model("llama")
    prompt = token_ids(30, seed=45)
    expected = reference_generate(model, prompt)
    engine = TransformersEngine(model, kvspec_config=config)
    hog_all_blocks_but(engine, 2)  # the prompt's two blocks; the 33rd token needs a third
    with pytest.raises(EngineError, match="no slots for 1 tokens") as raised:
        engine.generate(prompt, NEW_TOKENS, request_id="r")
    partial = raised.value.partial
    assert partial is not None and partial.finish_reason == "error"
    assert partial.token_ids == expected[:3]
    assert not engine.allocator.is_running("r")
    engine.allocator.check_invariants()


# --------------------------------------------------------------------------- prompt types
CONVERSIONS: dict[str, Callable[[list[int]], Any]] = {
    "tuple": tuple,
    "numpy int64 array": lambda ids: numpy.array(ids, dtype=numpy.int64),
    "numpy int32 scalars": lambda ids: [numpy.int32(token) for token in ids],
    "numpy uint16 array": lambda ids: numpy.array(ids, dtype=numpy.uint16),
    "torch 1-d tensor": lambda ids: torch.tensor(ids),
    "torch int32 tensor": lambda ids: torch.tensor(ids, dtype=torch.int32),
    "0-d torch tensors": lambda ids: [torch.tensor(token) for token in ids],
}


@pytest.mark.parametrize("kind", list(CONVERSIONS))
def test_prompts_of_numpy_and_torch_integers_are_accepted(kind: str) -> None:
    engine = engine_for("llama")
    result = engine.generate(
        CONVERSIONS[kind](PROMPT), NEW_TOKENS, stop_token_ids=numpy.array([511])
    )
    assert result.token_ids == model_case("llama").reference["prompt"]
    assert result.prompt_token_ids == tuple(PROMPT)
    assert all(type(token) is int for token in result.prompt_token_ids)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([1, True], r"prompt_token_ids\[1\]=True \(bool\) must be a token id in \[0, 512\)"),
        ([numpy.bool_(True)], r"prompt_token_ids\[0\]=.*\(bool.*\) must be a token id"),
        (torch.tensor([True, False]), r"prompt_token_ids\[0\]=tensor\(True\).*dtype torch.bool"),
        ([1, 2.0], r"prompt_token_ids\[1\]=2.0 \(float\) must be a token id"),
        ([numpy.float32(3)], r"prompt_token_ids\[0\]=.*float32.*must be a token id"),
        (torch.tensor([1.0, 2.0]), r"prompt_token_ids\[0\]=tensor\(1.\).*dtype torch.float32"),
        ([1, -1], r"prompt_token_ids\[1\]=-1 must be a token id in \[0, 512\)"),
        (
            numpy.array([3, 512]),
            r"prompt_token_ids\[1\]=.*512\) must be a token id in \[0, 512\) \(the model's",
        ),
        (torch.tensor([[1, 2]]), r"shape \(1, 2\); pass one prompt's 1-d token ids"),
        ("hello", r"is a str; pass token ids \(tokenize the text first\)"),
        (b"hi", r"is a bytes; pass token ids"),
        (torch.tensor(5), r"shape \(\); pass one prompt's 1-d token ids"),
        (5, r"prompt_token_ids=5 is not a sequence of token ids"),
        ([], "prompt_token_ids is empty"),
    ],
)
def test_bad_prompts_are_refused_naming_the_item(prompt: Any, match: str) -> None:
    engine = engine_for("llama")
    with pytest.raises(EngineError, match=match):
        engine.generate(prompt, 4)
    assert engine.allocator.num_running == 0


def test_bad_stop_tokens_are_refused() -> None:
    engine = engine_for("llama")
    with pytest.raises(EngineError, match=r"stop_token_ids\[0\]=-2 must be a token id"):
        engine.generate(PROMPT, 4, stop_token_ids=[-2])
    for refused, match in [
        (True, r"stop_token_ids=True \(bool\) is not token ids"),
        ({5: 1}, "stop_token_ids is a dict; pass token ids"),
        (512, r"stop_token_ids\[0\]=512 must be a token id in \[0, 512\)"),
    ]:
        with pytest.raises(EngineError, match=match):
            engine.generate(PROMPT, 4, stop_token_ids=refused)  # type: ignore[arg-type]
    assert engine.allocator.num_running == 0


def test_one_bare_stop_token_id_is_taken_as_a_list_of_one() -> None:
    """Found in review: ``stop_token_ids=5`` (what ``tokenizer.eos_token_id`` is) raised a
    TypeError. A bare integer (numpy's, a 0-d tensor) now stops like ``[5]``."""
    engine = engine_for("llama")
    expected = model_case("llama").reference["prompt"]
    stop = expected[2]
    for bare in (stop, numpy.int64(stop), torch.tensor(stop)):
        result = engine.generate(PROMPT, NEW_TOKENS, stop_token_ids=bare)  # type: ignore[arg-type]
        assert result.finish_reason == "stop"
        assert result.token_ids == expected[: expected.index(stop) + 1]
    # A set of stop ids is fine: their order does not matter.
    assert engine.generate(PROMPT, NEW_TOKENS, stop_token_ids={stop, 511}).finish_reason == "stop"


@pytest.mark.parametrize(
    "prompt",
    [set(PROMPT[:4]), frozenset(PROMPT[:4]), dict.fromkeys(PROMPT[:4]), {1: 2}.keys()],
    ids=["set", "frozenset", "dict", "dict keys"],
)
def test_unordered_or_keyed_prompts_are_refused(prompt: Any) -> None:
    """Found in review: a prompt given as a set ran in its hashing's order (and a dict as
    its keys), with no error: a wrong prompt, silently."""
    engine = engine_for("llama")
    with pytest.raises(EngineError, match="which has no token order; pass the ids in order"):
        engine.generate(prompt, 4)
    assert engine.allocator.num_running == 0


@pytest.mark.parametrize(
    ("request_id", "match"),
    [(5, r"request_id=5 \(int\) must be a non-empty str"), ("", "request_id='' \\(str\\)")],
)
def test_bad_request_ids_are_refused(request_id: Any, match: str) -> None:
    engine = engine_for("llama")
    with pytest.raises(EngineError, match=match):
        engine.generate(PROMPT, 4, request_id=request_id)
    assert engine.allocator.num_running == 0


@pytest.mark.parametrize(
    ("argument", "value", "match"),
    [
        ("model", None, "model is a NoneType; pass a transformers causal LM"),
        ("options", {"block_size": 8}, r"options is a dict; pass .*PlanOptions\(block_size=8\)"),
        ("kvspec_config", [1, 2], "kvspec_config is a list; pass a config dict"),
        ("enable_prefix_caching", "no", r"enable_prefix_caching='no' \(str\); pass True or False"),
        ("manager", "plugins", "manager is a str; pass a kvspec PluginManager"),
    ],
)
def test_engine_arguments_of_the_wrong_type_are_refused_naming_them(
    argument: str, value: Any, match: str
) -> None:
    """Found in review: options={...} and model=None died on an AttributeError,
    kvspec_config=[...] on a TypeError, and enable_prefix_caching="no" was taken as true."""
    case = model_case("llama")
    arguments: dict[str, Any] = {"model": case.model, "kvspec_config": case.config}
    arguments[argument] = value
    with pytest.raises(EngineError, match=match):
        TransformersEngine(**arguments)


# --------------------------------------------------------------------------- plan vs model
@pytest.mark.parametrize(
    ("name", "override", "match"),
    [
        (
            "mistral",
            {"sliding_window": 4096},
            r"layer model.layers.0: the model computes sliding_attention "
            r"\(model.config.sliding_window=24\) but the kvspec plan has a sliding_window spec "
            r"with sliding_window=4096 .*: set kvspec_config's sliding_window to 24",
        ),
        (
            "gemma2",
            {"sliding_window": 100_000},
            r"layer model.layers.0: .*sliding_window=24\) .*sliding_window=100000 .*to 24",
        ),
        (
            "llama4",
            {"attention_chunk_size": 8192},
            r"layer model.layers.0: the model computes chunked_attention "
            r"\(model.config.attention_chunk_size=32\) .*attention_chunk_size=8192 .*to 32",
        ),
        (
            "llama",
            {"sliding_window": 24},
            r"layer model.layers.0: the model computes full_attention but the kvspec plan has a "
            r"sliding_window spec with sliding_window=24 .*\(layer_types\)",
        ),
    ],
)
def test_a_plan_that_disagrees_with_the_model_is_refused_at_start(
    name: str, override: dict[str, Any], match: str
) -> None:
    """The paged attention reads what the spec says; a kvspec_config whose window or chunk
    is not the model's would answer with wrong tokens, so the engine refuses to start."""
    case = model_case(name)
    with pytest.raises(EngineError, match=match):
        TransformersEngine(case.model, kvspec_config={**case.config, **override})


def test_a_state_layer_planned_as_attention_is_refused_at_start() -> None:
    pytest.importorskip("kvspec_mamba", reason="kvspec-mamba (the state family) is not installed")
    from kvspec_core.models.catalog import load_preset
    from kvspec_transformers import build_model, shrink_config

    config = shrink_config(load_preset("qwen3-next-80b"))  # layers 0-2 linear, 3 full
    model = build_model(config, seed=0)
    with pytest.raises(
        EngineError,
        match=r"layer model.layers.1: the model computes "
        r"linear_attention but the kvspec plan has a full_attention spec",
    ):
        TransformersEngine(model, kvspec_config={**config, "full_attention_interval": 2})


def test_the_model_reading_follows_transformers_masks() -> None:
    """``config.layer_types`` when present; else every layer slides when ``sliding_window``
    is set (Mistral), unless ``use_sliding_window`` is False; MLP / MoE layers keep no
    cache; other types and a wrong-length list are refused."""
    from types import SimpleNamespace

    from kvspec_core import FullAttentionSpec
    from kvspec_transformers.model_layout import check_plan_against_model, model_layers

    def kinds(**fields: Any) -> list[tuple[str, int | None]]:
        config = SimpleNamespace(num_hidden_layers=2, **fields)
        return [(layer.layer_type, layer.span) for layer in model_layers(config)]

    assert kinds(sliding_window=24) == [("sliding_attention", 24)] * 2
    assert kinds(sliding_window=24, use_sliding_window=False) == [("full_attention", None)] * 2
    assert kinds() == [("full_attention", None)] * 2
    assert kinds(layer_types=["chunked_attention", "mlp"], attention_chunk_size=32) == [
        ("chunked_attention", 32),
        ("mlp", None),
    ]
    with pytest.raises(EngineError, match="layer_types has 1 entries for num_hidden_layers=2"):
        kinds(layer_types=["full_attention"])
    with pytest.raises(
        EngineError,
        match=r"sliding_attention but model.config.sliding_window="
        r"None is not a positive int",
    ):
        kinds(layer_types=["sliding_attention"] * 2)
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = SimpleNamespace(num_hidden_layers=3, layer_types=["full_attention", "mlp", "moe"])
    check_plan_against_model(config, {0: ("model.layers.0", full)}, 64)
    with pytest.raises(
        EngineError,
        match=r"layer model.layers.1: the model computes an mlp "
        r"layer \(no cache\) but the kvspec plan has a full_attention spec",
    ):
        check_plan_against_model(
            config, {0: ("model.layers.0", full), 1: ("model.layers.1", full)}, 64
        )
    with pytest.raises(
        EngineError,
        match=r"layer model.layers.0: the model computes "
        r"full_attention but the kvspec plan keeps no cache for it",
    ):
        check_plan_against_model(config, {}, 64)
    odd = SimpleNamespace(num_hidden_layers=1, layer_types=["indexed_attention"])
    with pytest.raises(EngineError, match="computes a 'indexed_attention' layer"):
        check_plan_against_model(odd, {0: ("model.layers.0", full)}, 64)
