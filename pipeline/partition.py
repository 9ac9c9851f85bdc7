"""Data-parallel partitioning: which replica runs which part of the plan (BlendServe Sec. 5.5).

The units are the runs of the order (a prefix-sharing group, or a part of one): in the plan a
run's members share its prefix, and nothing is shared across runs, so a run is the subtree that
matters. Each replica is filled to an equal share of the predicted work by the dual scanner:
units sorted by compute density, the replica takes from the compute-dense end while its own
density is below the job's (root) density and from the memory-dense end otherwise, so every
replica holds the root density and max(T_comp, T_mem) balances with T_comp.

A unit that would overfill a replica is cut at the member where the replica is full; the rest
stays at its end of the scan for the next replica and computes the prefix once more. So at most
R - 1 runs are cut (plus any group larger than a replica's share, which must be), each costing
its prefix length in saved tokens. Each replica keeps the policy's order of its parts.

Predicted time of a replica: max(sum T_comp, sum T_mem), BlendServe's T with compute and memory
overlapped (Sec. 3.3); a part that is cut off pays its prefix's compute again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixflow.pipeline.cost_model import density

CUT_TOLERANCE = 0.002  # a unit that overfills a replica by less than this share is not cut


@dataclass(frozen=True, slots=True, eq=False)
class Partition:
    """Parts (runs or pieces of runs) in plan order: replica by replica, policy order within.

    part_lo, part_hi: [num_parts] row range in the policy order (rows part_lo .. part_hi-1).
    part_run: [num_parts] the run each part comes from. part_replica: [num_parts] replica.
    replica_parts: [R + 1] part boundaries of each replica.
    compute_s, memory_s: [R] predicted seconds; lost_saving_tokens: [R] prefix tokens this
    replica recomputes because its part of a group was cut from another part.
    """

    part_lo: np.ndarray
    part_hi: np.ndarray
    part_run: np.ndarray
    part_replica: np.ndarray
    replica_parts: np.ndarray
    compute_s: np.ndarray
    memory_s: np.ndarray
    lost_saving_tokens: np.ndarray

    @property
    def predicted_s(self) -> np.ndarray:
        return np.maximum(self.compute_s, self.memory_s)


@dataclass(frozen=True, slots=True, eq=False)
class ReplicaRuns:
    """A plan's rows replica by replica, cut into runs of one group, with the partition's
    per-replica predictions (what every order's planning hands build_plan).

    seq_index: [n] prompt of each plan row. run_starts: [num_runs + 1]. run_prefix,
    run_computed: [num_runs] shared prefix and prompt tokens computed. run_replica: [num_runs].
    replica_runs: [R + 1] run boundaries of each replica. partition: predicted seconds and the
    saved tokens the split gave up, per replica.
    """

    seq_index: np.ndarray
    run_starts: np.ndarray
    run_prefix: np.ndarray
    run_computed: np.ndarray
    run_replica: np.ndarray
    replica_runs: np.ndarray
    partition: Partition


def partition_runs(run_starts: np.ndarray, row_compute: np.ndarray, row_memory: np.ndarray,
                   run_prefix_compute: np.ndarray, run_prefix_len: np.ndarray,
                   num_replicas: int, run_density: np.ndarray | None = None) -> Partition:
    """Split the order's runs across replicas, balanced on predicted time (dual-scan fill).

    run_starts: [num_runs + 1] row boundaries of the runs in the policy order.
    row_compute, row_memory: [num_rows] seconds per row in policy order, without its run's prefix.
    run_prefix_compute: [num_runs] seconds to compute each run's shared prefix once.
    run_prefix_len: [num_runs] tokens of each run's shared prefix (0 for a run of one).
    run_density: [num_runs] the scan's sort key (default: each run's T_comp / T_mem); equal keys
    keep the runs' order, so runs given one key stay together.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas} is invalid: use at least 1")
    num_runs = len(run_starts) - 1
    cum_c = np.r_[0.0, np.cumsum(row_compute)]
    cum_m = np.r_[0.0, np.cumsum(row_memory)]
    run_c = cum_c[run_starts[1:]] - cum_c[run_starts[:-1]] + run_prefix_compute
    run_m = cum_m[run_starts[1:]] - cum_m[run_starts[:-1]]
    key = density(run_c, run_m) if run_density is None else run_density
    seq = np.argsort(-key, kind="stable")
    filler = _Filler(run_starts, cum_c, cum_m, run_prefix_compute)
    if num_replicas == 1 or num_runs == 0:
        pieces = [(int(r), int(run_starts[r]), int(run_starts[r + 1]), 0) for r in range(num_runs)]
    else:
        # Every cut makes one more part compute its prefix: a first pass measures that extra
        # compute, the second aims the targets at the total including it.
        first = filler.fill(seq.tolist(), num_replicas, 0.0)
        extra = sum(float(run_prefix_compute[r]) for r, lo, _, _ in first if lo != run_starts[r])
        pieces = filler.fill(seq.tolist(), num_replicas, extra) if extra > 0 else first
    return _assemble(pieces, run_starts, cum_c, cum_m, run_prefix_compute, run_prefix_len, num_replicas)


class _Filler:
    """The dual scanner of Sec. 5.5 over units sorted by density (compute-dense first).

    Replica k aims at C* = C_left / (R - k) and M* = M_left / (R - k); its predicted time may
    reach T* = max(C*, M*). It takes from the compute-dense end while its compute is behind
    (c_k / C* <= m_k / M*), else from the memory-dense end. The compute-dense end may fill
    compute up to C* and memory up to T*, the memory-dense end memory up to M* and compute up
    to T*; a unit that would overfill (by more than CUT_TOLERANCE) is cut where it fits and that
    end stops. The replica is full when both ends have stopped.
    """

    def __init__(self, run_starts, cum_c, cum_m, prefix_c) -> None:
        self.starts, self.cum_c, self.cum_m, self.prefix_c = run_starts, cum_c, cum_m, prefix_c

    def cost(self, run: int, lo: int, hi: int) -> tuple[float, float]:
        return (self.cum_c[hi] - self.cum_c[lo] + self.prefix_c[run], self.cum_m[hi] - self.cum_m[lo])

    def fill(self, seq: list[int], num_replicas: int, extra_c: float) -> list[tuple[int, int, int, int]]:
        """Pieces (run, row_lo, row_hi, replica); `extra_c`: prefix compute the cuts will add."""
        # Each end holds its next unit as (run, row_lo, row_hi); a cut leaves the rest in place.
        self.units = [(r, int(self.starts[r]), int(self.starts[r + 1])) for r in seq]
        self.ends = [0, len(self.units) - 1]  # [left, right]
        costs = [self.cost(*u) for u in self.units]
        self.rest = [sum(c for c, _ in costs), sum(m for _, m in costs)]
        pieces: list[tuple[int, int, int, int]] = []
        for replica in range(num_replicas - 1):
            share = num_replicas - replica
            to_come = extra_c * (share - 1) / (num_replicas - 1)
            c_star = max((self.rest[0] + to_come) / share, 1e-30)
            m_star = max(self.rest[1] / share, 1e-30)
            pieces.extend((run, lo, hi, replica) for run, lo, hi in self._fill_one(c_star, m_star))
        left, right = self.ends
        pieces.extend((run, lo, hi, num_replicas - 1) for run, lo, hi in self.units[left:right + 1])
        return pieces

    def _fill_one(self, c_star: float, m_star: float) -> list[tuple[int, int, int]]:
        """One replica's pieces. The compute-dense end may fill compute to C* and memory to the
        time T*; the memory-dense end memory to M* and compute to T*."""
        t_star = max(c_star, m_star)
        c_k = m_k = 0.0
        taken: list[tuple[int, int, int]] = []
        open_ends = [True, True]
        while self.ends[0] <= self.ends[1] and any(open_ends):
            side = 0 if c_k / c_star <= m_k / m_star else 1
            side = side if open_ends[side] else 1 - side
            run, lo, hi = self.units[self.ends[side]]
            c, m = self.cost(run, lo, hi)
            cap_c, cap_m = (c_star, t_star) if side == 0 else (t_star, m_star)
            cut = hi
            if c_k + c > cap_c * (1.0 + CUT_TOLERANCE) or m_k + m > cap_m * (1.0 + CUT_TOLERANCE):
                cut = self._cut(run, lo, hi, cap_c - c_k, cap_m - m_k)
                if cut <= lo and (c_k or m_k):
                    open_ends[side] = False  # not even one member fits
                    continue
                cut = max(cut, lo + 1)
            c_piece, m_piece = self.cost(run, lo, cut)
            taken.append((run, lo, cut))
            c_k, m_k = c_k + c_piece, m_k + m_piece
            self.rest[0] -= c
            self.rest[1] -= m
            if cut < hi:  # the rest of the unit stays at this end and computes its prefix again
                self.units[self.ends[side]] = (run, cut, hi)
                c_rest, m_rest = self.cost(run, cut, hi)
                self.rest[0] += c_rest
                self.rest[1] += m_rest
                open_ends[side] = False
            else:
                self.ends[side] += 1 if side == 0 else -1
        return taken

    def _cut(self, run: int, lo: int, hi: int, room_c: float, room_m: float) -> int:
        """Largest row end `cut` in (lo, hi] whose piece lo..cut-1 fits both rooms; lo if none."""
        c = self.cum_c[lo + 1:hi + 1] - self.cum_c[lo] + self.prefix_c[run]
        m = self.cum_m[lo + 1:hi + 1] - self.cum_m[lo]
        fits = (c <= room_c * (1 + 1e-9)) & (m <= room_m * (1 + 1e-9))  # both grow with the cut
        return lo + int(np.count_nonzero(fits))


def _assemble(pieces, run_starts, cum_c, cum_m, prefix_c, prefix_len, num_replicas: int) -> Partition:
    arr = np.asarray(pieces, dtype=np.int64).reshape(-1, 4)
    run, lo, hi, replica = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3]
    keep = np.lexsort((lo, replica))
    run, lo, hi, replica = run[keep], lo[keep], hi[keep], replica[keep]
    c = cum_c[hi] - cum_c[lo] + prefix_c[run]   # every part computes its prefix once
    m = cum_m[hi] - cum_m[lo]
    # A run of L rows cut into k parts saves sum (L_i - 1) * P = (L - k) * P: each part after
    # the first recomputes the prefix once.
    lost = np.where(lo != run_starts[run], prefix_len[run], 0)
    per = lambda x: np.bincount(replica, weights=x, minlength=num_replicas)  # noqa: E731
    return Partition(lo, hi, run, replica.astype(np.int32),
                     np.searchsorted(replica, np.arange(num_replicas + 1)).astype(np.int64),
                     per(c), per(m), per(lost).astype(np.int64))
