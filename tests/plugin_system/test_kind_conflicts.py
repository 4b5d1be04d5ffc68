"""Two installed plugins claiming one spec kind: neither gets it, both are named, and each
keeps its other kinds (strict mode makes the conflict an error)."""

from __future__ import annotations

import pytest

from kvspec_core import PluginError, PluginManager
from kvspec_core.plugins.loading import PluginLoadWarning

_TWO_KINDS = """
    import attrs
    from typing import ClassVar
    from kvspec_core import FullAttentionSpec, hookimpl

    kvspec_contract_version = 1

    @attrs.frozen(kw_only=True)
    class SharedSpec(FullAttentionSpec):
        kind: ClassVar[str] = "shared_kind"

    @attrs.frozen(kw_only=True)
    class OwnSpec(FullAttentionSpec):
        kind: ClassVar[str] = "{own}"

    @hookimpl
    def kvspec_register_spec_kinds(register):
        register(SharedSpec)
        register(OwnSpec)
"""


def install_claimants(fake_dist, *names: str) -> None:  # type: ignore[no-untyped-def]
    for name in names:
        fake_dist(f"kvspec-{name}", name, f"kvspec_{name}", _TWO_KINDS.format(own=f"{name}_only"))


def test_the_kind_is_refused_naming_both_and_other_kinds_load(fake_dist) -> None:
    install_claimants(fake_dist, "alpha", "beta")
    manager = PluginManager()
    with pytest.warns(PluginLoadWarning) as caught:
        manager.load_entry_points({"KVSPEC_PLUGINS": "alpha,beta"})
    (warning,) = [str(w.message) for w in caught]
    assert "'shared_kind'" in warning and "'alpha'" in warning and "'beta'" in warning
    assert "kvspec-alpha" in warning and "kvspec-beta" in warning
    assert "shared_kind" not in manager.spec_kinds
    assert {"alpha_only", "beta_only"} <= set(manager.spec_kinds.kinds())
    infos = {info.name: info for info in manager.plugins}
    assert infos["alpha"].spec_kinds == ("alpha_only",)
    assert infos["beta"].spec_kinds == ("beta_only",)
    # Both lost the kind, so both are listed as failed (found in review: only the one
    # loaded second was, whichever that was by name).
    failed = {failure.name: failure for failure in manager.failures}
    assert set(failed) == {"alpha", "beta"}
    assert failed["alpha"].distribution == "kvspec-alpha"
    assert "'shared_kind'" in failed["alpha"].error
    with pytest.raises(PluginError, match=r"'shared_kind' is claimed by plugins 'alpha'.*'beta'"):
        manager.spec_kinds.class_of("shared_kind")


def test_a_third_claimant_does_not_take_the_refused_kind(fake_dist) -> None:
    install_claimants(fake_dist, "alpha", "beta", "gamma")
    manager = PluginManager()
    with pytest.warns(PluginLoadWarning):
        manager.load_entry_points({"KVSPEC_PLUGINS": "alpha,beta,gamma"})
    assert "shared_kind" not in manager.spec_kinds
    with pytest.raises(PluginError, match="'alpha', 'beta', 'gamma'"):
        manager.spec_kinds.class_of("shared_kind")
    assert {"alpha_only", "beta_only", "gamma_only"} <= set(manager.spec_kinds.kinds())


def test_strict_mode_makes_the_conflict_an_error(fake_dist) -> None:
    install_claimants(fake_dist, "alpha", "beta")
    with pytest.raises(PluginError, match=r"'shared_kind'.*'alpha'.*'beta'"):
        PluginManager().load_entry_points(
            {"KVSPEC_PLUGINS": "alpha,beta", "KVSPEC_STRICT_PLUGINS": "1"}
        )


def test_registering_a_claimed_kind_directly_still_raises(fake_dist) -> None:
    """``register`` called by hand refuses the second claimant at once (its caller decides);
    only entry-point loading, where no one can decide, withdraws the kind from both."""
    import importlib

    install_claimants(fake_dist, "alpha", "beta")
    manager = PluginManager()
    manager.register(importlib.import_module("kvspec_alpha"), "alpha")
    with pytest.raises(PluginError, match="already registered by plugin 'alpha'"):
        manager.register(importlib.import_module("kvspec_beta"), "beta")
    assert manager.spec_kinds.owner_of("shared_kind") == "alpha"
