"""A consistent-hash ring: many points per replica, so adding or removing one moves few keys."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

from conveyor.gateway.prefix_key import stable_hash


class HashRing:
    def __init__(self, members: Iterable[str], vnodes: int) -> None:
        points = sorted(
            (stable_hash(f"{member}#{i}".encode()), member)
            for member in set(members)
            for i in range(vnodes)
        )
        self._hashes = [h for h, _ in points]
        self._members = [m for _, m in points]
        self.size = len(set(self._members))

    def first(self, key: int) -> str | None:
        """The member that owns ``key``: the first clockwise from its position."""
        if not self._members:
            return None
        return self._members[bisect.bisect_left(self._hashes, key) % len(self._members)]

    def walk(self, key: int) -> Iterator[str]:
        """Each member once, in ring order starting at ``key``'s position."""
        if not self._members:
            return
        seen: set[str] = set()
        start = bisect.bisect_left(self._hashes, key)
        n = len(self._members)
        for i in range(n):
            member = self._members[(start + i) % n]
            if member not in seen:
                seen.add(member)
                yield member
                if len(seen) == self.size:
                    return
