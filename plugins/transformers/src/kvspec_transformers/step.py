"""One engine step of one request: the tokens it computes and the request's block tables."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(kw_only=True, eq=False)
class StepContext:
    """What every layer adapter needs to know about the step being computed.

    Attributes:
        request_id: the request the step belongs to.
        start: tokens computed before the step (the first new token's position).
        num_tokens: tokens the step computes (positions ``[start, start + num_tokens)``).
        block_tables: the request's block table per plan group, after this step's
            ``allocate_slots`` (``0`` marks null entries).
    """

    request_id: str
    start: int
    num_tokens: int
    block_tables: tuple[tuple[int, ...], ...]
    positions: torch.Tensor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        positions = torch.arange(self.start, self.start + self.num_tokens, dtype=torch.int64)
        object.__setattr__(self, "positions", positions)

    @property
    def end(self) -> int:
        """Tokens computed after the step."""
        return self.start + self.num_tokens
