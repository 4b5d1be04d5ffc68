"""Entry point of kvspec-hisparse: the hook implementations kvspec-core calls.

HiSparse claims no model layer: its groups are derived by the planner from the layers'
own specs (the source and indexer groups wrap them; hot and resident pages replicate them).
"""

from __future__ import annotations

from kvspec_core.plugins.contract import hookimpl
from kvspec_core.plugins.hookspecs import RegisterSpecKind
from kvspec_hisparse.groups import HiSparseGroupSpec
from kvspec_hisparse.runtime_rules import kvspec_register_runtime_rules  # noqa: F401  (a hook)
from kvspec_hisparse.specs import HiSparseHotSpec, HiSparseResidentSpec

#: The hook contract this plugin was written for (kvspec_core.CONTRACT_VERSION at the time).
kvspec_contract_version = 1


@hookimpl
def kvspec_register_spec_kinds(register: RegisterSpecKind) -> None:
    register(HiSparseHotSpec)
    register(HiSparseResidentSpec)
    register(HiSparseGroupSpec)
