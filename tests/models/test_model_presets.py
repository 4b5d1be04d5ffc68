"""The bundled presets: byte-for-byte copies of the published configs, found by name."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from kvspec_core.errors import ConfigError, UnknownNameError
from kvspec_core.models.catalog import (
    PRESET_SOURCES,
    close_preset_names,
    preset_names,
    preset_text,
    resolve_model,
)

#: sha256 of each bundled file as published (``/work/shared/model-configs/<org>__<model>.json``
#: at the time of bundling): a changed byte fails here, wherever the tests run.
PUBLISHED_SHA256 = {
    "deepseek-v2-lite": "790ec944d076d93b68951df1d2595a6328ed9bc9ca35126c3cf64d0c30c31441",
    "gemma-2-9b": "8ecc124513fdb0bb31bf51b4f0dd6c8658a68296dc8cd30af612205ff4a1bc49",
    "gpt-oss-20b": "afeaac8ba417e457b97e896dbaaed6f3b33870b968060b59453cda60c6adbd4c",
    "jamba-1.5-mini": "2490d78335e7e935b1f9a031fa7788c5894e38833675ab7aa32cd07dcdd3952d",
    "llama-3.1-70b": "5866f0abbb3050fd6948c0afde03651b2445a16480338ff01dc11d4a12ccd3f2",
    "llama-3.1-8b": "29e4c210b0d6ac178b16b2a255a568bdb23b581e50ca1ef6a6d071dd85704e6e",
    "llama-4-scout": "b58ddb5d31b8eeae5e86ce0eabdbf9108c7dcb51b86b986e4880c6b67e8a324f",
    "mistral-7b": "cf25cdf4719f181d1d1d371973285d9afe9afde0d0c6a6fd48de857555ce1e0d",
    "nemotron-h-56b": "4db4f4ccd945ff562b01374c67c7a369ca691c04b3b000cbfa09e7b4f36d71bd",
    "phi-3-mini": "93b8ac65a3a142a33d492fdfc14461d86aa6e8c7701f188a0f42d8daa74346af",
    "qwen2.5-7b": "7463bb0ea78315365e6c6b74de4e73bbcc8359dfb0c5a737584e077d42c0b03c",
    "qwen3-30b-a3b": "2850ddb3bf7aecad20b611e2d44f3077fc8193f4827c93beddd4c02ad63c2297",
    "qwen3-8b": "f7c4eadfbbf522470667b797a3c89be2524832d2d599797248dc304fff447c30",
    "qwen3-next-80b": "39a8676a19151719ed769532c68a48de1c82ad20443f734ab591b50412e13950",
    "whisper-large-v3": "5b4de7915119e3900797bcde484f1a7b22ff21de23dd0c733597ec569af0167c",
}
#: The repository's sibling ``shared/`` folder (present in development and CI checkouts).
SHARED_CONFIGS = Path(__file__).resolve().parents[3] / "shared" / "model-configs"


def test_every_preset_is_bundled_unchanged() -> None:
    assert sorted(preset_names()) == sorted(PUBLISHED_SHA256)
    for name in preset_names():
        digest = hashlib.sha256(preset_text(name).encode("utf-8")).hexdigest()
        assert digest == PUBLISHED_SHA256[name], name


@pytest.mark.skipif(
    not SHARED_CONFIGS.is_dir(),
    reason="no shared/ beside the checkout; the pinned digests above stand in",
)
def test_presets_match_the_shared_configs_where_that_folder_exists() -> None:
    bundled = {hashlib.sha256(preset_text(n).encode()).hexdigest() for n in preset_names()}
    shared = {hashlib.sha256(p.read_bytes()).hexdigest() for p in SHARED_CONFIGS.glob("*.json")}
    assert bundled == shared


def test_preset_sources_name_their_hugging_face_repository() -> None:
    assert PRESET_SOURCES["deepseek-v2-lite"] == "deepseek-ai/DeepSeek-V2-Lite"
    assert all("/" in source for source in PRESET_SOURCES.values())


def test_resolve_a_preset_a_file_and_a_folder(tmp_path: Path) -> None:
    resolved = resolve_model("qwen3-8b")
    assert resolved.preset and resolved.config["num_hidden_layers"] == 36
    (tmp_path / "config.json").write_text(preset_text("qwen3-8b"))
    for argument in (str(tmp_path), str(tmp_path / "config.json")):
        by_path = resolve_model(argument)
        assert not by_path.preset and by_path.config == resolved.config


def test_an_unknown_preset_lists_close_names() -> None:
    with pytest.raises(UnknownNameError, match=re.escape("close preset names: llama-3.1-8b")):
        resolve_model("llama-3.1-8")
    assert "qwen3-8b" in close_preset_names("qwen3-8")
    with pytest.raises(UnknownNameError, match="no preset name is close"):
        resolve_model("zzzzzz")


def test_a_missing_config_path_is_refused() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model("/no/such/config.json")


@pytest.mark.parametrize("model", ["", "   "])
def test_an_empty_model_argument_is_refused_not_read_as_the_current_folder(
    model: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Path("") is ".": without the check an empty MODEL would plan whatever config.json the
    # current folder happens to hold.
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 1}')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="MODEL is empty"):
        resolve_model(model)
