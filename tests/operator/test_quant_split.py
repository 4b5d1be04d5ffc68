"""TP sizes a block- or group-quantised checkpoint cannot be split at are refused, as vLLM
refuses them when it builds the layers (found by review: they were planned)."""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_cli_testkit import fails, plan_json

from kvspec_core.deployment.gpu_budget import tp_candidates, tp_refusal
from kvspec_core.models.catalog import load_preset

FP8_BLOCKS = {"quant_method": "fp8", "weight_block_size": [128, 128]}


def quantized(preset: str, quant: dict, **fields: object) -> dict:
    return {**load_preset(preset), **fields, "quantization_config": quant}


def test_fp8_blocks_refuse_expert_shares_that_are_not_whole_blocks() -> None:
    # Qwen3-30B-A3B's experts are 768 wide: 384 per rank at TP 2, 192 at TP 4, 96 at TP 8
    # (vLLM: "The output_size of gate's and up's weight = 96 is not divisible by weight
    # quantization block_n = 128").
    raw = quantized("qwen3-30b-a3b", FP8_BLOCKS)
    assert tp_refusal(raw, 2) is None
    refusal = tp_refusal(raw, 8)
    assert refusal is not None and "moe_intermediate_size" in refusal and "96" in refusal
    assert tp_candidates(raw) == [1, 2]
    # The same model unquantised, or quantised per tensor (no blocks), splits further.
    assert tp_refusal(load_preset("qwen3-30b-a3b"), 4) is None
    assert tp_refusal(quantized("qwen3-30b-a3b", {"quant_method": "fp8"}), 4) is None


def test_group_quantisation_refuses_row_shares_that_are_not_whole_groups() -> None:
    # A down_proj input of 29,568 (231 groups of 128) splits into whole groups at TP 1 only.
    raw = quantized(
        "llama-3.1-70b",
        {"quant_method": "awq", "bits": 4, "group_size": 128},
        intermediate_size=29568,
    )
    refusal = tp_refusal(raw, 2)
    assert refusal is not None and "down_proj's input" in refusal and "14,784" in refusal
    assert "group_size 128" in refusal
    assert (
        tp_refusal(
            {**raw, "quantization_config": {**raw["quantization_config"], "group_size": -1}}, 2
        )
        is None
    )
    # Llama-3.1-70B's own width (28,672 = 224 groups) splits up to TP 8 in whole groups.
    assert tp_refusal(quantized("llama-3.1-70b", raw["quantization_config"]), 8) is None


def test_the_cli_names_the_tps_that_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    folder = tmp_path / "qwen3-30b-a3b-fp8"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(quantized("qwen3-30b-a3b", FP8_BLOCKS)))
    error = fails(capsys, str(folder), "--memory", "40GiB", "--tp", "4")
    assert "--tp 4: vLLM refuses it" in error and "block_n 128" in error
    assert "it accepts 1, 2" in error
    assert plan_json(capsys, str(folder), "--memory", "40GiB", "--tp", "2")["groups"]


def test_kv_heads_are_read_in_vllms_order_for_the_tp_checks() -> None:
    # Found by review: the TP checks read num_key_value_heads only, so ChatGLM's
    # multi_query_group_num and Falcon's n_head_kv were checked as the query-head count.
    glm = {
        **load_preset("llama-3.1-8b"),
        "head_dim": 64,
        "num_attention_heads": 32,
        "multi_query_group_num": 2,
        "quantization_config": FP8_BLOCKS,
    }
    del glm["num_key_value_heads"]
    # 2 KV heads at TP 4: one 64-wide head per rank, not a whole 128-row fp8 block (vLLM:
    # "not divisible by weight quantization block_n = 128"); the 32 query heads would fit.
    refusal = tp_refusal(glm, 4)
    assert refusal is not None and "k_proj" in refusal and "64" in refusal
    falcon = {**load_preset("llama-3.1-8b"), "n_head_kv": 3, "num_attention_heads": 48}
    del falcon["num_key_value_heads"]
    assert tp_refusal(falcon, 2) == "TP 2 neither divides nor is a multiple of n_head_kv 3"
