"""Loading plugins through entry points: allow-list, strict mode, and every loading fault."""

from __future__ import annotations

import pytest

from kvspec_core import CONTRACT_VERSION, PluginError, PluginManager
from kvspec_core.plugins.loading import PluginLoadWarning

FAMILIES = {"mla", "mamba", "sliding_window", "chunked_local", "hisparse"}


def loaded(manager: PluginManager) -> set[str]:
    return {info.name for info in manager.plugins} - {"core"}


def test_unset_allow_list_loads_every_family() -> None:
    manager = PluginManager()
    manager.load_entry_points({})
    assert loaded(manager) >= FAMILIES
    assert manager.failures == []


def test_empty_allow_list_loads_none_and_a_list_loads_only_those() -> None:
    manager = PluginManager()
    manager.load_entry_points({"KVSPEC_PLUGINS": ""})
    assert loaded(manager) == set()
    manager = PluginManager()
    manager.load_entry_points({"KVSPEC_PLUGINS": "mla, mamba"})
    assert loaded(manager) == {"mla", "mamba"}


def test_loading_is_idempotent() -> None:
    manager = PluginManager()
    manager.load_entry_points({"KVSPEC_PLUGINS": "mamba"})
    manager.load_entry_points({"KVSPEC_PLUGINS": "mamba"})
    assert [p.name for p in manager.plugins] == ["core", "mamba"]


def test_allow_list_may_name_the_always_loaded_core() -> None:
    manager = PluginManager()
    manager.load_entry_points({"KVSPEC_PLUGINS": "core,mla"})
    assert loaded(manager) == {"mla"} and manager.failures == []


def test_allow_list_naming_a_missing_plugin_warns() -> None:
    manager = PluginManager()
    with pytest.warns(PluginLoadWarning, match="KVSPEC_PLUGINS names 'nope'"):
        manager.load_entry_points({"KVSPEC_PLUGINS": "nope"})


def test_import_failure_is_reported_and_others_load(fake_dist, good_plugin) -> None:
    fake_dist("kvspec-broken", "broken", "kvspec_broken", "raise ImportError('no libfoo.so')\n")
    fake_dist("kvspec-good", "good", "kvspec_good", good_plugin("wide"))
    manager = PluginManager()
    with pytest.warns(PluginLoadWarning) as caught:
        manager.load_entry_points({"KVSPEC_PLUGINS": "broken,good"})
    message = str(caught[0].message)
    assert "'broken'" in message and "kvspec-broken" in message and "no libfoo.so" in message
    assert loaded(manager) == {"good"}
    assert manager.spec_kinds.owner_of("wide") == "good"
    [failure] = manager.failures
    assert (failure.name, failure.distribution, failure.version) == (
        "broken",
        "kvspec-broken",
        "1.0",
    )
    assert "ImportError" in failure.error


def test_strict_mode_makes_a_failure_an_error(fake_dist) -> None:
    fake_dist("kvspec-broken", "broken", "kvspec_broken", "raise ImportError('boom')\n")
    with pytest.raises(
        PluginError, match=r"'broken'.*kvspec-broken.*boom.*KVSPEC_STRICT_PLUGINS=1"
    ):
        PluginManager().load_entry_points(
            {"KVSPEC_PLUGINS": "broken", "KVSPEC_STRICT_PLUGINS": "1"}
        )


def test_raising_registration_hook_keeps_nothing(fake_dist, good_plugin) -> None:
    fake_dist(
        "kvspec-half",
        "half",
        "kvspec_half",
        good_plugin("half_kind")
        + """
    @hookimpl
    def kvspec_register_kv_dtypes(register):
        raise RuntimeError("dtype table missing")
    """,
    )
    manager = PluginManager()
    with pytest.warns(
        PluginLoadWarning, match="raised RuntimeError while registering: dtype table"
    ):
        manager.load_entry_points({"KVSPEC_PLUGINS": "half"})
    assert "half_kind" not in manager.spec_kinds
    assert loaded(manager) == set()


def test_other_contract_version_is_refused_naming_both(fake_dist, good_plugin) -> None:
    fake_dist(
        "kvspec-future", "future", "kvspec_future", good_plugin("future").replace("= 1", "= 99")
    )
    manager = PluginManager()
    with pytest.warns(PluginLoadWarning) as caught:
        manager.load_entry_points({"KVSPEC_PLUGINS": "future"})
    message = str(caught[0].message)
    assert "'future'" in message and "version 99" in message
    assert f"implements version {CONTRACT_VERSION}" in message


def test_undeclared_contract_version_is_refused(fake_dist) -> None:
    fake_dist("kvspec-old", "old", "kvspec_old", "x = 1\n")
    with pytest.warns(PluginLoadWarning, match="does not declare kvspec_contract_version"):
        PluginManager().load_entry_points({"KVSPEC_PLUGINS": "old"})


def test_kind_owned_by_another_plugin_is_refused_naming_both(fake_dist, good_plugin) -> None:
    fake_dist("kvspec-thief", "thief", "kvspec_thief", good_plugin("full_attention"))
    manager = PluginManager()
    with pytest.warns(
        PluginLoadWarning, match="'full_attention'.*'thief'.*already registered by plugin 'core'"
    ):
        manager.load_entry_points({"KVSPEC_PLUGINS": "thief"})
    assert manager.spec_kinds.owner_of("full_attention") == "core"


def test_two_distributions_with_one_entry_point_name_are_not_shadowed(
    fake_dist, good_plugin
) -> None:
    fake_dist("kvspec-twin-a", "twin", "kvspec_twin_a", good_plugin("twin_a"))
    fake_dist("kvspec-twin-b", "twin", "kvspec_twin_b", good_plugin("twin_b"))
    manager = PluginManager()
    with pytest.warns(
        PluginLoadWarning, match="several distributions.*kvspec-twin-a.*kvspec-twin-b"
    ):
        manager.load_entry_points({"KVSPEC_PLUGINS": "twin"})
    assert loaded(manager) == set()


def test_invalid_hook_implementation_is_refused(fake_dist) -> None:
    fake_dist(
        "kvspec-typo",
        "typo",
        "kvspec_typo",
        """
        from kvspec_core import hookimpl
        kvspec_contract_version = 1
        @hookimpl
        def kvspec_register_spec_kind(register):
            pass
    """,
    )
    with pytest.warns(PluginLoadWarning, match="invalid hook implementations"):
        PluginManager().load_entry_points({"KVSPEC_PLUGINS": "typo"})


@pytest.mark.parametrize("value", ["2", "enable", "strict", "ture"])
def test_an_unknown_strict_value_is_refused_not_read_as_off(value: str) -> None:
    """Found in review: any value but 1/true/yes/on silently meant "off"."""
    with pytest.raises(PluginError, match=f"KVSPEC_STRICT_PLUGINS='{value}'.*1, true, yes or on"):
        PluginManager().load_entry_points({"KVSPEC_PLUGINS": "", "KVSPEC_STRICT_PLUGINS": value})
    for off in ("", "0", " False ", "no", "OFF"):
        PluginManager().load_entry_points({"KVSPEC_PLUGINS": "", "KVSPEC_STRICT_PLUGINS": off})


def test_an_entry_point_named_core_is_reported_not_skipped(fake_dist, good_plugin) -> None:
    """Found in review: the core registers itself as 'core', so a third party's entry point
    of that name was skipped without a word and its kinds silently did not exist."""
    fake_dist("kvspec-corelike", "core", "kvspec_corelike", good_plugin("corelike"))
    manager = PluginManager()
    with pytest.warns(PluginLoadWarning, match="'core' is reserved for kvspec-core; rename"):
        manager.load_entry_points({})
    assert "corelike" not in manager.spec_kinds
    [failure] = [f for f in manager.failures if f.name == "core"]
    assert failure.distribution == "kvspec-corelike"


def test_a_contract_mismatch_names_the_distribution_to_upgrade(fake_dist, good_plugin) -> None:
    fake_dist("kvspec-vtwo", "vtwo", "kvspec_vtwo", good_plugin("vtwo").replace("= 1", "= 2"))
    with pytest.warns(PluginLoadWarning, match="install a kvspec-vtwo release built for"):
        PluginManager().load_entry_points({"KVSPEC_PLUGINS": "vtwo"})
