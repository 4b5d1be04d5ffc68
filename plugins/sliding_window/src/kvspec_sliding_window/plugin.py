"""Entry point of kvspec-sliding-window: the hook implementations kvspec-core calls."""

from __future__ import annotations

#: The hook contract this plugin was written for (kvspec_core.CONTRACT_VERSION at the time).
kvspec_contract_version = 1
