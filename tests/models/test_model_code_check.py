"""kvspec's layer typing against the model code transformers builds on the meta device: the
real configs, the bundled presets and transformers' own default configs of its hybrid and
windowed model types agree with it; a config kvspec reads differently is refused naming both
readings (the Bamba ``attn_layer_indices`` class of bug); where the check does not run, the
plan is made from the config as before."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from model_testkit import type_string, typed

from kvspec_core.errors import ConfigError
from kvspec_core.models import layer_mixers, layer_typing, model_code_cache, model_code_check
from kvspec_core.models.catalog import load_preset, preset_names
from kvspec_core.models.encoder_decoder import is_encoder_decoder
from kvspec_core.models.layer_typing import decoder_layer_slots, num_layers
from kvspec_core.models.model_code_cache import (
    CACHE_DIR_VARIABLE,
    READINGS_FOLDER,
    cache_folder,
    entry_key,
)
from kvspec_core.models.model_code_check import (
    CHECK_SWITCH_VARIABLE,
    MAX_CHECKED_LAYERS,
    _read_model_code,
    kvspec_labels,
    model_code_reading,
)
from kvspec_core.models.normalized import normalize_config

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "fixtures"
SHARED_CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "model-configs"

#: What the model code builds for each bundled decoder-only preset, read from its modules.
PRESET_READINGS = {
    "llama-3.1-8b": {"full_attention": 32},
    "llama-3.1-70b": {"full_attention": 80},
    "qwen2.5-7b": {"full_attention": 28},
    "qwen3-8b": {"full_attention": 36},
    "qwen3-30b-a3b": {"full_attention": 48},
    "mistral-7b": {"sliding_attention (window 4096)": 32},
    "phi-3-mini": {"sliding_attention (window 2047)": 32},
    "gemma-2-9b": {"sliding_attention (window 4096)": 21, "full_attention": 21},
    "gpt-oss-20b": {"sliding_attention (window 128)": 12, "full_attention": 12},
    "deepseek-v2-lite": {"mla_attention": 27},
    "llama-4-scout": {"chunked_attention (window 8192)": 36, "full_attention": 12},
    "jamba-1.5-mini": {"mamba": 28, "full_attention": 4},
    "nemotron-h-56b": {"mamba": 54, "no cache": 54, "full_attention": 10},
    "qwen3-next-80b": {"linear_attention": 36, "full_attention": 12},
}

#: transformers' model types with hybrid or windowed layers whose default config kvspec types
#: as the model code does (state mixers, sliding / chunked windows, MLA, parallel hybrids).
AGREEING_DEFAULT_TYPES = (
    "jamba",
    "nemotron_h",
    "granitemoehybrid",
    "falcon_h1",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "olmo_hybrid",
    "lara_mini",
    "kimi_linear",
    "minimax",
    "bailing_hybrid",
    "bamba",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "cohere2",
    "gpt_oss",
    "mistral",
    "mixtral",
    "llama4",
    "llama4_text",
    "exaone4",
    "olmo3",
    "mimo_v2_flash",
    "deepseek_v2",
    "deepseek_v3",
    "lfm2",
    "modernbert-decoder",
    "vaultgemma",
)
#: Default configs kvspec reads differently from the model code: refused, naming what the
#: model builds. Each was a plausible, wrong plan (or a wrong layer count) before the check.
DISAGREEING_DEFAULT_TYPES = {
    # attention_types: every other layer is local (window 256); kvspec ignores the field.
    "gpt_neo": r"layer 1: kvspec reads full_attention, the model code builds "
    r"sliding_attention \(window 256\)",
    # two MLA attentions per layer.
    "longcat_flash": r"layer 0: kvspec reads mla_attention, the model code builds "
    r"mla_attention \+ mla_attention",
}
#: Recurrent-only model types: refused by kvspec's typing itself (with or without
#: transformers); the model-code check refuses them too when kvspec's refusal is removed.
STATE_SPACE_ONLY_READINGS = {
    "mamba": "mamba",
    "mamba2": "mamba",
    "falcon_mamba": "mamba",
    "recurrent_gemma": "recurrent_block",
    # a mixer class the check does not know reads as no cache: refused, never passed.
    "xlstm": r"no cache-holding mixer \(its modules: .*xLSTMLayer",
}


def readings(config: dict[str, Any]) -> tuple[list[tuple[str, ...] | None], Any]:
    """(kvspec's labels, the model code's reading) of a decoder-only config."""
    source = normalize_config(config)
    count = num_layers(source.fields)
    ours = kvspec_labels(decoder_layer_slots(source.fields), source.fields, count)
    return ours, model_code_reading(source.raw, count)


def summary(layers: Any) -> dict[str, int]:
    return dict(Counter(" + ".join(layer) or "no cache" for layer in layers))


def default_config(model_type: str) -> dict[str, Any]:
    return dict(transformers.CONFIG_MAPPING[model_type]().to_dict())


@pytest.mark.parametrize("name", sorted(PRESET_READINGS))
def test_every_preset_agrees_with_its_model_code(name: str) -> None:
    ours, reading = readings(load_preset(name))
    assert reading is not None
    assert summary(reading.layers) == PRESET_READINGS[name]
    assert ours == list(reading.layers)


def test_every_decoder_only_preset_is_covered() -> None:
    decoder_only = {n for n in preset_names() if not is_encoder_decoder(load_preset(n))}
    assert decoder_only == set(PRESET_READINGS)


@pytest.mark.skipif(not SHARED_CONFIGS.is_dir(), reason="no shared/ beside the checkout")
def test_every_shared_config_agrees_with_its_model_code() -> None:
    checked = 0
    for path in sorted(SHARED_CONFIGS.glob("*.json")):
        config = json.loads(path.read_text())
        if is_encoder_decoder(config):
            continue
        ours, reading = readings(config)
        assert reading is not None and ours == list(reading.layers), path.name
        checked += 1
    assert checked == 14


@pytest.mark.parametrize(
    "name",
    [
        "google__gemma-3-4b-it",
        "ibm-granite__granite-4.0-h-small",
        "ibm-ai-platform__Bamba-9B",
    ],
)
def test_hub_fixtures_agree_with_their_model_code(name: str) -> None:
    ours, reading = readings(json.loads((FIXTURES / f"{name}.json").read_text()))
    assert reading is not None and ours == list(reading.layers)


@pytest.mark.parametrize("model_type", AGREEING_DEFAULT_TYPES)
def test_transformers_default_configs_agree(model_type: str) -> None:
    ours, reading = readings(default_config(model_type))
    assert reading is not None
    assert ours == list(reading.layers)


@pytest.mark.parametrize("model_type", sorted(DISAGREEING_DEFAULT_TYPES))
def test_transformers_default_configs_kvspec_misreads_are_refused(model_type: str) -> None:
    with pytest.raises(
        ConfigError,
        match=(
            f"kvspec's layer typing disagrees with transformers' .* at "
            f"{DISAGREEING_DEFAULT_TYPES[model_type]}"
        ),
    ):
        typed(default_config(model_type))


@pytest.mark.parametrize("model_type", sorted(STATE_SPACE_ONLY_READINGS))
def test_recurrent_only_models_are_refused_by_the_typing_and_by_the_model_code(
    model_type: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match=f"model_type '{model_type}' has no attention layers"):
        typed(default_config(model_type))
    monkeypatch.setattr(layer_typing, "STATE_SPACE_ONLY_MODEL_TYPES", frozenset())
    with pytest.raises(
        ConfigError,
        match=(
            f"layer 0: kvspec reads full_attention, the model code builds "
            f"{STATE_SPACE_ONLY_READINGS[model_type]}"
        ),
    ):
        typed(default_config(model_type))


@pytest.mark.usefixtures("without_transformers")
def test_without_transformers_bamba_without_attention_indices_is_all_mamba() -> None:
    config = {k: v for k, v in bamba_9b().items() if k != "attn_layer_indices"}
    assert type_string(config) == "M" * 32


def bamba_9b() -> dict[str, Any]:
    return json.loads((FIXTURES / "ibm-ai-platform__Bamba-9B.json").read_text())


def test_mutation_a_field_kvspec_ignores_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Last turn's bug put back: kvspec ignoring Bamba's attn_layer_indices (every layer
    attention) is caught by the model code, which builds Mamba there."""

    def ignoring_indices(config: Any, count: int) -> list[str | None]:
        return ["attention"] * count

    monkeypatch.setattr(layer_mixers, "_from_attn_layer_indices", ignoring_indices)
    with pytest.raises(
        ConfigError,
        match=(
            r"disagrees with transformers' BambaForCausalLM at layer 0: kvspec reads "
            r"full_attention, the model code builds mamba \(its modules: .*BambaMixer.*\)\. "
            r"kvspec reads 32 x full_attention; the model code 29 x mamba, 3 x full_attention"
        ),
    ):
        typed(bamba_9b())


def test_mutation_a_misread_sliding_layer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvspec reading Gemma-2's global layers as sliding ones."""
    monkeypatch.setattr(
        layer_mixers,
        "LAYER_TYPE_ALIASES",
        {**layer_mixers.LAYER_TYPE_ALIASES, "full_attention": "sliding_attention"},
    )
    with pytest.raises(
        ConfigError,
        match=(
            r"at layer 1: kvspec reads sliding_attention \(window 4096\), the model code "
            r"builds full_attention"
        ),
    ):
        typed(load_preset("gemma-2-9b"))


@pytest.mark.usefixtures("without_transformers")
def test_without_transformers_the_check_is_skipped_and_plans_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        layer_mixers, "_from_attn_layer_indices", lambda config, count: ["attention"] * count
    )
    config = {k: v for k, v in bamba_9b().items()}
    assert type_string(config) == "F" * 32  # the misreading is not caught without transformers


def test_an_unknown_model_type_is_not_checked() -> None:
    config = {**load_preset("llama-3.1-8b"), "model_type": "not_a_transformers_type"}
    source = normalize_config(config)
    assert not source.transformers_filled
    assert type_string(config) == "F" * 32


def test_switched_off_plans_from_the_config_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_SWITCH_VARIABLE, "off")
    assert type_string(default_config("gpt_neo")) == "F" * 24
    monkeypatch.setenv(CHECK_SWITCH_VARIABLE, "maybe")
    with pytest.raises(ConfigError, match=f"{CHECK_SWITCH_VARIABLE}='maybe'; it must be 'on'"):
        typed(load_preset("llama-3.1-8b"))
    # The words every kvspec switch takes (found by review: only lowercase on/off were).
    for off in ("OFF", "0", "false", " no "):
        monkeypatch.setenv(CHECK_SWITCH_VARIABLE, off)
        assert type_string(default_config("gpt_neo")) == "F" * 24
    for on in ("ON", "1", "true", ""):
        monkeypatch.setenv(CHECK_SWITCH_VARIABLE, on)
        with pytest.raises(ConfigError, match="disagrees with transformers"):
            typed(default_config("gpt_neo"))


def test_a_model_transformers_cannot_build_is_refused_saying_how_to_skip() -> None:
    # transformers' own default Ministral config has no RoPE base: its model cannot be built.
    with pytest.raises(
        ConfigError,
        match=(
            r"model_type 'ministral', and building it failed \(TypeError: .*\); fix the "
            rf"config, or plan from the config alone with {CHECK_SWITCH_VARIABLE}=off"
        ),
    ):
        typed(default_config("ministral"))


def test_a_layer_count_the_model_does_not_have_is_refused() -> None:
    config = default_config("hrm_text")
    with pytest.raises(
        ConfigError,
        match=r"declares 128 decoder layers but transformers' "
        r"HrmTextForCausalLM built no layer list",
    ):
        typed(config)


def test_a_config_planned_again_is_not_rebuilt() -> None:
    config = load_preset("nemotron-h-56b")
    typed(config)
    before = _read_model_code.cache_info()
    typed(config)
    after = _read_model_code.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


@pytest.fixture
def fresh_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty disk cache and no reading in memory, as in a new ``kvspec plan``."""
    monkeypatch.setenv(CACHE_DIR_VARIABLE, str(tmp_path))
    _read_model_code.cache_clear()
    return tmp_path / READINGS_FOLDER


def test_a_reading_is_read_back_from_disk_without_building_the_model(
    fresh_process: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = readings(load_preset("nemotron-h-56b"))[1]
    assert len(list(fresh_process.glob("*.json"))) == 1
    _read_model_code.cache_clear()

    def no_build(config_json: str, count: int) -> None:
        raise AssertionError("the model was built again")

    monkeypatch.setattr(model_code_check, "build_reading", no_build)
    assert readings(load_preset("nemotron-h-56b"))[1] == built


@pytest.mark.parametrize(
    "damage", ["{not json", '{"model_class": "X", "layers": [], "modules": []}', "[1, 2]"]
)
def test_a_damaged_entry_is_ignored_and_rebuilt(fresh_process: Path, damage: str) -> None:
    built = readings(load_preset("jamba-1.5-mini"))[1]
    (entry,) = fresh_process.glob("*.json")
    entry.write_text(damage)
    _read_model_code.cache_clear()
    assert readings(load_preset("jamba-1.5-mini"))[1] == built
    assert json.loads(entry.read_text())["model_class"] == "JambaForCausalLM"


def test_an_empty_cache_folder_setting_writes_nothing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CACHE_DIR_VARIABLE, "")
    monkeypatch.chdir(tmp_path)
    _read_model_code.cache_clear()
    assert readings(load_preset("llama-3.1-8b"))[1] is not None
    assert cache_folder() is None and not any(tmp_path.iterdir())


def test_another_transformers_version_reads_the_model_code_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = entry_key("{}", 4, "rules")
    monkeypatch.setattr(model_code_cache, "_transformers_version", lambda: "0.0.1")
    assert entry_key("{}", 4, "rules") != before


def test_changed_reading_rules_read_the_model_code_again() -> None:
    assert entry_key("{}", 4, "rules") != entry_key("{}", 4, "rules, edited")


def test_configs_deeper_than_any_published_model_are_not_built() -> None:
    deep = {**load_preset("llama-3.1-8b"), "num_hidden_layers": MAX_CHECKED_LAYERS + 1}
    assert readings(deep)[1] is None
    published_depth = {**load_preset("llama-3.1-8b"), "num_hidden_layers": 40}
    assert readings(published_depth)[1] is not None


def test_the_model_codes_kv_widths_are_read() -> None:
    # Llama-3.1-8B: 8 KV heads x 128 per layer; MLA and state layers have none to compare.
    _, llama = readings(load_preset("llama-3.1-8b"))
    assert llama is not None and llama.kv_widths == (((1024, 1024),),) * 32
    _, jamba = readings(load_preset("jamba-1.5-mini"))
    assert jamba is not None and sorted(set(jamba.kv_widths)) == [(), ((1024, 1024),)]
    _, deepseek = readings(load_preset("deepseek-v2-lite"))
    assert deepseek is not None and set(deepseek.kv_widths) == {()}


def test_kv_widths_kvspec_misreads_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # kvspec (as vLLM) reads num_kv_heads before num_key_value_heads; Llama's model code
    # reads only the latter: a cache of 2 heads for a model projecting 8 would be planned.
    config = {**load_preset("llama-3.1-8b"), "num_kv_heads": 2}
    with pytest.raises(
        ConfigError,
        match=r"layer model\.layers\.0 \(full_attention\): kvspec reads K/V widths of 256 / 256 "
        r"\(2 KV heads x head size 128\), but transformers' LlamaForCausalLM projects "
        r"1024 / 1024",
    ):
        typed(config)
    monkeypatch.setenv(CHECK_SWITCH_VARIABLE, "off")
    assert typed(config).layers[0].attention.total_kv_heads == 2  # type: ignore[union-attr]
