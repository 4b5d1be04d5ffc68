"""One group's prefix cache seen across the device and its offload tiers
(:class:`TieredView`), and full attention's scan over it (:func:`full_scan_across_tiers`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from kvspec_core.runtime.native import native
from kvspec_core.runtime.rules import HitScan


class TieredView(Mapping[bytes, int]):
    """One group's prefix cache seen across tiers, for the family rules' ``longest_hit``:
    a hash cached on the device maps to its block id; one held (confirmed) by offload tier
    ``t`` only, to the negative code ``-(slot * count + t)`` (``count`` tiers), which
    :meth:`TierManager.prefix` turns into a load. The rules decide hits over this merged
    view with their own logic, so a hit is one the group can resume from whichever tier
    holds each block."""

    __slots__ = ("count", "device", "tiers")

    def __init__(
        self, device: dict[bytes, int], tiers: Sequence[tuple[int, dict[bytes, int]]], count: int
    ) -> None:
        self.device = device
        self.tiers = tuple(tiers)
        self.count = count

    def get(self, digest: bytes, default: int | None = None) -> int | None:  # type: ignore[override]
        block = self.device.get(digest)
        if block is not None:
            return block
        for number, cache in self.tiers:
            slot = cache.get(digest)
            if slot is not None:
                return -(slot * self.count + number)
        return default

    def __getitem__(self, digest: bytes) -> int:
        found = self.get(digest)
        if found is None:
            raise KeyError(digest)
        return found

    def __contains__(self, digest: object) -> bool:
        return isinstance(digest, bytes) and self.get(digest) is not None

    def __iter__(self) -> Iterator[bytes]:
        seen = set(self.device)
        yield from self.device
        for _, cache in self.tiers:
            for digest in cache:
                if digest not in seen:
                    seen.add(digest)
                    yield digest

    def __len__(self) -> int:
        return sum(1 for _ in self)


def full_scan_across_tiers(device_scan: HitScan) -> HitScan:
    """Full attention's longest run over a :class:`TieredView`: the run in the device
    cache, then on in the tiers (the same answer as the rules' scan over the view)."""

    def scan(hashes: Sequence[bytes], view: Mapping[bytes, int], max_blocks: int) -> list[int]:
        assert isinstance(view, TieredView)
        found = device_scan(hashes, view.device, max_blocks)
        if len(found) < max_blocks and view.tiers and (found or max_blocks):
            found.extend(continued_run(hashes, view, len(found), min(max_blocks, len(hashes))))
        return found

    return scan


def continued_run(hashes: Sequence[bytes], view: TieredView, start: int, stop: int) -> list[int]:
    """What ``view.get`` gives for ``hashes[start:stop]``, up to the first hash no cache of
    the view holds. Found run by run: the run of the first cache (device first) holding the
    hash at hand, scanned in one call, cut where an earlier cache holds a hash too (the
    device keeps priority, then the tiers in order, as in ``get``)."""
    sources = ((0, view.device), *view.tiers)
    count = view.count
    found: list[int] = []
    position = start
    while position < stop:
        digest = hashes[position]
        rank = next((rank for rank, (_, cache) in enumerate(sources) if digest in cache), None)
        if rank is None:
            break
        number, cache = sources[rank]
        run = _longest_run(hashes[position:stop], cache)
        for _, earlier in sources[:rank]:
            run_hashes = hashes[position : position + len(run)]
            if not earlier.keys().isdisjoint(run_hashes):
                del run[next(index for index, key in enumerate(run_hashes) if key in earlier) :]
        if not run:
            break  # (a key whose equality is not its own: nothing more is certain)
        found.extend(run if number == 0 else [-(slot * count + number) for slot in run])
        position += len(run)
    return found


def _longest_run(hashes: Sequence[bytes], cache: dict[bytes, int]) -> list[int]:
    """The values ``cache`` maps the first ``hashes`` to, up to the first it lacks
    (compiled where built: ``native.longest_hit``)."""
    if native is not None and hashes.__class__ is list:
        return native.longest_hit(hashes, cache, len(hashes))
    run: list[int] = []
    for digest in hashes:
        value = cache.get(digest)
        if value is None:
            break
        run.append(value)
    return run
