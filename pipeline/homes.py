"""Prefix homes: which replica computed which KV blocks in the windows planned before (issue 39).

A job planned in windows (pipeline/windows.py) plans each window alone, so a document whose
questions arrive in several windows would be placed anywhere each time and prefilled again on
every replica that gets some. The engines keep what they computed in their prefix caches
(vLLM's automatic prefix caching, the native block manager's hashed cache), so the next window
should send such a row to the replica that already holds its prefix, where balance allows.

PrefixHomes is that memory: the block hashes (block_hash.py, chained: equal hashes at block k
mean equal blocks 0..k) each replica's rows of the earlier windows filled, at most `capacity`
per replica, the most recently used kept: an engine's cache holds no more than its KV blocks
and evicts the least recently used first, so a bound any tighter would forget what the engine
still has, and any looser would remember what it lost. Memory: 20 bytes per kept block, so the
driver's index is bounded by replicas x capacity whatever the dataset's size.

`find` looks a window's rows up block by block while they stay in the index
(HashedPrompts.leading: where the hashes are, or through `gather` in chunks): each row's `hit`
is the prefix, in whole blocks, that some replica holds, and `holders` which ones (the rows a
prefix computed on every replica has are marked `everywhere`: no replica is better for them).
multilevel.py places a family of units (a document's chunks, a chain of turns; a family never
joins units whose homes differ) whole on the replica where its rows' hits save the most, unless
that replica would take more than its share (partition.py `_place_at_home`), and counts what
the hits save in the plan's computed tokens.
`entries` reads what a window's rows leave in the caches once its plan has run (their blocks on
their replicas; where the window is planned, beside its hashes), and `merged` adds them to the
homes in window order (the job's driver: operators/stages/window_plans.py); `after` is both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixflow.pipeline.block_hash import HashedPrompts
from prefixflow.pipeline.cost_model import CostModel


@dataclass(frozen=True, slots=True, eq=False)
class HomeHits:
    """What a window's rows find in the homes. hit: [n] tokens of each row's prefix that some
    replica holds (whole blocks, at most its length - 1: the last token is always computed).
    pair_row, pair_replica: the replicas that hold each row's hit (rows with a hit that not
    every replica holds). everywhere: [n] the hit is on every replica."""

    hit: np.ndarray
    pair_row: np.ndarray
    pair_replica: np.ndarray
    everywhere: np.ndarray

    def first_home(self, n: int) -> np.ndarray:
        """[n] one replica that holds each row's hit (the lowest), -1 for none or everywhere."""
        home = np.full(n, -1, dtype=np.int64)
        rows, first = np.unique(self.pair_row, return_index=True)  # a row's pairs: by replica
        home[rows] = self.pair_replica[first]
        return home

    def on_replica(self, replica: np.ndarray) -> np.ndarray:
        """[n] whether each row's hit is on `replica[row]`, its replica in a plan."""
        on: np.ndarray = self.everywhere.copy()
        on[self.pair_row[self.pair_replica == replica[self.pair_row]]] = True
        return on


@dataclass(frozen=True, slots=True, eq=False)
class PrefixHomes:
    """The KV blocks each replica holds from earlier windows (module docstring).

    hashes, replica, stamp: [kept] one entry per (block hash, replica), sorted by hash then
    replica; stamp orders use (higher: used later). next_stamp: the stamp the next window starts at.
    """

    num_replicas: int
    capacity: int
    hashes: np.ndarray
    replica: np.ndarray
    stamp: np.ndarray
    next_stamp: int = 0

    @classmethod
    def empty(cls, num_replicas: int, capacity: int) -> "PrefixHomes":
        if num_replicas < 1 or capacity < 0:
            raise ValueError(f"PrefixHomes({num_replicas}, {capacity}): use at least 1 replica and capacity >= 0")
        e = np.zeros(0, dtype=np.int64)
        return cls(num_replicas, capacity, e, e.astype(np.int32), e)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def find(self, prompts: HashedPrompts) -> HomeHits:
        """Each row's longest prefix a replica holds, and which replicas hold it."""
        n, block = len(prompts), prompts.block_size
        if n == 0 or not len(self.hashes):
            return self._holders(np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64))
        usable = np.maximum((np.asarray(prompts.lengths, dtype=np.int64) - 1) // block, 0)  # may hit
        found, deepest = prompts.leading(np.unique(self.hashes), usable)
        return self._holders(np.asarray(found, np.int64) * block, np.asarray(deepest, np.int64))

    def _holders(self, hit: np.ndarray, deepest: np.ndarray) -> HomeHits:
        """The replicas that hold each row's deepest block found."""
        rows = np.flatnonzero(hit > 0)
        lo = np.searchsorted(self.hashes, deepest[rows], "left")
        count = np.searchsorted(self.hashes, deepest[rows], "right") - lo
        everywhere = np.zeros(len(hit), dtype=bool)
        everywhere[rows[count >= self.num_replicas]] = True
        some = count < self.num_replicas
        rows, lo, count = rows[some], lo[some], count[some]
        pair_row = np.repeat(rows, count)
        at = np.repeat(lo - np.r_[0, np.cumsum(count)[:-1]], count) + np.arange(int(count.sum()))
        return HomeHits(hit, pair_row, self.replica[at].astype(np.int64), everywhere)

    def after(self, prompts: HashedPrompts, row_replica: np.ndarray, row_rank: np.ndarray) -> "PrefixHomes":
        """The homes once a window's rows ran (entries, then merged)."""
        return self.merged(self.entries(prompts, row_replica, row_rank))

    def entries(self, prompts: HashedPrompts, row_replica: np.ndarray, row_rank: np.ndarray) -> "HomeEntries":
        """What a window's rows add to the homes once they ran: `row_replica`, `row_rank` ([n]
        each row's replica and position in its order) say where and when each row filled its
        whole blocks. Only a replica's last `capacity` blocks can stay, so only its last rows are
        read. Reads the hashes (where the window is planned); the entries depend on the homes'
        capacity only, so a window planned against older homes adds what it would add to newer."""
        if self.capacity == 0 or len(prompts) == 0:
            return HomeEntries.empty()
        whole = np.asarray(prompts.lengths, dtype=np.int64) // prompts.block_size
        kept = []
        for r in range(self.num_replicas):
            mine = np.flatnonzero(row_replica == r)
            mine = mine[np.argsort(-row_rank[mine], kind="stable")]  # latest first
            kept.append(mine[: int(np.searchsorted(np.cumsum(whole[mine]), self.capacity)) + 1])
        rows = np.concatenate(kept)  # every replica's at once: one gather (a task per block)
        h, rank = _whole_blocks(prompts, rows, whole[rows], row_rank[rows])
        replica = np.repeat(np.asarray(row_replica, dtype=np.int32)[rows], whole[rows])
        return HomeEntries(h, replica, rank)

    def merged(self, entries: "HomeEntries") -> "PrefixHomes":
        """These homes and a window's entries, stamped after every window merged before."""
        if not len(entries.hashes):
            return self
        return self._merged(entries.hashes, entries.replica, self.next_stamp + entries.rank)

    def _merged(self, hashes: np.ndarray, replica: np.ndarray, stamp: np.ndarray) -> "PrefixHomes":
        """Old and new entries, one per (hash, replica) with its latest stamp, each replica's
        `capacity` latest kept."""
        h = np.r_[self.hashes, hashes]
        r = np.r_[self.replica, replica].astype(np.int32)
        s = np.r_[self.stamp, stamp]
        by_key = np.lexsort((-s, r, h))  # per (hash, replica): the latest first
        h, r, s = h[by_key], r[by_key], s[by_key]
        first = np.r_[True, (h[1:] != h[:-1]) | (r[1:] != r[:-1])] if len(h) else np.zeros(0, bool)
        h, r, s = h[first], r[first], s[first]
        by_age = np.lexsort((-s, r))  # per replica, the latest first
        rank = np.arange(len(r)) - np.searchsorted(r[by_age], r[by_age], "left")
        kept = np.sort(by_age[rank < self.capacity])  # back in (hash, replica) order
        top = int(stamp.max()) + 1 if len(stamp) else self.next_stamp
        return dataclasses.replace(
            self, hashes=h[kept], replica=r[kept], stamp=s[kept], next_stamp=max(top, self.next_stamp)
        )


@dataclass(frozen=True, slots=True, eq=False)
class HomeEntries:
    """What one window adds to the homes (PrefixHomes.entries): [k] each whole block's hash,
    the replica that filled it and its row's rank in the window (its stamp, once merged, is
    the homes' next_stamp plus the rank)."""

    hashes: np.ndarray
    replica: np.ndarray
    rank: np.ndarray

    @classmethod
    def empty(cls) -> "HomeEntries":
        e = np.zeros(0, dtype=np.int64)
        return cls(e, e.astype(np.int32), e)


def _whole_blocks(
    prompts: HashedPrompts, rows: np.ndarray, whole: np.ndarray, rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(hash, rank) of the whole blocks of `rows`, each block with its row's rank."""
    out_h: list[np.ndarray] = []
    out_r: list[np.ndarray] = []
    width = int(whole.max()) if len(whole) else 0
    step = max(1, (prompts.max_cells or 1 << 22) // max(width, 1))
    for lo in range(0, len(rows), step):
        part, w = rows[lo : lo + step], whole[lo : lo + step]
        got = prompts.gather(part, 0, width) if width else np.zeros((len(part), 0), np.int64)
        mask = np.arange(width)[None, :] < w[:, None]
        out_h.append(got[mask])
        out_r.append(np.repeat(rank[lo : lo + step], w))
    if not out_h:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(out_h).astype(np.int64), np.concatenate(out_r).astype(np.int64)


def cache_blocks(kv_budget_bytes: float, kv_bytes_per_token: int, block_size: int) -> int:
    """KV blocks of `block_size` tokens that a replica's KV budget holds: the homes' capacity."""
    return max(int(kv_budget_bytes // max(kv_bytes_per_token * block_size, 1)), 0)


def estimated_cache_blocks(block_size: int) -> int:
    """The cost model's estimate, where the engine's budget is not known before it starts:
    Llama-3.1-8B's KV in an H100's memory (cost_model.py), 29,206 blocks of 16 tokens."""
    cm = CostModel.create()
    return cache_blocks(cm.kv_budget_bytes, cm.model.kv_bytes_per_token, block_size)


def home_entries(plan: Any, homes: PrefixHomes) -> HomeEntries:
    """What `plan` (planned from HashedPrompts) adds to `homes` once it ran: its table's replica
    and rank. Every whole block of every prompt is recorded: both engines' caches hash each
    block from the prompt's start, a group member's own blocks too."""
    if plan.hashed is None:
        raise ValueError("prefix homes need a plan built from HashedPrompts (block hashes)")
    n = len(plan.seq_index)
    replica = np.zeros(n, dtype=np.int64)
    rank = np.zeros(n, dtype=np.int64)
    replica[plan.seq_index] = plan.table.column("replica").to_numpy()
    rank[plan.seq_index] = plan.table.column("rank").to_numpy()
    return homes.entries(plan.hashed, replica, rank)


def homes_of(plan: Any, homes: PrefixHomes) -> PrefixHomes:
    """The homes after `plan` ran (home_entries, merged)."""
    return homes.merged(home_entries(plan, homes))
