"""Weights from checkpoint metadata (a safetensors index in a hub cache built here, a single
safetensors file) or from transformers' meta-device model; quantised checkpoints as stored;
the TP/PP split as vLLM shards."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from plan_cli_testkit import plan_json

from kvspec_core.deployment.parameters import EXPERTS, SHARDED, WeightTensor, model_weights
from kvspec_core.deployment.sharding import stage_weight_bytes
from kvspec_core.deployment.stored_bytes import stored_bytes
from kvspec_core.models.catalog import load_preset
from kvspec_core.models.pipeline import stage_ranges

REVISION = "0123456789abcdef0123456789abcdef01234567"

#: A small Llama: 2 layers, hidden 64, 4 heads (2 KV heads of 16), MLP 128, vocab 1,000.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def cache_checkpoint(cache: Path, repo_id: str, config: dict, index: dict | None) -> Path:
    """Lay a model out as huggingface_hub caches it (config and, if given, the index)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    if index is not None:
        (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_weights_come_from_the_safetensors_index_in_the_hub_cache(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    total = 17_000_000_000  # not the parameter count's 16,060,522,496: the index wins
    cache_checkpoint(
        hub_cache,
        "meta-llama/Llama-3.1-8B-Instruct",
        load_preset("llama-3.1-8b"),
        {"metadata": {"total_size": total}, "weight_map": {}},
    )
    report = plan_json(capsys, "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "h100-80gb")
    assert report["weights"]["source"] == "safetensors index"
    assert report["weights"]["checkpoint_bytes"] == total
    assert report["weights"]["path"].endswith("model.safetensors.index.json")
    assert report["memory_per_gpu"][0]["weights_bytes"] == total
    # At TP 2 the split keeps the model's proportions, scaled to the index's total.
    tp2 = plan_json(capsys, "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "h100-80gb", "--tp", "2")
    preset = plan_json(capsys, "llama-3.1-8b", "--gpu", "h100-80gb", "--tp", "2")
    expected = preset["memory_per_gpu"][0]["weights_bytes"] * Fraction(total, 16_060_522_496)
    assert abs(tp2["memory_per_gpu"][0]["weights_bytes"] - expected) <= 1


def test_without_an_index_the_hub_model_is_counted_from_its_parameters(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache_checkpoint(
        hub_cache, "meta-llama/Llama-3.1-8B-Instruct", load_preset("llama-3.1-8b"), None
    )
    report = plan_json(capsys, "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "h100-80gb")
    assert report["weights"]["source"] == "parameter count"
    assert report["weights"]["parameters"] == 8_030_261_248
    assert report["weights"]["checkpoint_bytes"] == 2 * 8_030_261_248


def test_a_single_safetensors_file_is_read_from_its_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    tensors = {
        "a": torch.zeros(100, 64, dtype=torch.bfloat16),
        "b": torch.zeros(7, dtype=torch.float32),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    report = plan_json(capsys, str(tmp_path), "--gpu", "l4", "--max-model-len", "4096")
    assert report["weights"]["source"] == "safetensors header"
    assert report["weights"]["checkpoint_bytes"] == 100 * 64 * 2 + 7 * 4


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "head_dim": 16,
        },
    ],
    ids=["llama", "tied", "qwen3-moe"],
)
def test_the_meta_device_count_equals_transformers_own_count(overrides: dict) -> None:
    import transformers
    from transformers import CONFIG_MAPPING

    raw = {**TINY_LLAMA, **overrides}
    config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    built = getattr(transformers, raw["architectures"][0])(config)  # real weights, tiny
    assert model_weights(raw, 2).parameters == built.num_parameters()
    assert model_weights(raw, 2).tied_embeddings == bool(overrides.get("tie_word_embeddings"))


def _tp_pp_bytes(raw: dict, tp: int, pp: int) -> list[Fraction]:
    weights = model_weights(raw, 2)
    stored = {t.name: stored_bytes(t, 2, None) for t in weights.tensors}
    return stage_weight_bytes(weights, stored, tp, stage_ranges(2, pp))


def test_the_tp_split_shards_linears_replicates_norms_and_pads_the_vocabulary() -> None:
    hidden, mlp, vocab_padded = 64, 128, 1024
    attention = 64 * 64 * 2 + 32 * 64 * 2  # q, o; k, v (2 KV heads of 16)
    layer_linears = attention + 3 * mlp * hidden
    norms = 2 * hidden
    # TP 2: linears and KV heads halve, norms stay whole, each vocab table 1024/2 rows.
    expected = 2 * (2 * (layer_linears // 2 + norms) + hidden + 2 * (vocab_padded // 2) * hidden)
    assert _tp_pp_bytes(TINY_LLAMA, 2, 1) == [expected]
    # TP 4 > 2 KV heads: each rank keeps one whole KV head (half of k and v), as vLLM does.
    kv = 32 * 64 * 2
    per_layer = (layer_linears - kv) / 4 + kv / 2 + norms
    expected4 = 2 * (2 * per_layer + hidden + 2 * (vocab_padded // 4) * hidden)
    assert _tp_pp_bytes(TINY_LLAMA, 4, 1) == [expected4]


def test_the_pp_split_puts_the_embedding_first_and_the_head_last() -> None:
    hidden, layer = 64, 64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64 + 2 * 64
    first, last = _tp_pp_bytes(TINY_LLAMA, 1, 2)
    assert first == 2 * (1024 * hidden + layer)  # vocab padded to 1,024 rows
    assert last == 2 * (layer + hidden + 1024 * hidden)
    # A tied embedding: the last stage holds its own copy as the LM head.
    tied_first, tied_last = _tp_pp_bytes({**TINY_LLAMA, "tie_word_embeddings": True}, 1, 2)
    assert tied_first == first and tied_last == last


def _pp_surplus(capsys: pytest.CaptureFixture[str], preset: str, pp: int, *extra: str) -> int:
    """Bytes the stages hold together beyond the whole checkpoint: the copies of the tensors
    vLLM builds on more than one stage."""
    report = plan_json(capsys, preset, "--gpu", "b200", "--pp", str(pp), *extra)
    stages = sum(stage["weights_bytes"] for stage in report["memory_per_gpu"])
    return stages - report["weights"]["checkpoint_bytes"]


@pytest.mark.parametrize(
    ("preset", "vocab", "hidden"),
    [
        ("nemotron-h-56b", 131_072, 8192),  # nemotron_h.py:585, 621, 844
        ("gpt-oss-20b", 201_088, 2880),  # gpt_oss.py:487, 500, 1459
        ("qwen3-30b-a3b", 151_936, 2048),  # qwen3_moe.py:468, 479, 580
        ("jamba-1.5-mini", 65_536, 4096),  # jamba.py:314, 341, 426
    ],
)
def test_classes_that_build_the_embedding_norm_and_head_on_every_stage_hold_them_on_each(
    capsys: pytest.CaptureFixture[str], preset: str, vocab: int, hidden: int
) -> None:
    # Each extra stage holds one more untied embedding, LM head and final norm (bf16).
    tables = 2 * (2 * vocab * hidden + hidden)
    assert _pp_surplus(capsys, preset, 2, "--max-model-len", "4096") == tables
    assert _pp_surplus(capsys, preset, 4, "--max-model-len", "4096") == 3 * tables


def test_qwen3_next_keeps_its_norm_on_the_last_stage_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # qwen3_next.py:660 / 851: embedding and head on every rank; :684-687: norm on the last.
    assert _pp_surplus(capsys, "qwen3-next-80b", 2, "--max-model-len", "4096") == (
        2 * 2 * 151_936 * 2048
    )


def test_llama_keeps_its_vocab_tables_on_the_end_stages_and_gemma_2_on_every_stage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # llama.py guards them (embedding first, norm and head last): no copy anywhere.
    assert _pp_surplus(capsys, "llama-3.1-70b", 4, "--max-model-len", "4096") == 0
    # gemma2.py:259, 270: the tied embedding (its LM head) and the norm on each of 3 stages.
    gemma = 2 * (256_000 * 3584 + 3584)
    assert _pp_surplus(capsys, "gemma-2-9b", 3, "--max-model-len", "4096") == 2 * gemma


def test_llama_4s_vision_tower_is_on_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    raw = load_preset("llama-4-scout")
    weights = model_weights(raw, 48)
    tower = sum(
        2 * t.numel
        for t in weights.tensors
        if t.name.startswith(("vision_model.", "multi_modal_projector."))
    )
    assert tower > 0
    # mllama4.py:766-777 builds the tower and projector on every rank; the language model is
    # Llama's (embedding first, head last).
    assert _pp_surplus(capsys, "llama-4-scout", 2, "--max-model-len", "4096") == tower


def test_an_architecture_without_a_known_stage_placement_is_refused_at_pp_above_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plan_cli_testkit import fails

    (tmp_path / "config.json").write_text(
        json.dumps({**TINY_LLAMA, "architectures": ["MyLlamaForCausalLM"]})
    )
    err = fails(capsys, str(tmp_path), "--gpu", "l4", "--pp", "2")
    assert "MyLlamaForCausalLM" in err and "--pp 1" in err and "--memory" in err
    assert "pipeline_placement.json" in err
    assert plan_json(capsys, str(tmp_path), "--gpu", "l4")["num_blocks"] > 0  # PP 1 plans


def _tensor(shape: tuple[int, ...], role: str = SHARDED) -> WeightTensor:
    return WeightTensor(name="model.layers.0.mlp.up_proj.weight", shape=shape, role=role, layer=0)


def test_quantised_tensors_count_as_stored() -> None:
    up = _tensor((256, 512))  # out x in
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert stored_bytes(up, 2, fp8) == 256 * 512 + 2 * 4 * 4  # 1 B each + fp32 block scales
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    # packed int4 + packed zeros + fp16 scales, per group of 128 inputs (4 groups)
    assert stored_bytes(up, 2, awq) == 256 * 512 // 2 + 4 * 256 // 2 + 4 * 256 * 2
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert stored_bytes(up, 2, gptq) == stored_bytes(up, 2, awq) + 512 * 4  # + g_idx
    experts = _tensor((8, 64, 128), EXPERTS)
    assert stored_bytes(experts, 2, {"quant_method": "mxfp4"}) == Fraction(8 * 64 * 128 * 17, 32)
    # mxfp4 keeps every tensor but the experts in the model's dtype
    assert stored_bytes(up, 2, {"quant_method": "mxfp4"}) == 256 * 512 * 2


@pytest.mark.parametrize(
    ("preset", "published"),
    [
        ("llama-3.1-8b", 16_060_522_496),
        ("llama-3.1-70b", 141_107_412_992),
        ("gpt-oss-20b", 13_761_264_768),  # mxfp4 experts as blocks and scales
    ],
)
def test_the_count_as_stored_equals_the_published_index_total(
    capsys: pytest.CaptureFixture[str], preset: str, published: int
) -> None:
    # metadata.total_size of each model's model.safetensors.index.json on the hub
    report = plan_json(capsys, preset, "--gpu", "b200", "--tp", "8", "--max-model-len", "4096")
    assert report["weights"]["source"] == "parameter count"
    assert report["weights"]["checkpoint_bytes"] == published


def test_every_linear_of_the_layers_is_quantised_k_and_v_included() -> None:
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32}
    raw = {**TINY_LLAMA, "quantization_config": awq}
    weights = model_weights(raw, 2)
    total = sum(stored_bytes(t, 2, awq) for t in weights.tensors)

    def packed(out: int, inputs: int) -> Fraction:  # int4 values + int4 zeros + fp16 scales
        groups = inputs // 32
        return Fraction(out * inputs, 2) + Fraction(groups * out, 2) + groups * out * 2

    linears = packed(64, 64) * 2 + packed(32, 64) * 2 + packed(128, 64) * 2 + packed(64, 128)
    plain = 2 * (2 * 1000 * 64 + 2 * 2 * 64 + 64)  # embedding, head, norms stay bf16
    assert total == 2 * linears + plain


def test_gpt_oss_counts_its_mxfp4_experts_as_stored() -> None:
    raw = load_preset("gpt-oss-20b")
    weights = model_weights(raw, 24)
    stored = sum(stored_bytes(t, 2, raw["quantization_config"]) for t in weights.tensors)
    experts = sum(t.numel for t in weights.tensors if t.role == EXPERTS and t.layer is not None)
    others = weights.parameters - experts
    assert experts > 0.8 * weights.parameters
    assert stored == others * 2 + Fraction(experts * 17, 32)


def test_a_broken_index_or_header_is_refused_naming_the_file_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plan_cli_testkit import fails

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": "16GB"}}))
    err = fails(capsys, str(tmp_path), "--gpu", "l4")
    assert "metadata.total_size" in err and str(index) in err and "fix or remove" in err
    index.unlink()
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    err = fails(capsys, str(tmp_path), "--gpu", "l4")
    assert "safetensors header" in err and "fix or remove" in err


def test_weights_that_cannot_be_counted_are_refused_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plan_cli_testkit import fails

    compressed = {**TINY_LLAMA, "quantization_config": {"quant_method": "compressed-tensors"}}
    (tmp_path / "config.json").write_text(json.dumps(compressed))
    err = fails(capsys, str(tmp_path), "--gpu", "l4")
    assert "'compressed-tensors'" in err and "model.safetensors.index.json" in err
    # With the index beside it, the stored size is the index's and TP 1 plans.
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 123_456}, "weight_map": {}})
    )
    report = plan_json(capsys, str(tmp_path), "--gpu", "l4")
    assert report["weights"]["checkpoint_bytes"] == 123_456
    assert report["weights"]["quant_method"] == "compressed-tensors"
    # ... but its split over TP ranks is not known: refused, not guessed.
    assert "--tp 1 --pp 1" in fails(capsys, str(tmp_path), "--gpu", "l4", "--tp", "2")


def test_at_tp_1_a_model_whose_split_is_unknown_gets_the_tp_1_error_not_the_split_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plan_cli_testkit import fails

    compressed = {
        **load_preset("llama-3.1-8b"),
        "quantization_config": {"quant_method": "compressed-tensors"},
    }
    (tmp_path / "config.json").write_text(json.dumps(compressed))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 9_000_000_000}, "weight_map": {}})
    )
    # The weights fit an L4 at TP 1 but one 128k request does not: the TP 1 advice, and the
    # search for a larger TP stops at the split it cannot make instead of replacing it.
    err = fails(capsys, str(tmp_path), "--gpu", "l4")
    assert "pass --max-model-len 79456" in err and "cannot be split" not in err
    # The weights alone do not fit: said so, with why no larger TP was tried.
    err = fails(capsys, str(tmp_path), "--gpu-memory", "8GiB")
    assert "the weights do not fit at TP 1" in err
    assert "'compressed-tensors'" in err and "a larger TP cannot be tried" in err
    assert "--memory" in err and "--gpu-memory and --overhead" not in err
    # At TP 2 the split error names the real reason and a real fix.
    err = fails(capsys, str(tmp_path), "--gpu", "l4", "--tp", "2")
    assert "'compressed-tensors'" in err and "does not model its stored layout" in err
    assert "--tp 1 --pp 1" in err and "--memory" in err


def test_a_float32_model_is_planned_as_vllm_loads_it_in_bfloat16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plan_cli_testkit import fails

    bf16 = plan_json(capsys, "llama-3.1-8b", "--gpu", "h100-80gb")
    (tmp_path / "config.json").write_text(
        json.dumps({**load_preset("llama-3.1-8b"), "torch_dtype": "float32"})
    )
    # vLLM's --dtype auto downcasts float32 to bfloat16 (_resolve_auto_dtype): weights at 2
    # bytes a parameter and a bfloat16 KV cache, the same plan as the bfloat16 checkpoint's.
    report = plan_json(capsys, str(tmp_path), "--gpu", "h100-80gb")
    assert report["memory_per_gpu"][0]["weights_bytes"] == 16_060_522_496
    assert report["max_concurrency"] == bf16["max_concurrency"]
    assert report["num_blocks"] == bf16["num_blocks"]
    assert "bfloat16" in report["weights"]["loaded_as"]
    assert bf16["weights"]["loaded_as"] is None
    # The float32 index's total is the file size, not what the GPU holds: parameters count.
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 32_121_044_992}, "weight_map": {}})
    )
    indexed = plan_json(capsys, str(tmp_path), "--gpu", "h100-80gb")
    assert indexed["memory_per_gpu"][0]["weights_bytes"] == 16_060_522_496
    # ... and a float32 model whose loaded size cannot be counted is refused, not guessed.
    compressed = {"quant_method": "compressed-tensors"}
    (tmp_path / "config.json").write_text(
        json.dumps({**TINY_LLAMA, "torch_dtype": "float32", "quantization_config": compressed})
    )
    err = fails(capsys, str(tmp_path), "--gpu", "h100-80gb")
    assert "float32" in err and "bfloat16" in err and "--memory" in err


def _gemma_3n_text() -> dict:
    from transformers import Gemma3nTextConfig

    raw = (
        Gemma3nTextConfig().to_dict()
    )  # E4B's defaults: 35 layers, per-layer table 262,144 x 8,960
    return {**raw, "architectures": ["Gemma3nForCausalLM"], "torch_dtype": "bfloat16"}


def test_gemma_3ns_per_layer_table_is_split_over_tp_and_its_gates_replicated() -> None:
    from kvspec_core.deployment.sharding import tp_share

    raw = _gemma_3n_text()
    weights = model_weights(raw, raw["num_hidden_layers"])
    by_name = {t.name: t for t in weights.tensors}
    # gemma3n.py:619: a VocabParallelEmbedding, 1/TP of its (64-padded) rows on each rank.
    table = by_name["model.embed_tokens_per_layer.weight"]
    assert table.shape == (262_144, 8960)
    assert tp_share(table, 2) == Fraction(1, 2) and tp_share(table, 4) == Fraction(1, 4)
    # gemma3n.py:89-105, 122, 493-501: ReplicatedLinear / a bare parameter, whole on each rank.
    for name in (
        "model.layers.0.per_layer_input_gate.weight",
        "model.layers.0.per_layer_projection.weight",
        "model.layers.0.altup.correction_coefs.weight",
        "model.layers.0.altup.prediction_coefs.weight",
        "model.layers.0.altup.modality_router.weight",
        "model.layers.0.altup.correct_output_scale",
    ):
        assert tp_share(by_name[name], 2) == 1, name


def test_gemma_3n_at_tp_2_holds_half_its_per_layer_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_gemma_3n_text(), default=str))
    per_gpu = [
        plan_json(capsys, str(tmp_path), "--gpu", "l4", "--max-model-len", "32768", "--tp", tp)[
            "memory_per_gpu"
        ][0]["weights_bytes"]
        for tp in ("1", "2")
    ]
    half_table = 262_144 * 8960 * 2 // 2  # 2.19 GiB of bf16
    assert per_gpu[0] - per_gpu[1] > half_table
    assert per_gpu[1] < 6.5 * 2**30  # 8.55 GiB when the table was replicated


@pytest.mark.parametrize(
    ("quant", "field"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 0}, "group_size"),
        ({"quant_method": "gptq", "group_size": 128}, "bits"),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ],
)
@pytest.mark.parametrize("with_index", [False, True])
def test_a_malformed_quantization_config_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], quant: dict, field: str, with_index: bool
) -> None:
    from plan_cli_testkit import fails

    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "quantization_config": quant}))
    if with_index:  # the index gives the total, but the split still reads the fields
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 123_456}, "weight_map": {}})
        )
    err = fails(capsys, str(tmp_path), "--gpu", "l4", "--tp", "2", "--max-model-len", "4096")
    assert f"quantization_config.{field}" in err


def test_excluded_modules_match_as_vllm_matches_them() -> None:
    k_proj = WeightTensor(
        name="model.layers.0.self_attn.k_proj.weight", shape=(256, 512), role=SHARDED, layer=0
    )
    plain = 256 * 512 * 2
    # AWQ matches modules_to_not_convert as a substring (vLLM's match_mode="substring").
    for pattern in ("self_attn", "model.layers.0"):
        awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
        assert stored_bytes(k_proj, 2, {**awq, "modules_to_not_convert": [pattern]}) == plain
    # fp8 reads ignored_layers (Fp8Config), modules_to_not_convert only without it.
    fp8 = {"quant_method": "fp8", "ignored_layers": ["model.layers.0.self_attn.k_proj"]}
    assert stored_bytes(k_proj, 2, fp8) == plain
    assert stored_bytes(k_proj, 2, {"quant_method": "fp8"}) == 256 * 512 + 4


@pytest.mark.parametrize(
    "preset, name, share",
    [
        # whisper.py:517-518: plain nn.Conv1d modules, whole on every rank.
        ("whisper-large-v3", "model.encoder.conv1.weight", 1),
        ("whisper-large-v3", "model.encoder.conv2.weight", 1),
        # qwen_gdn_linear_attn.py:666: RMSNormGated(head_v_dim), one head's width, replicated.
        ("qwen3-next-80b", "model.layers.0.linear_attn.norm.weight", 1),
        # The state mixers' causal conv1d and Mamba-2's gated norm split with their channels.
        ("qwen3-next-80b", "model.layers.0.linear_attn.conv1d.weight", Fraction(1, 2)),
        ("nemotron-h-56b", "model.layers.0.mixer.conv1d.weight", Fraction(1, 2)),
        ("nemotron-h-56b", "model.layers.0.mixer.norm.weight", Fraction(1, 2)),
    ],
)
def test_convolutions_and_gated_norms_split_as_vllm_builds_them(
    preset: str, name: str, share: Fraction
) -> None:
    from kvspec_core.deployment.sharding import tp_share
    from kvspec_core.models.layer_typing import num_layers
    from kvspec_core.models.normalized import normalize_config

    raw = load_preset(preset)
    weights = model_weights(raw, num_layers(normalize_config(raw).fields))
    tensor = next(t for t in weights.tensors if t.name == name)
    assert tp_share(tensor, 2) == share
