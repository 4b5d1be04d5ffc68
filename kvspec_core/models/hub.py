"""Hugging Face hub ids (``org/name``, optionally ``org/name@revision``) resolved to a cached
``config.json`` through ``huggingface_hub`` (the optional extra ``kvspec-core[hf]``).

The cache is the one every Hugging Face tool shares: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``,
else ``~/.cache/huggingface/hub``. A config already cached for that revision (``main`` when
none is given) is used as it is, without asking the hub (``hf download org/name config.json``
refreshes it); one not cached is downloaded, unless ``HF_HUB_OFFLINE=1`` forbids it. The
environment is read at each call, so a process that changes it is honoured.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from kvspec_core.errors import ConfigError
from kvspec_core.models.normalized import HF_EXTRA_INSTALL

#: The file a model repository publishes its config in.
HUB_CONFIG_FILE = "config.json"
#: ``namespace/name`` as the hub accepts it (letters, digits, ``-_.``; at most 96 chars; no
#: ``--`` or ``..``), optionally ``@revision`` (a branch, tag or commit).
_HUB_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[\w./-]{1,255}))?$"
)
#: Values of ``HF_HUB_OFFLINE`` that switch offline mode on (as huggingface_hub reads it).
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``model`` reads as a hub id, else ``None``."""
    match = _HUB_ID.match(model)
    if match is None:
        return None
    repo = match["repo"]
    if "--" in repo or ".." in repo or repo.endswith((".git", ".", "-")):
        return None
    return repo, match["revision"]


def hub_cache_dir() -> Path:
    """The hub cache folder the Hugging Face tools use now (``HF_HUB_CACHE`` >
    ``HF_HOME/hub`` > ``~/.cache/huggingface/hub``)."""
    cache = os.environ.get("HF_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path("~/.cache").expanduser()
    return base / "huggingface" / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids downloads."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE_VALUES


def _cached_config(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """The cached config.json of that revision, without touching the network."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, HUB_CONFIG_FILE, cache_dir=cache, revision=revision)
    return Path(found) if isinstance(found, str) else None


@contextlib.contextmanager
def _quiet_hub() -> Iterator[None]:
    """No retry log lines or progress bar on stderr: the outcome is the plan or one error."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )
    from huggingface_hub.utils import logging as hub_logging

    verbosity = hub_logging.get_verbosity()
    bars_were_disabled = are_progress_bars_disabled()
    hub_logging.set_verbosity_error()
    disable_progress_bars()
    try:
        yield
    finally:
        hub_logging.set_verbosity(verbosity)
        if not bars_were_disabled:
            enable_progress_bars()


def hub_config_path(repo_id: str, revision: str | None = None) -> Path:
    """The cached ``config.json`` of ``repo_id`` (downloaded when not cached, unless offline);
    a :class:`ConfigError` naming the id, the cache folder and the fix otherwise."""
    shown = repo_id if revision is None else f"{repo_id}@{revision}"
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ConfigError(
            f"MODEL {shown!r} is not a bundled preset or an existing path, and reads as a "
            f"Hugging Face hub id, but huggingface_hub is not installed: run "
            f"`{HF_EXTRA_INSTALL}`, or pass a config.json path"
        ) from None
    cache = hub_cache_dir()
    offline = hub_offline()
    cached = _cached_config(repo_id, revision, cache)
    if cached is not None:
        return cached
    try:
        with _quiet_hub():
            path = hf_hub_download(
                repo_id,
                HUB_CONFIG_FILE,
                revision=revision,
                cache_dir=cache,
                local_files_only=offline,
            )
    except LocalEntryNotFoundError:
        why = (
            "HF_HUB_OFFLINE=1 forbids downloading it" if offline else "the hub could not be reached"
        )
        pinned = "" if revision is None else f" --revision {revision}"
        raise ConfigError(
            f"MODEL {shown!r} reads as a Hugging Face hub id, but its {HUB_CONFIG_FILE} is not "
            f"in the hub cache {cache} and {why}; fetch it while online (`hf download "
            f"{repo_id} {HUB_CONFIG_FILE}{pinned}`, with HF_HUB_OFFLINE unset), point "
            "HF_HUB_CACHE at the cache that holds it, or pass a config.json path"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as error:
        # Unknown or gated repository, bad revision, unreadable cache.
        raise ConfigError(
            f"MODEL {shown!r} reads as a Hugging Face hub id, but its {HUB_CONFIG_FILE} could "
            f"not be fetched into the hub cache {cache}: {type(error).__name__}: {error}. "
            "Check the id (and HF_TOKEN for gated models), or pass a config.json path"
        ) from None
    return Path(path)
