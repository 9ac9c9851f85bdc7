"""Data-parallel partitioning: which replica runs which part of the plan (BlendServe Sec. 5.5).

The units are the runs of the order (a prefix-sharing group, or a part of one): in the plan a
run's members share its prefix, and nothing is shared across runs, so a run is the subtree that
matters. Each replica is filled to an equal share of the predicted work by the dual scanner:
units sorted by compute density, the replica takes from the compute-dense end while its own
density is below the job's (root) density and from the memory-dense end otherwise, so every
replica holds the root density and max(T_comp, T_mem) balances with T_comp.

A unit that would overfill a replica is cut at a member where the replica has room: of those
places (and not cutting at all), the one that fills the most of the room less what the cut makes
the job recompute (the prefix the member shares with the one before it, `row_cut_compute`). So a
unit holding several documents is cut between two of them, and no document is cut to put two of
its questions on the next replica. The piece is the unit's end next to what the replica took
before from that end of the scan (a family's units are scanned forward from one end, backward
from the other), so a family cut once is cut in one place, and taking nothing of a unit whose
neighbour the replica holds counts as the cut it is. The room left is filled by the other end
of the scan, the next replicas, or at run time by work stealing (operators/stages/work_queue.py).
The rest of a cut unit stays at its end of the scan for the next replica. Each replica keeps the
policy's order of its parts.

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
        seconds: np.ndarray = np.maximum(self.compute_s, self.memory_s)
        return seconds


@dataclass(frozen=True, slots=True, eq=False)
class ReplicaRuns:
    """A plan's rows replica by replica, cut into runs of one group, with the partition's
    per-replica predictions (what every order's planning hands build_plan).

    seq_index: [n] prompt of each plan row. run_starts: [num_runs + 1]. run_prefix,
    run_computed: [num_runs] shared prefix and prompt tokens computed. run_replica: [num_runs].
    replica_runs: [R + 1] run boundaries of each replica. partition: predicted seconds and the
    saved tokens the split gave up, per replica. home_hit_tokens: prompt tokens the rows find in
    their replica's cache from earlier windows (homes.py), not in run_computed. prev_lcp: [n]
    tokens each plan row shares with the row before it on its replica (0 for a replica's first;
    None where the order does not say: then a row continuing its run shares the run's prefix).
    """

    seq_index: np.ndarray
    run_starts: np.ndarray
    run_prefix: np.ndarray
    run_computed: np.ndarray
    run_replica: np.ndarray
    replica_runs: np.ndarray
    partition: Partition
    home_hit_tokens: int = 0
    prev_lcp: np.ndarray | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Affinity:
    """What a job's earlier windows left on the replicas (pipeline/homes.py), for partition_runs.

    home: [num_runs] the replica whose cache holds a run's prefix, -1 for none; saving:
    [num_runs] the compute seconds the run saves there; family: [num_runs] ids (0 and up) of
    runs that go home together, a family's runs with one home (None: every run alone). Each
    window is balanced on its own: work stealing evens out at run time what a window's plan
    leaves.
    """

    home: np.ndarray
    saving: np.ndarray
    family: np.ndarray | None = None


def partition_runs(
    run_starts: np.ndarray,
    row_compute: np.ndarray,
    row_memory: np.ndarray,
    run_prefix_compute: np.ndarray,
    run_prefix_len: np.ndarray,
    num_replicas: int,
    run_density: np.ndarray | None = None,
    row_cut_compute: np.ndarray | None = None,
    join_s: float = 0.0,
    affinity: Affinity | None = None,
) -> Partition:
    """Split the order's runs across replicas, balanced on predicted time (dual-scan fill).

    run_starts: [num_runs + 1] row boundaries of the runs in the policy order.
    row_compute, row_memory: [num_rows] seconds per row in policy order, without its run's prefix.
    run_prefix_compute: [num_runs] seconds to compute each run's shared prefix once.
    run_prefix_len: [num_runs] tokens of each run's shared prefix (0 for a run of one).
    run_density: [num_runs] the scan's sort key (default: each run's T_comp / T_mem); equal keys
    keep the runs' order, so runs given one key stay together.
    row_cut_compute: [num_rows] seconds that row i recomputes when a cut puts it in another part
    than row i - 1 (what it shares with it); default: its run's prefix, for every row but the first.
    join_s: a piece predicted to take at most this long joins the replica of the neighbour it was
    cut from when that saves compute (`_join_small_pieces`); 0 (the default) for a partition that
    runs as it is; a unit's time when work stealing evens out that grain at run time.
    affinity: what earlier windows left on the replicas: a family of runs whose prefix a replica
    holds goes there whole first while the replica stays within its share (`_place_at_home`);
    the scan fills around them.
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
    if row_cut_compute is None:
        run_len = np.diff(run_starts)
        row_cut_compute = np.repeat(run_prefix_compute, run_len).astype(np.float64)
        row_cut_compute[run_starts[:-1][run_len > 0]] = 0.0
    filler = _Filler(run_starts, cum_c, cum_m, run_prefix_compute, np.r_[row_cut_compute, 0.0])
    if num_replicas == 1 or num_runs == 0:
        pieces = [(int(r), int(run_starts[r]), int(run_starts[r + 1]), 0) for r in range(num_runs)]
    else:
        affinity = affinity or Affinity(np.full(num_runs, -1, dtype=np.int64), np.zeros(num_runs))
        placed = _place_at_home(run_c, run_m, affinity, num_replicas)
        at_home = [
            (int(r), int(run_starts[r]), int(run_starts[r + 1]), int(placed[r])) for r in np.flatnonzero(placed >= 0)
        ]
        preload = _preload(at_home, filler, affinity, num_replicas)
        rest = [int(r) for r in seq if placed[r] < 0]
        # Every cut makes one more part compute its prefix: a first pass measures that extra
        # compute, the second aims the targets at the total including it.
        first = filler.fill(rest, num_replicas, 0.0, preload)
        extra = sum(float(run_prefix_compute[r]) for r, lo, _, _ in first if lo != run_starts[r])
        pieces = filler.fill(rest, num_replicas, extra, preload) if extra > 0 else first
        pieces = _join_small_pieces(pieces, filler, join_s) if join_s > 0 else pieces
        pieces += at_home
    return _assemble(pieces, run_starts, cum_c, cum_m, run_prefix_compute, run_prefix_len, num_replicas)


class _Filler:
    """The dual scanner of Sec. 5.5 over units sorted by density (compute-dense first).

    Replica k aims at C* = C_left / (R - k) and M* = M_left / (R - k); its predicted time may
    reach T* = max(C*, M*). It takes from the compute-dense end while its compute is behind
    (c_k / C* <= m_k / M*), else from the memory-dense end. The compute-dense end may fill
    compute up to C* and memory up to T*, the memory-dense end memory up to M* and compute up
    to T*; a unit that would overfill (by more than CUT_TOLERANCE) is cut where it fits (`_cut`)
    and that end stops. The replica is full when both ends have stopped.
    """

    def __init__(
        self, run_starts: np.ndarray, cum_c: np.ndarray, cum_m: np.ndarray, prefix_c: np.ndarray, cut_c: np.ndarray
    ) -> None:
        self.starts, self.cum_c, self.cum_m, self.prefix_c, self.cut_c = run_starts, cum_c, cum_m, prefix_c, cut_c

    def cost(self, run: int, lo: int, hi: int) -> tuple[float, float]:
        return (self.cum_c[hi] - self.cum_c[lo] + self.prefix_c[run], self.cum_m[hi] - self.cum_m[lo])

    def fill(
        self, seq: list[int], num_replicas: int, extra_c: float, preload: tuple[np.ndarray, np.ndarray]
    ) -> list[tuple[int, int, int, int]]:
        """Pieces (run, row_lo, row_hi, replica); `extra_c`: prefix compute the cuts will add;
        preload: ([R] compute, [R] memory seconds) each replica holds before the scan."""
        pre_c, pre_m = preload
        # Each end holds its next unit as (run, row_lo, row_hi); a cut leaves the rest in place.
        self.units = [(r, int(self.starts[r]), int(self.starts[r + 1])) for r in seq]
        self.ends = [0, len(self.units) - 1]  # [left, right]
        costs = [self.cost(*u) for u in self.units]
        self.rest = [sum(c for c, _ in costs), sum(m for _, m in costs)]
        pieces: list[tuple[int, int, int, int]] = []
        for replica in range(num_replicas - 1):
            share = num_replicas - replica
            to_come = extra_c * (share - 1) / (num_replicas - 1)
            c_star = max((self.rest[0] + float(pre_c[replica:].sum()) + to_come) / share, 1e-30)
            m_star = max((self.rest[1] + float(pre_m[replica:].sum())) / share, 1e-30)
            taken = self._fill_one(c_star, m_star, float(pre_c[replica]), float(pre_m[replica]))
            pieces.extend((run, lo, hi, replica) for run, lo, hi in taken)
        left, right = self.ends
        pieces.extend((run, lo, hi, num_replicas - 1) for run, lo, hi in self.units[left : right + 1])
        return pieces

    def _fill_one(self, c_star: float, m_star: float, c_k: float, m_k: float) -> list[tuple[int, int, int]]:
        """One replica's pieces, on top of the (c_k, m_k) it holds. The compute-dense end may
        fill compute to C* and memory to the time T*; the memory-dense end memory to M* and
        compute to T*."""
        t_star = max(c_star, m_star)
        taken: list[tuple[int, int, int]] = []
        took_to: set[int] = set()  # rows where the pieces taken end, and where they start
        took_from: set[int] = set()
        open_ends = [True, True]
        while self.ends[0] <= self.ends[1] and any(open_ends):
            side = 0 if c_k / c_star <= m_k / m_star else 1
            side = side if open_ends[side] else 1 - side
            run, lo, hi = self.units[self.ends[side]]
            c, m = self.cost(run, lo, hi)
            cap_c, cap_m = (c_star, t_star) if side == 0 else (t_star, m_star)
            a, b = lo, hi  # the piece taken: the whole unit, or its end nearest this side's scan
            if c_k + c > cap_c * (1.0 + CUT_TOLERANCE) or m_k + m > cap_m * (1.0 + CUT_TOLERANCE):
                joined = (lo in took_to) if side == 0 else (hi in took_from)
                k = self._cut(run, lo, hi, cap_c - c_k, cap_m - m_k, side, joined)
                if k == 0 and (c_k or m_k):
                    open_ends[side] = False  # not even one member fits, or none gains
                    continue
                a, b = (lo, lo + max(k, 1)) if side == 0 else (hi - max(k, 1), hi)
            c_piece, m_piece = self.cost(run, a, b)
            taken.append((run, a, b))
            took_to.add(b)
            took_from.add(a)
            c_k, m_k = c_k + c_piece, m_k + m_piece
            self.rest[0] -= c
            self.rest[1] -= m
            if (a, b) != (lo, hi):  # the rest of the unit stays at this end and computes its prefix again
                rest = (run, b, hi) if side == 0 else (run, lo, a)
                self.units[self.ends[side]] = rest
                c_rest, m_rest = self.cost(*rest)
                self.rest[0] += c_rest
                self.rest[1] += m_rest
                open_ends[side] = False
            else:
                self.ends[side] += 1 if side == 0 else -1
        return taken

    def _cut(self, run: int, lo: int, hi: int, room_c: float, room_m: float, side: int, joined: bool) -> int:
        """How many rows k (0 .. hi - lo - 1) to take of a unit that overfills the rooms: the k
        whose piece fits both rooms and fills the most compute less what it cuts, 0 unless that
        beats taking nothing. The piece is the unit's end nearest the side's scan (its first rows
        on side 0, its last on side 1: the scan of a family's units runs forward on side 0 and
        backward on side 1), so it stays next to what the replica took of its neighbour; it cuts
        where it ends (that row recomputes what it shares with the row beside it, `cut_c`).
        Taking nothing cuts where the unit meets that neighbour when the replica `joined` it (a
        family's units are scanned one after another): then any piece moves the cut, and fills."""
        rows = np.arange(hi - lo)
        edge = lo if side == 0 else hi
        at = lo + rows if side == 0 else hi - rows  # where the piece of k rows ends (side 1: starts)
        c = np.abs(self.cum_c[at] - self.cum_c[edge]) + np.where(rows > 0, self.prefix_c[run], 0.0)
        m = np.abs(self.cum_m[at] - self.cum_m[edge])
        cost = self.cut_c[at] * (rows > 0)
        cost[0] = self.cut_c[edge] if joined else 0.0
        fits = int(np.count_nonzero((c <= room_c * (1 + 1e-9)) & (m <= room_m * (1 + 1e-9))))  # both grow
        if fits <= 1:
            return 0
        gain = c[:fits] - cost[:fits]
        best = fits - 1 - int(np.argmax(gain[::-1]))  # the largest of equal gains
        return best if gain[best] > gain[0] else 0


def _place_at_home(run_c: np.ndarray, run_m: np.ndarray, affinity: Affinity, num_replicas: int) -> np.ndarray:
    """[num_runs] the replica each run is placed on before the scan, -1 for the scan's. A
    family (Affinity.family) with a home goes there whole, the most saving per second of work
    first, while the replica's compute (less the savings) and memory stay within its share of
    each; of a family of several runs that does not fit, each run that saves something itself
    and fits goes there. Whole: its first run saves what it finds at home, the others what the
    run before them left, so a family placed run by run would leave those behind. The balance
    is the scan's to keep, so affinity takes only the room a fair share leaves."""
    home, saving = affinity.home, affinity.saving
    family = np.arange(len(run_c)) if affinity.family is None else affinity.family
    homed = (home >= 0) & (saving > 0)
    net_c = run_c - np.where(homed, saving, 0.0)  # what a run computes at its home
    limit_c = (float(run_c.sum()) - float(saving[homed].sum())) / num_replicas * (1 + CUT_TOLERANCE)
    limit_m = float(run_m.sum()) / num_replicas * (1 + CUT_TOLERANCE)
    load_c, load_m = [0.0] * num_replicas, [0.0] * num_replicas
    placed = np.full(len(run_c), -1, dtype=np.int64)

    def place(runs: np.ndarray | int, replica: int, c: float, m: float) -> bool:
        if load_c[replica] + c > limit_c or load_m[replica] + m > limit_m:
            return False
        placed[runs] = replica
        load_c[replica] += c
        load_m[replica] += m
        return True

    fam_saving = np.bincount(family, weights=np.where(homed, saving, 0.0))
    fam_c, fam_m = np.bincount(family, weights=net_c), np.bincount(family, weights=run_m)
    fam_size = np.bincount(family)
    fam_home = np.full(len(fam_saving), -1, dtype=np.int64)
    fam_home[family[homed]] = home[homed]
    if np.any(fam_home[family[homed]] != home[homed]):
        raise ValueError("Affinity: the runs of one family have one home (multilevel._affinity)")
    runs_of = np.split(np.argsort(family, kind="stable"), np.cumsum(fam_size)[:-1])
    candidates = np.flatnonzero(fam_saving > 0)
    key = fam_saving / np.maximum(np.bincount(family, weights=run_c), 1e-30)
    for f in candidates[np.argsort(-key[candidates], kind="stable")].tolist():
        h = int(fam_home[f])
        if not place(runs_of[f], h, float(fam_c[f]), float(fam_m[f])) and fam_size[f] > 1:
            for r in runs_of[f][homed[runs_of[f]]].tolist():
                place(r, h, float(net_c[r]), float(run_m[r]))
    return placed


def _preload(
    at_home: list[tuple[int, int, int, int]], filler: _Filler, affinity: Affinity, num_replicas: int
) -> tuple[np.ndarray, np.ndarray]:
    """([R] compute, [R] memory seconds) the runs placed at home hold, their savings taken off."""
    pre_c, pre_m = np.zeros(num_replicas), np.zeros(num_replicas)
    for run, lo, hi, replica in at_home:
        c, m = filler.cost(run, lo, hi)
        pre_c[replica] += c - float(affinity.saving[run])
        pre_m[replica] += m
    return pre_c, pre_m


def _join_small_pieces(
    pieces: list[tuple[int, int, int, int]], filler: _Filler, join_s: float
) -> list[tuple[int, int, int, int]]:
    """Move a piece predicted to take at most `join_s` to the replica of a neighbour it was cut
    from (the piece ending where it starts, or starting where it ends) when that saves compute:
    its replica stops recomputing the prefix they share (a document's last questions, cut off
    by a full replica). The job computes less; the balance it costs is at most `join_s` per
    piece, the grain that work stealing evens out at run time. Smallest pieces first."""
    pieces = list(pieces)
    by_lo = {lo: k for k, (_, lo, _, _) in enumerate(pieces)}
    by_hi = {hi: k for k, (_, _, hi, _) in enumerate(pieces)}
    cut = filler.cut_c

    def crossing(row: int, replica: int, k: int) -> float:
        """Compute recomputed at `row` if piece k sits on `replica` (0 if no piece adjoins)."""
        other = by_hi.get(row) if pieces[k][1] == row else by_lo.get(row)
        return float(cut[row]) if other is not None and other != k and pieces[other][3] != replica else 0.0

    def time_of(k: int) -> float:
        run, lo, hi, _ = pieces[k]
        return max(filler.cost(run, lo, hi))

    grown: dict[int, float] = {}  # replica -> predicted seconds it took in, less what it gave
    for k in sorted(range(len(pieces)), key=time_of):
        run, lo, hi, replica = pieces[k]
        now = crossing(lo, replica, k) + crossing(hi, replica, k)
        best, saved, t = replica, 0.0, time_of(k)
        for n in (by_hi.get(lo), by_lo.get(hi)):
            if n is None or n == k or pieces[n][3] == replica or grown.get(pieces[n][3], 0.0) + t > join_s:
                continue
            there = pieces[n][3]
            gain = now - crossing(lo, there, k) - crossing(hi, there, k)
            if gain > saved:
                best, saved = there, gain
        if best != replica:
            grown[best] = grown.get(best, 0.0) + t
            grown[replica] = grown.get(replica, 0.0) - t
        pieces[k] = (run, lo, hi, best)
    merged: list[tuple[int, int, int, int]] = []  # a run's pieces side by side on one replica: one
    for run, lo, hi, replica in sorted(pieces, key=lambda p: (p[3], p[1])):
        if merged and merged[-1][0] == run and merged[-1][3] == replica and merged[-1][2] == lo:
            merged[-1] = (run, merged[-1][1], hi, replica)
        else:
            merged.append((run, lo, hi, replica))
    return merged


def _assemble(
    pieces: list[tuple[int, int, int, int]],
    run_starts: np.ndarray,
    cum_c: np.ndarray,
    cum_m: np.ndarray,
    prefix_c: np.ndarray,
    prefix_len: np.ndarray,
    num_replicas: int,
) -> Partition:
    arr = np.asarray(pieces, dtype=np.int64).reshape(-1, 4)
    run, lo, hi, replica = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3]
    keep = np.lexsort((lo, replica))
    run, lo, hi, replica = run[keep], lo[keep], hi[keep], replica[keep]
    c = cum_c[hi] - cum_c[lo] + prefix_c[run]  # every part computes its prefix once
    m = cum_m[hi] - cum_m[lo]
    # A run of L rows cut into k parts saves sum (L_i - 1) * P = (L - k) * P: each part after
    # the first recomputes the prefix once.
    lost = np.where(lo != run_starts[run], prefix_len[run], 0)

    def per(x: np.ndarray) -> np.ndarray:
        return np.bincount(replica, weights=x, minlength=num_replicas)

    return Partition(
        lo,
        hi,
        run,
        replica.astype(np.int32),
        np.searchsorted(replica, np.arange(num_replicas + 1)).astype(np.int64),
        per(c),
        per(m),
        per(lost).astype(np.int64),
    )
