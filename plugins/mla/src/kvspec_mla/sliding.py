"""Sliding-window attention over an MLA latent cache (DeepSeek-V4's SWA layers).

Sized like any sliding window (kvspec-sliding-window's admission cap), paged like MLA (one
latent per token, packed ``*_ds_mla`` records, alignment padding). With ``bounded_replay``
the group is not prefix cached; a resumed request replays the last window instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import attrs

from kvspec_core.specs.base import KVSpec
from kvspec_core.validation import is_bool, non_negative_int, one_of, optional, positive_int
from kvspec_mla.formats import MODEL_VERSIONS
from kvspec_mla.mla_fields import MLAPaging, check_cache_dtype_str
from kvspec_sliding_window.specs import SlidingWindowSpec

if TYPE_CHECKING:
    from kvspec_core.specs.base import SpecKinds


@attrs.frozen(kw_only=True)
class SlidingWindowMLASpec(MLAPaging, SlidingWindowSpec):
    """A sliding window of MLA latents.

    Layers merge when every field agrees. They share a uniform-type group only with
    sliding-window MLA layers of the same window and the same replay policy.

    Attributes:
        head_size_v: 0: the latent serves as both K and V.
        cache_dtype_str / alignment / model_version: as for :class:`MLAAttentionSpec`.
        bounded_replay: the group is not prefix cached; a cache hit replays the last
            ``sliding_window`` tokens (DeepSeek-V4.1).
    """

    kind: ClassVar[str] = "sliding_window_mla"

    head_size_v: int = attrs.field(default=0, validator=non_negative_int)
    cache_dtype_str: str | None = attrs.field(default=None, validator=check_cache_dtype_str)
    alignment: int | None = attrs.field(default=None, validator=optional(positive_int))
    model_version: str | None = attrs.field(default=None, validator=one_of(*MODEL_VERSIONS))
    bounded_replay: bool = attrs.field(default=False, validator=is_bool)

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay

    @property
    def prefix_replay_tokens(self) -> int:
        return self.sliding_window if self.bounded_replay else 0

    def is_uniform_with(self, specs: Mapping[str, KVSpec], registry: SpecKinds) -> bool:
        return all(
            isinstance(spec, SlidingWindowMLASpec)
            and spec.sliding_window == self.sliding_window
            and spec.bounded_replay == self.bounded_replay
            for spec in specs.values()
        )
