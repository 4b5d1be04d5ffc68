"""Runtime allocator rules of the MLA families.

* ``mla_attention`` / ``hidden_state_cache``: none of their own; the allocator falls back to
  the nearest ancestor kind's, full attention's (every block kept, plain prefix hits).
* ``sliding_window_mla``: the sliding window's rules from kvspec-sliding-window (blocks below
  the window are freed; a hit needs the last window's blocks), registered here so they apply
  even when that plugin is installed but not loaded. A ``bounded_replay`` group is not prefix
  cacheable, so it never reports a hit.
* ``circular_buffer``: one block for the request's life, rewritten in place, never cached.
"""

from __future__ import annotations

from kvspec_core.plugins.contract import hookimpl
from kvspec_core.plugins.hookspecs import RegisterRuntimeRules
from kvspec_core.runtime.rules import SingleBlockRules
from kvspec_sliding_window.runtime_rules import SlidingWindowRules


class CircularBufferRules(SingleBlockRules):
    """The compressed-attention ring: the one block :class:`CircularBufferSpec` admits."""


@hookimpl
def kvspec_register_runtime_rules(register: RegisterRuntimeRules) -> None:
    register("circular_buffer", CircularBufferRules)
    register("sliding_window_mla", SlidingWindowRules)
