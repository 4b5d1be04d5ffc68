"""One group's prefix cache seen across the device and its offload tiers
(:class:`TieredView`), and full attention's scan over it (:func:`full_scan_across_tiers`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

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
            get = view.get
            for digest in hashes[len(found) : max_blocks]:
                block = get(digest)
                if block is None:
                    break
                found.append(block)
        return found

    return scan
