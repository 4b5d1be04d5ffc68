"""``kvspec plan`` through ``kvspec_core.cli.main.main``: JSON contract, table, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_cli_testkit import fails, plan_json

from kvspec_core.cli.main import main
from kvspec_core.cli.plan_cmd import describe_layers
from kvspec_core.models.catalog import preset_text

CONTRACT_KEYS = {
    "model",
    "kv_budget_bytes",
    "max_model_len",
    "num_blocks",
    "groups",
    "bytes_allocated",
    "bytes_padding",
    "max_concurrency",
}
GROUP_KEYS = {"kind", "layers", "block_size", "page_size_bytes"}


def test_json_holds_the_contract_keys(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(capsys, "llama-3.1-8b", "--memory", "40GiB")
    assert set(report) >= CONTRACT_KEYS
    assert report["model"] == "llama-3.1-8b"
    assert report["kv_budget_bytes"] == 40 << 30 and report["max_model_len"] == 131072
    assert report["num_blocks"] == 20480
    assert isinstance(report["max_concurrency"], float)
    assert report["max_concurrency"] == pytest.approx(20479 / 8192)
    (group,) = report["groups"]
    assert set(group) >= GROUP_KEYS
    assert group["kind"] == "full_attention" and len(group["layers"]) == 32
    assert (group["block_size"], group["page_size_bytes"]) == (16, 32 * 16 * 8 * 256 * 2)
    assert report["pools"][0]["num_blocks"] == 20480
    assert report["kv_bytes_per_token"] == 131072
    assert report["bytes_allocated"] + report["bytes_padding"] >= report["bytes_allocated"]


def test_options_reach_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(
        capsys,
        "llama-3.1-8b",
        "--memory",
        "20GiB",
        "--max-model-len",
        "8192",
        "--block-size",
        "32",
        "--kv-cache-dtype",
        "fp8",
        "--tp",
        "2",
        "--max-in-flight-tokens",
        "4096",
    )
    assert (report["max_model_len"], report["block_size"], report["kv_cache_dtype"]) == (
        8192,
        32,
        "fp8",
    )
    assert report["max_in_flight_tokens"] == 4096 and report["tensor_parallel_size"] == 2
    # fp8, 4 KV heads per rank: 32 layers × 4 × 256 × 1 B per token, 32-token blocks.
    assert report["groups"][0]["page_size_bytes"] == 32 * 32 * 4 * 256
    assert report["groups"][0]["block_size"] == 32
    assert report["num_blocks"] == (20 << 30) // (32 * 32 * 4 * 256)


def test_dcp_shards_full_attention_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    # TP 16 over 8 KV heads: two ranks hold each head, DCP 2 splits the tokens between them.
    one = plan_json(capsys, "llama-3.1-8b", "--memory", "40GiB", "--tp", "16")
    two = plan_json(capsys, "llama-3.1-8b", "--memory", "40GiB", "--tp", "16", "--dcp", "2")
    assert two["decode_context_parallel_size"] == 2
    assert two["groups"][0]["blocks_per_request"] * 2 == one["groups"][0]["blocks_per_request"]
    assert two["max_concurrency"] == 2 * one["max_concurrency"]
    # Found by review: token counts were blocks x block size, half the positions a
    # DCP-2 block spans (65,536 tokens per request of max_model_len 131,072).
    assert two["groups"][0]["tokens_per_request"] == two["max_model_len"] == 131072
    tiered = plan_json(
        capsys,
        "llama-3.1-8b",
        "--memory",
        "40GiB",
        "--tp",
        "16",
        "--dcp",
        "2",
        "--host-memory",
        "100GiB",
    )
    (host,) = tiered["tiers"]
    (pool,) = host["pools"]
    assert pool["tokens"] == (pool["num_blocks"] - 1) * 16 * 2


@pytest.mark.parametrize(
    ("model", "parallel", "expected"),
    [
        # Found in review: each planned 2-8x the requests vLLM (and the hardware) can hold.
        ("llama-3.1-8b", ["--dcp", "4"], "does not divide tensor parallel size 1"),
        ("llama-3.1-8b", ["--tp", "8", "--dcp", "8"], "use a --tp above 8"),
        ("llama-3.1-8b", ["--tp", "16", "--dcp", "4"], "exceeds the 2 TP ranks that hold each"),
        ("gpt-oss-20b", ["--tp", "2", "--dcp", "2"], "'num_key_value_heads'=8"),
        ("deepseek-v2-lite", ["--dcp", "2"], "does not divide tensor parallel size 1"),
    ],
)
def test_a_dcp_the_cache_cannot_be_split_by_is_refused(
    capsys: pytest.CaptureFixture[str], model: str, parallel: list[str], expected: str
) -> None:
    assert expected in fails(capsys, model, "--memory", "40GiB", *parallel)


def test_mla_splits_its_latent_across_dcp_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """An MLA latent is on every TP rank: DCP may take all of them."""
    one = plan_json(capsys, "deepseek-v2-lite", "--memory", "40GiB", "--tp", "2")
    two = plan_json(capsys, "deepseek-v2-lite", "--memory", "40GiB", "--tp", "2", "--dcp", "2")
    assert two["groups"][0]["blocks_per_request"] * 2 == one["groups"][0]["blocks_per_request"]


def test_a_config_path_and_a_folder_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(preset_text("mistral-7b"))
    by_folder = plan_json(capsys, str(tmp_path), "--memory", "40GiB")
    by_file = plan_json(capsys, str(tmp_path / "config.json"), "--memory", "40GiB")
    preset = plan_json(capsys, "mistral-7b", "--memory", "40GiB")
    for report in (by_folder, by_file):
        assert report["max_concurrency"] == preset["max_concurrency"]
        assert report["source"] == "config file"


def test_human_output_is_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gemma-2-9b", "--memory", "40GiB"]) == 0
    out = capsys.readouterr().out
    assert "group  kind" in out and "sliding_window" in out and "full_attention" in out
    assert "21 × model.layers.0..40 step 2" in out and "21 × model.layers.1..41 step 2" in out
    assert "max concurrency  15.22 requests of 8,192 tokens" in out
    assert "padding" in out and "B per token" in out


@pytest.mark.parametrize("size", ["40GB?", "-1GiB", "0", "0B", "12 parsecs", "lots"])
def test_bad_sizes_exit_2_without_traceback(size: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(capsys, "llama-3.1-8b", f"--memory={size}")  # "=": -1GiB is not an option
    assert "--memory" in err and repr(size) in err


def test_unknown_preset_lists_close_names(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(capsys, "lama-3.1-8b", "--memory", "40GiB")
    assert "unknown model 'lama-3.1-8b'" in err and "llama-3.1-8b" in err
    assert "kvspec models" in err


def test_missing_config_field_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A model_type transformers does not know: nothing can fill the layer count.
    config = json.loads(preset_text("llama-3.1-8b"))
    del config["num_hidden_layers"]
    config["model_type"] = "kvspec_unpublished"
    (tmp_path / "config.json").write_text(json.dumps(config))
    err = fails(capsys, str(tmp_path), "--memory", "40GiB")
    assert "'num_hidden_layers' is missing" in err


def test_unknown_kv_dtype_lists_the_known(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(capsys, "llama-3.1-8b", "--memory", "40GiB", "--kv-cache-dtype", "fp7")
    assert "unknown KV cache dtype 'fp7'" in err and "fp8" in err


def test_indivisible_tp_names_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(capsys, "llama-3.1-8b", "--memory", "40GiB", "--tp", "3")
    assert "num_attention_heads 32" in err and "--tp 3" in err and "accepts 1, 2, 4" in err


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_tp_vllm_refuses_is_refused_with_or_without_a_gpu(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Qwen2.5-7B's 28 attention heads do not split over 8 ranks; its 4 KV heads would
    (replicated): found in review, --memory planned it while --gpu refused it."""
    code = main([command, "qwen2.5-7b", "--memory", "40GiB", "--tp", "8"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--tp 8: vLLM refuses it for this model" in err
    assert "TP 8 does not divide num_attention_heads 28" in err


def test_a_length_that_does_not_fit_names_the_largest(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(capsys, "llama-3.1-70b", "--memory", "40GiB")
    assert "largest max_model_len that fits is 131056" in err
    assert "--max-model-len 131056" in err
    report = plan_json(capsys, "llama-3.1-70b", "--memory", "40GiB", "--max-model-len", "131056")
    assert report["max_concurrency"] >= 1


def test_not_even_one_block_fits(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(capsys, "llama-3.1-8b", "--memory", "1MiB")
    assert "no max_model_len fits" in err


def test_bad_integer_options_are_argparse_usage_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for args in (["--tp", "0"], ["--block-size", "x"], ["--max-model-len", "-5"]):
        with pytest.raises(SystemExit) as caught:
            main(["plan", "llama-3.1-8b", "--memory", "40GiB", *args])
        assert caught.value.code == 2
        err = capsys.readouterr().err
        assert args[0] in err and "Traceback" not in err


def test_whisper_plans_decoder_and_cross_attention(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(capsys, "whisper-large-v3", "--memory", "40GiB")
    assert report["max_model_len"] == 448 and report["max_encoder_tokens"] == 1500
    kinds = {group["kind"]: group for group in report["groups"]}
    assert kinds["cross_attention"]["blocks_per_request"] == -(-1500 // 16)
    assert kinds["full_attention"]["blocks_per_request"] == 448 // 16


def test_describe_layers_summarises_names() -> None:
    assert describe_layers([f"model.layers.{i}" for i in range(32)]) == "32 × model.layers.0..31"
    assert describe_layers(["model.layers.3"]) == "1 × model.layers.3"
    assert describe_layers([f"model.decoder.layers.{i}.self_attn" for i in (0, 1, 2)]) == (
        "3 × model.decoder.layers.0..2.self_attn"
    )
    assert describe_layers(["a", "b"]) == "2 layers"


def test_state_groups_report_no_token_count(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(capsys, "jamba-1.5-mini", "--memory", "40GiB")
    tokens = {group["kind"]: group["tokens_per_request"] for group in report["groups"]}
    assert tokens == {"mamba": None, "full_attention": 262144}
    assert report["mamba_cache_mode"] == "align"
    assert all(
        group["blocks_per_request"] == 2 for group in report["groups"] if group["kind"] == "mamba"
    )


def test_negative_size_without_equals_is_a_usage_error_naming_the_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # argparse would read "-1GiB" as an option; it is joined to --memory and refused by
    # the size check, with exit 2 and no traceback.
    assert main(["plan", "llama-3.1-8b", "--memory", "-1GiB"]) == 2
    err = capsys.readouterr().err
    assert "--memory '-1GiB' is negative" in err and "Traceback" not in err


def test_a_model_whose_plugin_is_not_loaded_names_the_distribution(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSPEC_PLUGINS", "mla")  # allow-list without kvspec-mamba
    err = fails(capsys, "jamba-1.5-mini", "--memory", "40GiB")
    assert "layer type 'mamba'" in err and "pip install kvspec-mamba" in err
    assert "KVSPEC_PLUGINS" in err


def test_a_max_model_len_past_what_the_model_was_built_for_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found in review: Whisper's decoder (448 learned positions) planned 4,096 tokens."""
    err = fails(capsys, "whisper-large-v3", "--memory", "40GiB", "--max-model-len", "4096")
    assert "longer than the 448 tokens whisper-large-v3 was built for" in err
    assert "--allow-long-max-model-len" in err
    report = plan_json(
        capsys, "llama-3.1-8b", "--memory", "100GiB", "--max-model-len", "200000",
        "--allow-long-max-model-len",
    )  # fmt: skip
    assert report["max_model_len"] == 200000


@pytest.mark.parametrize(
    ("rope_scaling", "longest"),
    [
        ({"rope_type": "linear", "factor": 4.0}, 4 * 4096),  # vLLM multiplies linear, dynamic
        ({"type": "dynamic", "factor": 2.0}, 2 * 4096),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 4096),
    ],
)
def test_the_longest_length_counts_the_rope_factors_vllm_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rope_scaling: dict, longest: int
) -> None:
    config = json.loads(preset_text("mistral-7b"))
    config.update(max_position_embeddings=4096, rope_scaling=rope_scaling, sliding_window=None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert plan_json(capsys, str(tmp_path), "--memory", "40GiB", "--max-model-len", str(longest))
    err = fails(capsys, str(tmp_path), "--memory", "40GiB", "--max-model-len", str(longest + 1))
    assert f"longer than the {longest:,} tokens" in err
