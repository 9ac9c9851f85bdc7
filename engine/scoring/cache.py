"""The scorer's prefix KV cache: group prefixes kept while their group runs (PrefillOnly Sec. 5.1).

A group's shared prefix KV (every layer, `PrefixKV`) is computed once by its first scheduled
member and kept for the other members (suffix KV is never kept at all). When the group's last
expected member finishes, the prefix is no longer pinned but stays while the budget has room:
a job's plan cuts a large group into units that the engine runs one after another, and the
next unit's members find it (Sec. 5.1 drops it at once; a replica's engine outlives a unit).
The cache has a byte budget: inserting beyond it evicts unpinned prefixes first, then the
least recently used prefixes of other groups, whose remaining members then miss and recompute
it. That is the situation in which SRJF with continuous JCT calibration (Sec. 6.3, Alg. 1)
helps: it sees which waiting requests the cache covers now and runs them first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from prefixflow.engine.scoring.forward import PrefixKV
from prefixflow.errors import require


class PrefixCache:
    """Group id -> PrefixKV, least recently used first; `capacity_bytes` bounds the total."""

    def __init__(self, capacity_bytes: int) -> None:
        require(
            capacity_bytes >= 0,
            "PrefixCache",
            "capacity_bytes",
            capacity_bytes,
            "use 0 (no prefix cache) or a positive byte budget",
        )
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[Hashable, PrefixKV] = OrderedDict()
        self._pending: dict[Hashable, int] = {}
        self.used_bytes = 0
        self.num_evictions = 0

    def __contains__(self, group: Hashable) -> bool:
        return group in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def expect(self, group: Hashable, num_members: int) -> None:
        """Announce that `num_members` requests of `group` will use its prefix."""
        self._pending[group] = self._pending.get(group, 0) + num_members

    def get(self, group: Hashable) -> PrefixKV | None:
        kv = self._entries.get(group)
        if kv is not None:
            self._entries.move_to_end(group)
        return kv

    def put(self, group: Hashable, kv: PrefixKV) -> bool:
        """Keep `kv` for the group's next members, evicting LRU prefixes of other groups.
        Returns False (keeps nothing) when it alone exceeds the budget."""
        if kv.nbytes > self.capacity_bytes:
            return False
        self._drop(group)
        while self.used_bytes + kv.nbytes > self.capacity_bytes:
            unpinned = (g for g in self._entries if g not in self._pending)
            self._drop(next(unpinned, next(iter(self._entries))))  # LRU of the unpinned, else of all
            self.num_evictions += 1
        self._entries[group] = kv
        self.used_bytes += kv.nbytes
        return True

    def finished(self, group: Hashable) -> None:
        """One member of `group` is done; after the last one expected the prefix is unpinned:
        kept while the budget has room, evicted before any pinned one."""
        left = self._pending.get(group, 0) - 1
        if left > 0:
            self._pending[group] = left
            return
        self._pending.pop(group, None)

    def pinned(self, group: Hashable) -> bool:
        """Whether members of `group` are still expected."""
        return group in self._pending

    def _drop(self, group: Hashable) -> None:
        kv = self._entries.pop(group, None)
        if kv is not None:
            self.used_bytes -= kv.nbytes
