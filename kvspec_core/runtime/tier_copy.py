"""Running an allocator's :class:`~kvspec_core.runtime.tiers.Transfer` records over tensors
and files: a small helper any engine can use.

Storage per tier (``0`` the device, then the offload tiers) and per pool is one of:

* a sequence of tensors whose dim 0 indexes the pool's blocks (every layer view of the
  pool, as a plan's ``materialize()`` gives them, or one ``[blocks, block_bytes]`` byte
  tensor): copies are ``index_select`` on the source, ``index_copy_`` on the destination,
  tensor by tensor (same count and per-block shapes on both sides). A view of
  ``materialize(kernel_block_sizes=...)`` holds ``k`` consecutive rows per block (dim 0 is
  ``k`` times the pool's blocks): :meth:`TransferRunner.run_and_complete` learns ``k`` per
  tier and pool from the allocator's pools, and refuses a dim 0 that is no multiple of them,
  before anything is copied (a block copied as one kernel block would be a silent wrong
  load); :meth:`TransferRunner.run` alone takes ``rows_per_block`` as given;
* a :class:`BlockFile`: block ``b`` of the pool is bytes ``[b * block_bytes, (b + 1) *
  block_bytes)`` of a file, holding the tensors' per-block bytes one after the other (the
  order of the tensors of the tier it is copied from or to).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
        _check_byte_rows(rows)
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


def _row_ids(blocks: Sequence[int], rows: int, device: torch.device) -> torch.Tensor:
    """The dim-0 indices of ``blocks`` in a tensor of ``rows`` consecutive rows per block."""
    ids = torch.tensor(blocks, dtype=torch.long, device=device)
    if rows == 1:
        return ids
    return (ids[:, None] * rows + torch.arange(rows, device=device)).reshape(-1)


def _copyable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or its bytes where ``index_copy_`` has no kernel for its dtype (fp8 on
    the CPU): a copy moves bytes, whatever they mean."""
    if tensor.element_size() == 1 and tensor.dtype not in (torch.uint8, torch.int8, torch.bool):
        return tensor.view(torch.uint8)
    return tensor


def _rows(tensors: Sequence[torch.Tensor], blocks: Sequence[int], rows: int = 1) -> torch.Tensor:
    """The blocks' bytes, one row per block: each tensor's block bytes in turn."""
    ids = _row_ids(blocks, rows, tensors[0].device)
    parts = [
        tensor.index_select(0, ids).reshape(len(blocks), -1).view(torch.uint8).to("cpu")
        for tensor in tensors
    ]
    return torch.cat(parts, dim=1)


def _check_byte_rows(rows: object) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() != 2:
        described = (
            f"a {rows.dtype} tensor of {rows.dim()} dims"
            if isinstance(rows, torch.Tensor)
            else type(rows).__name__
        )
        raise AllocatorError(
            f"block rows must be a 2-d torch.uint8 tensor (one row of bytes per block), not "
            f"{described}: pass read_blocks()'s rows, or tensor.view(torch.uint8)"
        )


def _write_rows(
    tensors: Sequence[torch.Tensor], blocks: Sequence[int], rows: torch.Tensor, per_block: int = 1
) -> None:
    _check_byte_rows(rows)
    widths = [per_block * tensor[0].numel() * tensor.element_size() for tensor in tensors]
    if sum(widths) != rows.shape[1]:
        raise AllocatorError(
            f"a block of {rows.shape[1]} bytes does not fit tensors of {sum(widths)} bytes "
            "per block"
        )
    ids = _row_ids(blocks, per_block, tensors[0].device)
    start = 0
    for tensor, width in zip(tensors, widths, strict=True):
        # A dense copy of its own (not contiguous(): one row's slice counts as contiguous,
        # keeping a stride and offset the dtype's view may refuse).
        part = rows[:, start : start + width].clone(memory_format=torch.contiguous_format)
        part = part.view(tensor.dtype)
        shaped = part.reshape((len(blocks) * per_block, *tensor.shape[1:])).to(tensor.device)
        _copyable(tensor).index_copy_(0, ids, _copyable(shaped))
        start += width


class TransferRunner:
    """Runs transfers over ``storage[tier][pool]`` (see the module docstring).

    ``storage`` maps a tier number to that tier's storage per pool (a sequence indexed by
    pool, or a mapping pool -> storage, ``None`` for a pool the tier does not hold).
    """

    def __init__(
        self,
        storage: Mapping[int, Sequence[Storage | None] | Mapping[int, Storage]],
        rows_per_block: Mapping[tuple[int, int], int] | None = None,
    ):
        self.storage = storage
        #: ``(tier, pool) -> k``: a tensor storage's rows per block (kernel-block views);
        #: 1 where absent. :meth:`check_storage` sets it from an allocator's pools.
        self.rows_per_block: dict[tuple[int, int], int] = dict(rows_per_block or {})
        self._checked: object = None

    def _pools(self) -> Iterator[tuple[int, int, Storage]]:
        for tier, per_pool in self.storage.items():
            pairs = per_pool.items() if isinstance(per_pool, Mapping) else enumerate(per_pool)
            for pool, storage in pairs:
                if storage is not None:
                    yield tier, pool, storage

    def check_storage(self, allocator: object) -> None:
        """Check every storage against ``allocator``'s pools (its device pools and its
        offload tiers' pools: ``block_counts()``), and learn each tensor storage's rows per
        block: dim 0 must be the pool's blocks times one ``k`` for all its tensors (``k``
        > 1: kernel-block views), a :class:`BlockFile` must hold at least the pool's blocks.
        Refuses a mismatch with :class:`AllocatorError` naming the tier, the pool and the
        fix."""
        counts = allocator.block_counts()  # type: ignore[attr-defined]
        learned: dict[tuple[int, int], int] = {}
        for tier, pool, storage in self._pools():
            blocks = counts.get((tier, pool))
            if blocks is None:
                raise AllocatorError(
                    f"TransferRunner: storage for tier {tier}, pool {pool}, which the "
                    "allocator does not have"
                )
            if isinstance(storage, BlockFile):
                if storage.num_blocks < blocks:
                    raise AllocatorError(
                        f"TransferRunner: tier {tier}, pool {pool}: {storage.path} holds "
                        f"{storage.num_blocks} blocks, fewer than the pool's {blocks}; make "
                        f"the BlockFile with num_blocks={blocks}"
                    )
                continue
            sizes = {int(tensor.shape[0]) for tensor in storage}
            rows = {size // blocks for size in sizes}
            if len(rows) != 1 or any(size % blocks for size in sizes) or 0 in rows:
                raise AllocatorError(
                    f"TransferRunner: tier {tier}, pool {pool} has {blocks} blocks, but its "
                    f"tensors' dim 0 is {sorted(sizes)}: give every layer view of the pool "
                    "(one row per block, or k rows per block as "
                    "materialize(kernel_block_sizes=...) views it)"
                )
            learned[(tier, pool)] = rows.pop()
        self.rows_per_block = learned
        self._checked = allocator

    def prepare(self, allocator: object) -> None:
        """:meth:`check_storage` against ``allocator`` unless done already (once per
        allocator; one without ``block_counts`` is not checked): before this, a kernel-block
        view's :meth:`block_bytes` counts one row per block."""
        if self._checked is not allocator and hasattr(allocator, "block_counts"):
            self.check_storage(allocator)

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
        rows_in = self.rows_per_block.get((transfer.source_tier, transfer.pool), 1)
        rows_out = self.rows_per_block.get((transfer.destination_tier, transfer.pool), 1)
        if isinstance(source, BlockFile):
            rows = source.read(src)
            if isinstance(destination, BlockFile):
                destination.write(dst, rows)
            else:
                _write_rows(destination, dst, rows, rows_out)
            return
        if isinstance(destination, BlockFile):
            destination.write(dst, _rows(source, src, rows_in))
            return
        if rows_in != rows_out:
            raise AllocatorError(
                f"transfer {transfer.transfer_id}: tier {transfer.source_tier} holds "
                f"{rows_in} rows per block of pool {transfer.pool}, tier "
                f"{transfer.destination_tier} {rows_out}"
            )
        if len(source) != len(destination):
            raise AllocatorError(
                f"transfer {transfer.transfer_id}: tier {transfer.source_tier} has "
                f"{len(source)} tensors for pool {transfer.pool}, tier "
                f"{transfer.destination_tier} {len(destination)}"
            )
        for from_tensor, to_tensor in zip(source, destination, strict=True):
            data = from_tensor.index_select(0, _row_ids(src, rows_in, from_tensor.device))
            to_ids = _row_ids(dst, rows_out, to_tensor.device)
            # A copy to the host must have finished before the CPU's index_copy_ reads it
            # (non_blocking into pinned memory returns at once: stale bytes would be cached
            # as the block); a copy to a GPU is ordered before index_copy_ on its stream.
            moved = data.to(to_tensor.device, non_blocking=to_tensor.device.type != "cpu")
            _copyable(to_tensor).index_copy_(0, to_ids, _copyable(moved))

    def block_layout(self, tier: int, pool: int) -> str:
        """What orders the bytes of a block of ``pool`` in ``tier`` as :meth:`read_blocks`
        gives them: a file's block size, or the tensors' rows per block and per-row shapes
        and dtypes (kernel-block views order a block's bytes otherwise than plain ones of the
        same plan). Call after :meth:`check_storage` (it learns the rows per block)."""
        storage = self._at(tier, pool)
        if isinstance(storage, BlockFile):
            return f"file:{storage.block_bytes}"
        rows = self.rows_per_block.get((tier, pool), 1)
        shapes = ",".join(f"{tensor.dtype}{list(tensor.shape[1:])}" for tensor in storage)
        return f"rows:{rows}:{shapes}"

    def source_block_layout(self, pool: int) -> str:
        """:meth:`block_layout` of ``pool`` in the lowest tier with storage (the device):
        every copy keeps a block's bytes in that order (tensor tiers hold the same rows and
        shapes, files the bytes as :meth:`read_blocks` gives them), so it is the order of
        its bytes in every tier."""
        tiers = sorted(tier for tier, pool_here, _ in self._pools() if pool_here == pool)
        if not tiers:
            raise AllocatorError(f"TransferRunner has no storage for pool {pool}")
        return self.block_layout(tiers[0], pool)

    def block_bytes(self, tier: int, pool: int) -> int:
        """Bytes of one block of ``pool`` in ``tier`` (every tensor's block bytes, in turn)."""
        storage = self._at(tier, pool)
        if isinstance(storage, BlockFile):
            return storage.block_bytes
        rows = self.rows_per_block.get((tier, pool), 1)
        return rows * sum(tensor[0].numel() * tensor.element_size() for tensor in storage)

    def read_blocks(self, tier: int, pool: int, blocks: Sequence[int]) -> torch.Tensor:
        """``[len(blocks), block_bytes]`` uint8 rows of the blocks of ``pool`` in ``tier``."""
        storage = self._at(tier, pool)
        if isinstance(storage, BlockFile):
            return storage.read(blocks)
        return _rows(storage, blocks, self.rows_per_block.get((tier, pool), 1))

    def write_blocks(self, tier: int, pool: int, blocks: Sequence[int], rows: torch.Tensor) -> None:
        """Write ``[len(blocks), block_bytes]`` uint8 rows into blocks of ``pool`` in ``tier``."""
        storage = self._at(tier, pool)
        if isinstance(storage, BlockFile):
            storage.write(blocks, rows)
        else:
            _write_rows(storage, blocks, rows, self.rows_per_block.get((tier, pool), 1))

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
        one of them before it propagates, so none stays pending for good. The storage is
        checked against ``allocator`` first (:meth:`check_storage`, once per allocator)."""
        try:
            self.prepare(allocator)
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
