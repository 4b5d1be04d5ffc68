"""``kvspec plan MODEL --gpu NAME``: the memory breakdown, the answer, its JSON keys, the
too-big error naming the smallest TP, bad input, and ``--plot`` with one curve per TP."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_cli_testkit import fails, plan_json

from kvspec_core.cli.main import main
from kvspec_core.deployment.gpus import gpu_catalog
from kvspec_core.models.catalog import load_preset

GPU_KEYS = {"gpu", "weights", "overheads", "memory_per_gpu", "max_tokens"}
STAGE_KEYS = {
    "stage",
    "weights_bytes",
    "activation_bytes",
    "non_torch_bytes",
    "kv_budget_bytes",
    "kv_bytes_allocated",
    "free_bytes",
    "reserved_bytes",
}


def test_json_keeps_the_plan_keys_and_adds_the_documented_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plain = plan_json(capsys, "llama-3.1-8b", "--memory", "40GiB")
    report = plan_json(capsys, "llama-3.1-8b", "--gpu", "h100-80gb")
    assert set(plain) | GPU_KEYS == set(report)
    assert set(report["gpu"]) == {
        "name",
        "description",
        "memory_bytes",
        "memory_source",
        "utilization",
        "usable_bytes",
    }
    assert set(report["weights"]) == {
        "source",
        "checkpoint_bytes",
        "parameters",
        "quant_method",
        "path",
        "loaded_as",
        "assumed",
    }
    assert set(report["overheads"]) == {"activation_bytes", "non_torch_bytes", "basis", "source"}
    (stage,) = report["memory_per_gpu"]
    assert set(stage) == STAGE_KEYS
    assert report["kv_budget_bytes"] == stage["kv_budget_bytes"]
    assert report["bytes_allocated"] == stage["kv_bytes_allocated"]
    assert report["max_tokens"] == int(report["max_concurrency"] * report["max_model_len"])


def test_llama_8b_on_an_h100_leaves_what_vllm_leaves(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(capsys, "llama-3.1-8b", "--gpu", "h100-80gb")
    (stage,) = report["memory_per_gpu"]
    assert stage["weights_bytes"] == 16_060_522_496  # the published checkpoint's total_size
    assert report["gpu"]["usable_bytes"] == int(81_559 * 2**20 * 0.9)
    # vLLM logs ~54.6 GiB of KV cache for this model on an H100 at 0.9.
    assert 54.0 * 2**30 < stage["kv_budget_bytes"] < 55.0 * 2**30
    assert report["num_blocks"] == stage["kv_budget_bytes"] // (2 * 2**20)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    gpu=st.sampled_from(["h100-80gb", "h200", "a100-80gb", "b200"]),
    utilization=st.sampled_from(["0.5", "0.8", "0.9", "0.95", "1"]),
    tp=st.sampled_from(["1", "2", "4"]),
)
def test_the_breakdown_adds_up_to_the_gpu_memory(
    capsys: pytest.CaptureFixture[str], gpu: str, utilization: str, tp: str
) -> None:
    report = plan_json(
        capsys,
        "qwen3-8b",
        "--gpu",
        gpu,
        "--gpu-memory-utilization",
        utilization,
        "--tp",
        tp,
        "--max-model-len",
        "8192",
    )
    for stage in report["memory_per_gpu"]:
        parts = (
            stage["weights_bytes"]
            + stage["activation_bytes"]
            + stage["non_torch_bytes"]
            + stage["kv_bytes_allocated"]
            + stage["free_bytes"]
            + stage["reserved_bytes"]
        )
        assert parts == gpu_catalog()[gpu].memory_bytes
        # The parts that are not remainders: each rank holds at least its 1/TP of the
        # checkpoint (replicated norms, padded vocabulary), and no more than a few percent
        # over it for this model; the KV cache is whole blocks, leaving less than one.
        checkpoint = report["weights"]["checkpoint_bytes"]
        assert checkpoint <= stage["weights_bytes"] * int(tp) <= checkpoint * 1.01
        blocks = sum(pool["num_blocks"] * pool["block_bytes"] for pool in report["pools"])
        assert stage["kv_bytes_allocated"] == blocks
        assert 0 <= stage["free_bytes"] < max(pool["block_bytes"] for pool in report["pools"])
        assert stage["free_bytes"] >= 0 and stage["kv_bytes_allocated"] <= stage["kv_budget_bytes"]


def test_pipeline_stages_each_get_the_budget_their_own_weights_leave(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = plan_json(capsys, "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "2", "--pp", "2")
    first, last = report["memory_per_gpu"]
    assert first["weights_bytes"] != last["weights_bytes"]  # embedding vs final norm + head
    budgets = [s["kv_budget_bytes"] for s in report["memory_per_gpu"]]
    assert report["kv_budget_bytes"] == budgets[report["bottleneck_stage"]]
    assert report["overheads"]["non_torch_bytes"] == round(2.10 * 2**30)


def test_weights_that_do_not_fit_name_the_smallest_tp_that_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = fails(capsys, "llama-3.1-70b", "--gpu", "h100-80gb")
    assert "the weights do not fit at TP 1" in err
    # TP 2 holds the weights but leaves 1.98 GiB, less than one 128k request (10 GiB a rank).
    assert "holds them and one request of max_model_len tokens is 4: pass --tp 4" in err
    err = fails(capsys, "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "2")
    assert "pass --max-model-len 12976" in err and "or pass --tp 4" in err
    assert plan_json(capsys, "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "4")["num_blocks"] > 0
    err = fails(capsys, "llama-3.1-70b", "--gpu", "a100-40gb", "--tp", "2", "--pp", "2")
    assert "on pipeline stage 1 at TP 2" in err and "pass --tp 4" in err
    err = fails(capsys, "llama-3.1-70b", "--gpu-memory", "4GiB", "--max-model-len", "4096")
    assert "no TP up to 64 that vLLM accepts for this model holds them" in err


def test_the_tp_search_only_names_tps_vllm_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    from kvspec_core.deployment.gpu_budget import tp_candidates

    # Nemotron-H-56B: 8 Mamba groups (MambaMixer2 asserts n_groups % TP == 0), 8 KV heads.
    assert tp_candidates(load_preset("nemotron-h-56b")) == [1, 2, 4, 8]
    err = fails(capsys, "nemotron-h-56b", "--gpu-memory", "12GiB", "--max-model-len", "4096")
    assert "no TP up to 8 that vLLM accepts" in err and "--tp 32" not in err
    # Whisper names its heads per side (20 each): TP 8 does not divide them.
    assert tp_candidates(load_preset("whisper-large-v3")) == [1, 2, 4]
    # Qwen2.5-7B: 28 heads, 4 KV heads.
    assert tp_candidates(load_preset("qwen2.5-7b")) == [1, 2, 4]
    # A --tp vLLM refuses is refused too, naming why and the TPs it takes.
    err = fails(capsys, "nemotron-h-56b", "--gpu", "h100-80gb", "--tp", "16")
    assert "--tp 16: vLLM refuses it" in err and "n_groups 8" in err and "1, 2, 4, 8" in err


def test_overheads_larger_than_the_gpu_are_not_met_with_more_gpus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = fails(capsys, "qwen3-8b", "--gpu", "h100-80gb", "--overhead", "100GiB")
    assert "the overheads alone take all of it" in err and "--pp" not in err


def test_overrides_replace_the_catalog_and_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(
        capsys, "qwen3-8b", "--gpu-memory", "24GiB", "--overhead", "1GiB", "--max-model-len", "8192"
    )
    assert report["gpu"]["name"] == "custom" and report["gpu"]["memory_bytes"] == 24 * 2**30
    assert report["overheads"]["activation_bytes"] + report["overheads"]["non_torch_bytes"] == 2**30
    assert report["overheads"]["basis"] == "--overhead"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--memory", "40GiB", "--gpu", "h100-80gb"], "give one of them"),
        ([], "needs --memory SIZE"),
        (["--gpu", "h100"], "is not in the GPU catalog"),
        (["--gpu", "h100-80gb", "--gpu-memory", "80 parsecs"], "--gpu-memory '80 parsecs'"),
        (["--gpu", "h100-80gb", "--overhead=-1GiB"], "--overhead '-1GiB' is negative"),
        (["--memory", "40GiB", "--overhead", "1GiB"], "--overhead applies to --gpu"),
        (["--memory", "40GiB", "--gpu-memory-utilization", "0.5"], "add --gpu NAME"),
    ],
)
def test_bad_input_is_refused_naming_the_option_and_the_fix(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    assert expected in fails(capsys, "qwen3-8b", *args)


@pytest.mark.parametrize("value", ["0", "1.5", "nan", "ninety", "٠.٩", "0.9_5", "9e-1", "inf"])
def test_a_utilization_outside_0_1_is_refused(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:  # argparse's own refusal
        main(["plan", "qwen3-8b", "--gpu", "l4", "--gpu-memory-utilization", value])
    assert exit_info.value.code == 2
    assert "give a number in (0, 1]" in capsys.readouterr().err


def test_the_plot_draws_one_curve_per_tp_that_fits(tmp_path: Path) -> None:
    import argparse

    from kvspec_core.cli.gpu_plan import gpu_plot_curves
    from kvspec_core.models.catalog import resolve_model
    from kvspec_core.models.normalized import normalize_config
    from kvspec_core.plugins.manager import PluginManager

    resolved = resolve_model("llama-3.1-70b")
    args = argparse.Namespace(
        gpu="h100-80gb",
        gpu_memory=None,
        gpu_memory_utilization=None,
        overhead=None,
        pp=1,
        pp_partition=None,
        block_size=16,
        dcp=1,
        tp=1,
        max_in_flight_tokens=16384,
    )
    manager = PluginManager()
    curves = gpu_plot_curves(
        args, resolved, normalize_config(resolved.config), ["auto"], [4096, 131072], manager
    )
    assert list(curves) == ["TP 2", "TP 4", "TP 8"]  # TP 1 does not hold the weights
    at_4096 = [dict(points)[4096] for points in curves.values()]
    assert at_4096 == sorted(at_4096) and at_4096[0] > 0  # more GPUs, more room
    target = tmp_path / "tp.png"
    assert (
        main(["plan", "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "4", "--plot", str(target)])
        == 0
    )
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_draws_the_tps_that_fit_even_when_tp_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "gemma.png"
    err = fails(capsys, "gemma-2-9b", "--gpu", "l4", "--plot", str(target))
    # TP 1 does not hold the weights (the error stands), but the plot is every TP that does.
    assert "the weights do not fit at TP 1" in err and "pass --tp 2" in err
    assert f"--plot drew TP 2, TP 4, TP 8 in {target}" in err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    nothing = tmp_path / "none.png"
    err = fails(capsys, "llama-3.1-70b", "--gpu-memory", "2GiB", "--plot", str(nothing))
    assert "no TP up to 8 fits, nothing drawn" in err and not nothing.exists()


def test_an_ascii_utilization_with_spaces_is_read(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(
        capsys, "qwen3-8b", "--gpu", "h100-80gb", "--gpu-memory-utilization", " 0.95 "
    )
    assert report["gpu"]["utilization"] == 0.95


@pytest.mark.parametrize("zero", ["0", "0GiB", " 0.0 MiB "])
def test_an_overhead_of_zero_is_taken_and_labelled_as_the_override(
    capsys: pytest.CaptureFixture[str], zero: str
) -> None:
    report = plan_json(capsys, "qwen3-8b", "--gpu", "h100-80gb", "--overhead", zero)
    assert report["overheads"]["activation_bytes"] == report["overheads"]["non_torch_bytes"] == 0
    stage = report["memory_per_gpu"][0]
    assert stage["kv_budget_bytes"] == report["gpu"]["usable_bytes"] - stage["weights_bytes"]
    main(["plan", "qwen3-8b", "--gpu", "h100-80gb", "--overhead", zero])
    table = capsys.readouterr().out
    assert "\n--overhead " in table and "activation peak" not in table
    assert "unknown unit 'XB'" in fails(capsys, "qwen3-8b", "--gpu", "l4", "--overhead", "0XB")


def test_in_flight_tokens_default_to_the_overheads_calibration_and_more_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found in review: --max-in-flight-tokens changed nothing in the GPU budget, though
    vLLM's activation peak is a forward of that many tokens (the table's is at 8,192)."""
    assert plan_json(capsys, "llama-3.1-8b", "--gpu", "h100-80gb")["max_in_flight_tokens"] == 8192
    error = fails(capsys, "llama-3.1-8b", "--gpu", "h100-80gb", "--max-in-flight-tokens", "16384")
    assert "measured at 8,192 batched tokens" in error and "--overhead SIZE" in error
    # With a measured --overhead any batch is planned; without --gpu the default is 16,384.
    measured = plan_json(
        capsys,
        "llama-3.1-8b",
        "--gpu",
        "h100-80gb",
        "--max-in-flight-tokens",
        "16384",
        "--overhead",
        "3GiB",
    )
    assert measured["max_in_flight_tokens"] == 16384
    assert plan_json(capsys, "llama-3.1-8b", "--memory", "40GiB")["max_in_flight_tokens"] == 16384


def test_a_vision_tower_the_config_does_not_describe_is_said_to_be_assumed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found in review: Llama-4-Scout's preset (trimmed, no vision_config) was counted with
    transformers' default vision tower, 417M parameters short of the checkpoint's, silently."""
    scout = plan_json(
        capsys, "llama-4-scout", "--gpu", "h100-80gb", "--tp", "4", "--max-model-len", "262144"
    )
    assert "no vision_config" in scout["weights"]["assumed"]
    assert plan_json(capsys, "llama-3.1-8b", "--gpu", "h100-80gb")["weights"]["assumed"] is None
    assert (
        main(
            ["plan", "llama-4-scout", "--gpu", "h100-80gb", "--tp", "4"]
            + ["--max-model-len", "262144"]
        )
        == 0
    )
    assert "; assumed: the config has no vision_config" in capsys.readouterr().out
