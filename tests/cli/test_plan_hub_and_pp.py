"""``kvspec plan org/name`` from a real local hub cache (HF_HUB_OFFLINE=1, no network) and
``kvspec plan --pp N`` (pipeline stages)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from plan_cli_testkit import fails, plan_json

from kvspec_core.cli.main import main

FIXTURES = Path(__file__).parent.parent / "models" / "fixtures"
GRANITE = FIXTURES / "ibm-granite__granite-4.0-h-small.json"
BAMBA = FIXTURES / "ibm-ai-platform__Bamba-9B.json"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_model(cache: Path, repo_id: str, config: Path, revision: str = REVISION) -> Path:
    """Lay ``config`` out as huggingface_hub caches it: models--org--name/snapshots/<rev>/
    config.json and refs/main naming the revision."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    shutil.copyfile(config, snapshot / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot / "config.json"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_cached_hub_id_plans_like_its_config_file(
    hub_cache: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache_model(hub_cache, "ibm-granite/granite-4.0-h-small", GRANITE)
    from_hub = plan_json(capsys, "ibm-granite/granite-4.0-h-small", "--memory", "40GiB")
    from_file = plan_json(capsys, str(GRANITE), "--memory", "40GiB")
    assert from_hub["source"] == "hub cache" and from_file["source"] == "config file"
    assert from_hub["model"] == "ibm-granite/granite-4.0-h-small"
    for key in ("num_blocks", "max_concurrency", "bytes_allocated", "groups"):
        assert from_hub[key] == from_file[key]


def test_a_cached_config_is_used_without_asking_the_hub_even_online(
    hub_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Online mode in a sandbox with no network: only the cache can answer.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    cache_model(hub_cache, "ibm-ai-platform/Bamba-9B", BAMBA)
    assert plan_json(capsys, "ibm-ai-platform/Bamba-9B", "--memory", "40GiB")["source"] == (
        "hub cache"
    )


def test_a_revision_after_the_id_picks_that_snapshot(
    hub_cache: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache_model(hub_cache, "ibm-ai-platform/Bamba-9B", BAMBA)
    report = plan_json(capsys, f"ibm-ai-platform/Bamba-9B@{REVISION}", "--memory", "40GiB")
    assert [g["kind"] for g in report["groups"]].count("full_attention") == 1
    err = fails(capsys, "ibm-ai-platform/Bamba-9B@v2", "--memory", "40GiB")
    assert "'ibm-ai-platform/Bamba-9B@v2'" in err
    assert "hf download ibm-ai-platform/Bamba-9B config.json --revision v2" in err


def test_hf_home_is_honoured_when_hf_hub_cache_is_unset(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache_model(tmp_path / "hf-home" / "hub", "ibm-ai-platform/Bamba-9B", BAMBA)
    assert plan_json(capsys, "ibm-ai-platform/Bamba-9B", "--memory", "40GiB")["source"] == (
        "hub cache"
    )


def test_an_uncached_id_offline_names_the_id_the_cache_and_the_fix(
    hub_cache: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = fails(capsys, "ibm-granite/granite-4.0-h-tiny", "--memory", "40GiB")
    assert "'ibm-granite/granite-4.0-h-tiny'" in err and str(hub_cache) in err
    assert "HF_HUB_OFFLINE=1" in err
    assert "hf download ibm-granite/granite-4.0-h-tiny config.json" in err


def test_a_local_path_wins_over_a_hub_id_of_the_same_spelling(
    hub_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache_model(hub_cache, "ibm-ai-platform/Bamba-9B", BAMBA)
    local = tmp_path / "work" / "ibm-ai-platform" / "Bamba-9B"
    local.mkdir(parents=True)
    shutil.copyfile(GRANITE, local / "config.json")
    monkeypatch.chdir(tmp_path / "work")
    report = plan_json(capsys, "ibm-ai-platform/Bamba-9B", "--memory", "40GiB")
    assert report["source"] == "config file"
    assert len(report["groups"]) == 10  # Granite's 9 Mamba groups + 1 attention group


def test_a_preset_name_is_never_looked_up_on_the_hub(
    hub_cache: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert plan_json(capsys, "llama-3.1-8b", "--memory", "40GiB")["source"] == "preset"


def test_without_huggingface_hub_a_hub_id_names_the_extra(
    hub_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    err = fails(capsys, "ibm-ai-platform/Bamba-9B", "--memory", "40GiB")
    assert "huggingface_hub is not installed" in err and "kvspec-core[hf]" in err


@pytest.mark.parametrize("model", ["org/a--b", "org/name/extra", "../org/name", "org/.hidden"])
def test_what_cannot_be_a_hub_id_stays_a_missing_path(
    model: str,
    hub_cache: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = fails(capsys, model, "--memory", "40GiB")
    assert "does not exist" in err and "hub" not in err


# Pipeline stages ----------------------------------------------------------------------------


def test_pp_reports_every_stage_and_the_least_concurrency(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = plan_json(capsys, "llama-3.1-70b", "--memory", "40GiB", "--pp", "3")
    assert report["pipeline_parallel_size"] == 3
    stages = report["pipeline_stages"]
    assert [s["layer_range"] for s in stages] == [[0, 27], [27, 54], [54, 80]]
    assert [s["cache_layers"] for s in stages] == [27, 27, 26]
    assert report["max_concurrency"] == min(s["max_concurrency"] for s in stages)
    tightest = stages[report["bottleneck_stage"]]
    assert tightest["layer_range"] == [0, 27]
    # The top-level plan is the tightest stage's: its blocks, groups and bytes.
    assert report["num_blocks"] == tightest["num_blocks"]
    assert len(report["groups"][0]["layers"]) == 27


def test_without_pp_one_stage_holds_the_whole_plan(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(capsys, "jamba-1.5-mini", "--memory", "40GiB")
    (stage,) = report["pipeline_stages"]
    assert report["pipeline_parallel_size"] == 1 and report["bottleneck_stage"] == 0
    assert stage["layer_range"] == [0, 32] and stage["num_blocks"] == report["num_blocks"]
    assert stage["max_concurrency"] == report["max_concurrency"]


def test_pp_table_names_the_stages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama-3.1-8b", "--memory", "40GiB", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "; PP 2" in out and "per stage" in out
    assert "0      0..15" in out and "1      16..31" in out
    assert out.rstrip().endswith("(the least over 2 stages)")


def test_pp_partition_overrides_the_even_split(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(
        capsys, "llama-3.1-8b", "--memory", "40GiB", "--pp", "2", "--pp-partition", "12,20"
    )
    assert [s["cache_layers"] for s in report["pipeline_stages"]] == [12, 20]
    assert report["bottleneck_stage"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pp", "2", "--pp-partition", "10,10"], "covers 20 layers but the model has 32"),
        (["--pp", "3", "--pp-partition", "16,16"], "must give 3 positive layer counts"),
        (["--pp", "33"], "--pp 33 exceeds the model's 32 layers"),
        (["--pp", "2", "--plot", "x.png"], "--plot draws single-stage plans"),
    ],
)
def test_bad_pipeline_arguments_are_one_error_line(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert message in fails(capsys, "llama-3.1-8b", "--memory", "40GiB", *args)


def test_a_stage_that_cannot_hold_one_request_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(capsys, "llama-3.1-70b", "--memory", "20GiB", "--pp", "2")
    assert "pipeline stage 0 (layers 0..39)" in err and "pass --max-model-len" in err
