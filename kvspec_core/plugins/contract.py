"""The hook contract version and the pluggy markers plugins use.

Bump :data:`CONTRACT_VERSION` whenever a hook's signature or meaning changes; a plugin
declares the version it was written for as ``kvspec_contract_version`` and a mismatch is
refused, so a plugin never runs against hooks it was not written for.
"""

from __future__ import annotations

import pluggy

#: The hook contract this core implements.
CONTRACT_VERSION = 1
#: pluggy project name; also the prefix of every hook.
PROJECT_NAME = "kvspec"
#: Entry-point group plugins are found in.
ENTRY_POINT_GROUP = "kvspec.plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
