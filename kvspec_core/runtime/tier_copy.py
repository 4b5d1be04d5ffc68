"""Running an allocator's :class:`~kvspec_core.runtime.tiers.Transfer` records over tensors
and files: a small helper any engine can use.

Storage per tier (``0`` the device, then the offload tiers) and per pool is one of:

* a sequence of tensors whose dim 0 indexes the pool's blocks (every layer view of the
  pool, as a plan's ``materialize()`` gives them, or one ``[blocks, block_bytes]`` byte
  tensor): copies are ``index_select`` on the source, ``index_copy_`` on the destination,
  tensor by tensor (same count and per-block shapes on both sides);
* a :class:`BlockFile`: block ``b`` of the pool is bytes ``[b * block_bytes, (b + 1) *
  block_bytes)`` of a file, holding the tensors' per-block bytes one after the other (the
  order of the tensors of the tier it is copied from or to).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import attrs
import torch

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.tiers import Transfer


@attrs.frozen
class BlockFile:
    """A file of fixed-size blocks (created, sparse, at ``num_blocks * block_bytes`` when
    missing). Reads and writes use ``os.pread`` / ``os.pwrite``; a short read fails."""

    path: str
    block_bytes: int
    num_blocks: int

    def __attrs_post_init__(self) -> None:
        if self.block_bytes <= 0 or self.num_blocks <= 0:
            raise AllocatorError(
                f"BlockFile({self.path!r}): block_bytes={self.block_bytes} and num_blocks="
                f"{self.num_blocks} must be positive"
            )
        with open(self.path, "ab") as file:
            if file.tell() < self.block_bytes * self.num_blocks:
                file.truncate(self.block_bytes * self.num_blocks)

    def read(self, blocks: Sequence[int]) -> torch.Tensor:
        """``[len(blocks), block_bytes]`` uint8 rows, in order."""
        out = bytearray(len(blocks) * self.block_bytes)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for row, block in enumerate(blocks):
                self._check(block)
                data = os.pread(fd, self.block_bytes, block * self.block_bytes)
                if len(data) != self.block_bytes:
                    raise OSError(f"{self.path}: short read of block {block}")
                out[row * self.block_bytes : (row + 1) * self.block_bytes] = data
        finally:
            os.close(fd)
        return torch.frombuffer(out, dtype=torch.uint8).reshape(len(blocks), self.block_bytes)

    def write(self, blocks: Sequence[int], rows: torch.Tensor) -> None:
        """Write ``[len(blocks), block_bytes]`` uint8 rows, in order."""
        if tuple(rows.shape) != (len(blocks), self.block_bytes):
            raise AllocatorError(
                f"{self.path}: blocks of {self.block_bytes} bytes cannot take rows shaped "
                f"{tuple(rows.shape)} (the tensors' bytes per block differ from the file's)"
            )
        data = rows.to("cpu").contiguous().numpy().tobytes()
        fd = os.open(self.path, os.O_WRONLY)
        try:
            for row, block in enumerate(blocks):
                self._check(block)
                chunk = data[row * self.block_bytes : (row + 1) * self.block_bytes]
                if os.pwrite(fd, chunk, block * self.block_bytes) != self.block_bytes:
                    raise OSError(f"{self.path}: short write of block {block}")
        finally:
            os.close(fd)

    def _check(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"{self.path} has no block {block} (0..{self.num_blocks - 1})")


Storage = Sequence[torch.Tensor] | BlockFile


def _rows(tensors: Sequence[torch.Tensor], blocks: Sequence[int]) -> torch.Tensor:
    """The blocks' bytes, one row per block: each tensor's block bytes in turn."""
    ids = torch.tensor(blocks, dtype=torch.long, device=tensors[0].device)
    parts = [
        tensor.index_select(0, ids).reshape(len(blocks), -1).view(torch.uint8).to("cpu")
        for tensor in tensors
    ]
    return torch.cat(parts, dim=1)


def _write_rows(tensors: Sequence[torch.Tensor], blocks: Sequence[int], rows: torch.Tensor) -> None:
    widths = [tensor[0].numel() * tensor.element_size() for tensor in tensors]
    if sum(widths) != rows.shape[1]:
        raise AllocatorError(
            f"a block of {rows.shape[1]} bytes does not fit tensors of {sum(widths)} bytes "
            "per block"
        )
    ids = torch.tensor(blocks, dtype=torch.long, device=tensors[0].device)
    start = 0
    for tensor in tensors:
        width = tensor[0].numel() * tensor.element_size()
        part = rows[:, start : start + width].contiguous().view(tensor.dtype)
        tensor.index_copy_(0, ids, part.reshape((len(blocks), *tensor.shape[1:])).to(tensor.device))
        start += width


class TransferRunner:
    """Runs transfers over ``storage[tier][pool]`` (see the module docstring).

    ``storage`` maps a tier number to that tier's storage per pool (a sequence indexed by
    pool, or a mapping pool -> storage, ``None`` for a pool the tier does not hold).
    """

    def __init__(self, storage: Mapping[int, Sequence[Storage | None] | Mapping[int, Storage]]):
        self.storage = storage

    def _at(self, tier: int, pool: int) -> Storage:
        per_pool = self.storage.get(tier)
        found = None
        if isinstance(per_pool, Mapping):
            found = per_pool.get(pool)
        elif per_pool is not None and 0 <= pool < len(per_pool):
            found = per_pool[pool]
        if found is None:
            raise AllocatorError(f"TransferRunner has no storage for tier {tier}, pool {pool}")
        return found

    def copy(self, transfer: Transfer) -> None:
        """Run one transfer (raises on failure, having written at most its destination)."""
        source = self._at(transfer.source_tier, transfer.pool)
        destination = self._at(transfer.destination_tier, transfer.pool)
        src, dst = transfer.source_blocks, transfer.destination_blocks
        if len(src) != len(dst):
            raise AllocatorError(f"transfer {transfer.transfer_id}: unpaired block lists")
        if not src:
            return
        if isinstance(source, BlockFile):
            rows = source.read(src)
            if isinstance(destination, BlockFile):
                destination.write(dst, rows)
            else:
                _write_rows(destination, dst, rows)
            return
        if isinstance(destination, BlockFile):
            destination.write(dst, _rows(source, src))
            return
        if len(source) != len(destination):
            raise AllocatorError(
                f"transfer {transfer.transfer_id}: tier {transfer.source_tier} has "
                f"{len(source)} tensors for pool {transfer.pool}, tier "
                f"{transfer.destination_tier} {len(destination)}"
            )
        for from_tensor, to_tensor in zip(source, destination, strict=True):
            ids = torch.tensor(src, dtype=torch.long, device=from_tensor.device)
            data = from_tensor.index_select(0, ids)
            to_ids = torch.tensor(dst, dtype=torch.long, device=to_tensor.device)
            # A copy to the host must have finished before the CPU's index_copy_ reads it
            # (non_blocking into pinned memory returns at once: stale bytes would be cached
            # as the block); a copy to a GPU is ordered before index_copy_ on its stream.
            moved = data.to(to_tensor.device, non_blocking=to_tensor.device.type != "cpu")
            to_tensor.index_copy_(0, to_ids, moved)

    def block_bytes(self, tier: int, pool: int) -> int:
        """Bytes of one block of ``pool`` in ``tier`` (every tensor's block bytes, in turn)."""
        storage = self._at(tier, pool)
        if isinstance(storage, BlockFile):
            return storage.block_bytes
        return sum(tensor[0].numel() * tensor.element_size() for tensor in storage)

    def read_blocks(self, tier: int, pool: int, blocks: Sequence[int]) -> torch.Tensor:
        """``[len(blocks), block_bytes]`` uint8 rows of the blocks of ``pool`` in ``tier``."""
        storage = self._at(tier, pool)
        if isinstance(storage, BlockFile):
            return storage.read(blocks)
        return _rows(storage, blocks)

    def write_blocks(self, tier: int, pool: int, blocks: Sequence[int], rows: torch.Tensor) -> None:
        """Write ``[len(blocks), block_bytes]`` uint8 rows into blocks of ``pool`` in ``tier``."""
        storage = self._at(tier, pool)
        if isinstance(storage, BlockFile):
            storage.write(blocks, rows)
        else:
            _write_rows(storage, blocks, rows)

    def run(self, transfers: Iterable[Transfer]) -> tuple[list[int], list[int]]:
        """Run ``transfers`` in order: ``(ids that ran, ids that failed)``. A failure (an
        I/O error, a bad storage) fails that transfer only: the later ones still run."""
        done: list[int] = []
        failed: list[int] = []
        for transfer in transfers:
            try:
                self.copy(transfer)
            except (OSError, RuntimeError, IndexError, AllocatorError):
                failed.append(transfer.transfer_id)
            else:
                done.append(transfer.transfer_id)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return done, failed

    def run_and_complete(
        self, allocator: _TransferSource, transfers: Sequence[Transfer]
    ) -> tuple[list[int], list[int], tuple[str | int, ...]]:
        """Run ``transfers`` (just taken from ``allocator``) in order and complete them, those
        that ran as ``ok``, the rest as failed: ``(ids that ran, ids that failed, the requests
        to drop from the step)`` (those whose loads failed and those that reused blocks they
        were to compute; see ``complete_transfers``). An
        error :meth:`run` does not expect (a bad storage object, an interrupt) fails every
        one of them before it propagates, so none stays pending for good."""
        try:
            done, failed = self.run(transfers)
        except BaseException:
            allocator.complete_transfers([t.transfer_id for t in transfers], ok=False)
            raise
        allocator.complete_transfers(done, ok=True)
        return done, failed, allocator.complete_transfers(failed, ok=False)

    def run_pending(self, allocator: _TransferSource) -> tuple[str | int, ...]:
        """Take the allocator's transfers, run them in order and complete them
        (:meth:`run_and_complete`): the requests to drop from the step (those whose loads
        failed and those that reused blocks they were to compute; see
        ``complete_transfers``). Call it before the step's forward."""
        return self.run_and_complete(allocator, allocator.take_transfers())[2]


class _TransferSource(Protocol):
    def take_transfers(self) -> list[Transfer]: ...

    def complete_transfers(
        self, transfer_ids: Iterable[int], ok: bool = True
    ) -> tuple[str | int, ...]: ...
