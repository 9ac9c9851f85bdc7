"""What the simulated replicas run: requests in stream order (_Items), and the streams each way
of feeding the cluster makes: rows in arrival or sorted order, or prefixflow's plan as units
(the grain of work stealing, pipeline/plan.py), each group's shared prefix an OWNER request.

The plan is build_plan's own (tree, grouping, order, partition, units) on the trie's exact text
order and LCPs (tests/cpu/test_cluster_sim.py checks it equals build_plan on materialised token
ids). Where no two prompts share a token it is made per slice of PLAN_SLICE_ROWS rows (a plan
per batch; nothing to lose), since build_plan on 10M runs of one peaked at 8.7 GB.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from prefixflow.bench.sim_workloads import Workload, levels
from prefixflow.pipeline import build_plan
from prefixflow.pipeline.block_hash import HashedPrompts
from prefixflow.pipeline.ragged import RaggedTokens

BLOCK_SIZE = 16  # vLLM's and the native engine's default KV block
PLAN_SLICE_ROWS = 2_500_000
PLAIN, OWNER, MEMBER = 0, 1, 2  # kinds of simulated requests (see _Items)


@dataclass(frozen=True, slots=True, eq=False)
class _Items:
    """What the simulator runs, in stream order (all [num_items] int64).

    kind: PLAIN (a whole prompt, blocks aligned at token 0), OWNER (a plan group's prefix,
    computed once, no decode), MEMBER (a plan member: holds its group's prefix, computes the
    rest; its blocks align at the prefix and chain from it).
    node: the prompt's end node (an OWNER's: its group node). anchor: a MEMBER's group node.
    replica: the replica the plan (or a measured run) gave it, else -1.
    output_len: the tokens it really decodes (an OWNER: 0). row: the prompt row (-1: an OWNER).
    """

    kind: np.ndarray
    node: np.ndarray
    anchor: np.ndarray
    replica: np.ndarray
    output_len: np.ndarray
    row: np.ndarray

    def with_replica(self, replica: np.ndarray) -> "_Items":
        return _Items(self.kind, self.node, self.anchor, replica, self.output_len, self.row)

    def rows_only(self) -> "_Items":
        """The stream without its OWNER requests, each row a whole prompt (PLAIN): prefixflow's
        vLLM backend, sharing only through vLLM's prefix cache."""
        keep = self.kind != OWNER
        n = int(keep.sum())
        return _Items(
            np.full(n, PLAIN, np.int64),
            self.node[keep],
            np.zeros(n, np.int64),
            self.replica[keep],
            self.output_len[keep],
            self.row[keep],
        )


def _concat(parts: Sequence[_Items]) -> _Items:
    return _Items(*(np.concatenate([getattr(p, f) for p in parts]) for f in _Items.__slots__))


def plain_items(w: Workload, order: np.ndarray, outs: np.ndarray | None = None) -> _Items:
    """These rows (in this order) as whole prompts; outs: [n] decoded tokens per row (default
    the caps)."""
    n = len(order)
    outs = w.output_len if outs is None else outs
    return _Items(
        np.zeros(n, np.int64),
        w.end_node[order],
        np.zeros(n, np.int64),
        np.full(n, -1, np.int64),
        outs[order],
        order.astype(np.int64),
    )


@dataclass(frozen=True, slots=True, eq=False)
class PlanStream:
    """A plan's requests in plan order (replica by replica), cut into its units: unit_starts
    [num_units + 1] item boundaries, unit_owner [num_units] the replica the plan gave each,
    unit_seconds [num_units] its predicted time (from the caps), unit_shared [num_units] the
    prompt tokens it shares with the unit before it (Plan.unit_shared)."""

    items: _Items
    unit_starts: np.ndarray
    unit_owner: np.ndarray
    unit_seconds: np.ndarray
    unit_shared: np.ndarray


def _no_hashes(seqs: np.ndarray, depth: int, width: int) -> np.ndarray:
    raise RuntimeError("the trie's prompts have no block hashes: their order and LCPs are given")


def _no_tokens(idx: np.ndarray) -> RaggedTokens:
    raise RuntimeError("the trie's prompts have no token ids")


@dataclass(frozen=True, slots=True, eq=False)
class _SortedPrompts(HashedPrompts):
    """Prompts the planner sorts no further: their exact text order and adjacent LCPs in tokens
    (what `sort_with_lcp` on the token ids returns), computed from the segment trie. No block hashes
    or token ids (asking raises): given the order the planner needs no hashes, and the simulator
    asks its plans for no token ids."""

    order: np.ndarray = field(kw_only=True)
    lcp: np.ndarray = field(kw_only=True)

    def sort_with_lcp(self) -> tuple[np.ndarray, np.ndarray]:
        return self.order, self.lcp


def trie_order_lcp(w: Workload) -> tuple[np.ndarray, np.ndarray]:
    """(text order, LCP in tokens of adjacent prompts) of a preorder trie: the LCP of two prompts
    is the depth of their ends' lowest common ancestor."""
    order = w.sorted_order
    lev = levels(w.parent)
    last = np.arange(len(w.parent), dtype=np.int64)  # last preorder id in each subtree
    for level in range(int(lev.max()), 0, -1):
        nodes = np.flatnonzero(lev == level)
        np.maximum.at(last, w.parent[nodes], last[nodes])
    a, anc = w.end_node[order[:-1]], w.end_node[order[1:]].copy()
    lcp = np.zeros(len(a), np.int64)
    idx = np.arange(len(a))
    while len(idx):
        inside = (anc[idx] <= a[idx]) & (a[idx] <= last[anc[idx]])
        lcp[idx[inside]] = w.depth[anc[idx[inside]]]
        idx = idx[~inside]
        anc[idx] = w.parent[anc[idx]]
    return order, lcp


def plan_workload(
    w: Workload,
    num_replicas: int,
    block_size: int = BLOCK_SIZE,
    tokens: Sequence[Sequence[int]] | RaggedTokens | None = None,
    order_lcp: tuple[np.ndarray, np.ndarray] | None = None,
    stealing: bool = False,
) -> Any:
    """prefixflow's plan of the workload: `build_plan` (batchllm order, groups at least a block
    long, as an engine asks; told each row's cap) on the real token ids when given, else on the
    trie's exact text order and LCPs (the planner's own tree, grouping, order and partition; no
    token ids). order_lcp: trie_order_lcp(w), when already computed. stealing: the plan a job
    whose engines steal gets (build_plan's)."""
    if tokens is not None:
        prompts: Any = tokens
    else:
        order, lcp = order_lcp or trie_order_lcp(w)
        prompts = _SortedPrompts(w.prompt_lens, _no_hashes, block_size, _no_tokens, order=order, lcp=lcp)
    return build_plan(
        prompts,
        output_lens=w.output_len,
        order="batchllm",
        num_replicas=num_replicas,
        min_prefix_len=block_size,
        stealing=stealing,
    )


@dataclass(frozen=True, slots=True, eq=False)
class SlicedPlan:
    """build_plan per slice of rows (a plan per batch, as operators/faces/batch_generator.py makes),
    used only where no two prompts share a token, so slicing loses no sharing: build_plan's
    partition keeps Python tuples per run, and 10M runs of one prompt peaked at 8.7 GB.
    Each replica runs its part of every slice, slice after slice."""

    rows: tuple[np.ndarray, ...]  # the global row ids of each slice
    plans: tuple[Any, ...]

    @property
    def summary(self) -> dict[str, Any]:
        keys = (
            "computed_prompt_tokens",
            "prompt_tokens",
            "num_groups",
            "num_shared_groups",
            "planning_seconds",
            "num_units",
        )
        sums = {k: sum(p.summary[k] for p in self.plans) for k in keys}
        total = max(sums["prompt_tokens"], 1)

        def ratio(k: str) -> float:
            return sum(p.summary[k] * p.summary["prompt_tokens"] for p in self.plans) / total

        worst = max(p.summary["predicted_seconds_max_over_mean"] for p in self.plans)
        return {
            **sums,
            "single_level_token_saving_ratio": ratio("single_level_token_saving_ratio"),
            "optimal_token_saving_ratio": ratio("optimal_token_saving_ratio"),
            "num_slices": len(self.plans),
            "predicted_seconds_max_over_mean": worst,
        }


def make_plan(
    w: Workload,
    num_replicas: int,
    block_size: int = BLOCK_SIZE,
    order_lcp: tuple[np.ndarray, np.ndarray] | None = None,
    stealing: bool = False,
) -> Any:
    """plan_workload, or a SlicedPlan of PLAN_SLICE_ROWS-row slices when nothing is shared."""
    order_lcp = order_lcp or trie_order_lcp(w)
    if len(w) <= PLAN_SLICE_ROWS or order_lcp[1].max(initial=0) > 0:
        return plan_workload(w, num_replicas, block_size, order_lcp=order_lcp, stealing=stealing)
    slices = tuple(np.arange(lo, min(lo + PLAN_SLICE_ROWS, len(w))) for lo in range(0, len(w), PLAN_SLICE_ROWS))
    return SlicedPlan(
        slices, tuple(plan_workload(w.subset(rows), num_replicas, block_size, stealing=stealing) for rows in slices)
    )


def _ancestor_at_depth(w: Workload, nodes: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """The ancestor-or-self of each node whose depth is exactly the given one (it must exist)."""
    out = nodes.copy()
    idx = np.flatnonzero(w.depth[out] > depths)
    while len(idx):
        out[idx] = w.parent[out[idx]]
        idx = idx[w.depth[out[idx]] > depths[idx]]
    if np.any(w.depth[out] != depths):
        raise AssertionError("a plan prefix ends inside a segment: the trie and the plan disagree")
    return out


def plan_stream(w: Workload, plan: Any, outs: np.ndarray | None = None, cut_units: bool = True) -> PlanStream:
    """The plan's rows in plan order, cut into its units. A unit or run boundary starts a piece
    (Plan.units: a run cut by a unit boundary gives each unit its piece, same prefix); a piece
    of several rows is preceded by its OWNER, a piece of one is a whole prompt (it shares
    nothing). outs: [n] decoded tokens per row (default the caps the plan was told).
    cut_units=False: the runs uncut (Plan.groups), each replica's part one unit."""
    outs = w.output_len if outs is None else outs
    if isinstance(plan, SlicedPlan):
        return _sliced_stream(w, plan, outs, cut_units)
    t = plan.table
    rows = t.column("row_id").to_numpy().astype(np.int64)
    rep = t.column("replica").to_numpy().astype(np.int64)
    unit_starts = plan.unit_starts if cut_units else plan.run_starts[plan.replica_runs]
    unit_seconds = np.asarray(plan.unit_seconds if cut_units else np.zeros(plan.num_replicas), float)
    cuts = np.union1d(plan.run_starts, unit_starts).astype(np.int64)
    piece_len = np.diff(cuts)
    plen = np.repeat(np.where(piece_len > 1, t.column("prefix_len").to_numpy()[cuts[:-1]], 0), piece_len)
    end = w.end_node[rows]
    anchor = np.zeros(len(rows), np.int64)
    shared = plen > 0
    anchor[shared] = _ancestor_at_depth(w, end[shared], plen[shared].astype(np.int64))
    first = np.zeros(len(rows), bool)
    first[cuts[:-1]] = True
    first &= shared
    n_items = len(rows) + int(first.sum())
    pos = np.arange(len(rows)) + np.cumsum(first)  # members after their owner
    owner_pos = pos[first] - 1
    kind, node, anc = (np.zeros(n_items, np.int64) for _ in range(3))
    replica, out, row = (np.zeros(n_items, np.int64) for _ in range(3))
    kind[pos], node[pos], anc[pos] = np.where(shared, MEMBER, PLAIN), end, anchor
    replica[pos], out[pos], row[pos] = rep, outs[rows], rows
    kind[owner_pos], node[owner_pos], anc[owner_pos] = OWNER, anchor[first], anchor[first]
    replica[owner_pos], out[owner_pos], row[owner_pos] = rep[first], 0, -1
    u = unit_starts[:-1]  # uncut, a replica with no rows is an empty unit (at n possibly)
    starts = np.r_[np.r_[pos, n_items][u] - np.r_[first, False][u], n_items].astype(np.int64)
    owner = rep[u] if cut_units else np.arange(plan.num_replicas, dtype=np.int64)
    unit_shared = plan.unit_shared if cut_units else np.zeros(plan.num_replicas, np.int64)
    return PlanStream(_Items(kind, node, anc, replica, out, row), starts, owner, unit_seconds, unit_shared)


def _sliced_stream(w: Workload, plan: SlicedPlan, outs: np.ndarray, cut_units: bool) -> PlanStream:
    """Each slice's stream (rows renumbered to the whole workload's), slice after slice."""
    parts = [plan_stream(w.subset(rows), p, outs[rows], cut_units) for rows, p in zip(plan.rows, plan.plans)]
    for rows, part in zip(plan.rows, parts):
        part.items.row[part.items.row >= 0] = rows[part.items.row[part.items.row >= 0]]
    offsets = np.cumsum([0] + [len(p.items.kind) for p in parts])
    starts = np.concatenate([p.unit_starts[:-1] + o for p, o in zip(parts, offsets)] + [offsets[-1:]])
    return PlanStream(
        _concat([p.items for p in parts]),
        starts,
        np.concatenate([p.unit_owner for p in parts]),
        np.concatenate([p.unit_seconds for p in parts]),
        np.concatenate([p.unit_shared for p in parts]),
    )
