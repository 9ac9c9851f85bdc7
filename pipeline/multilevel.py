"""Multi-level sharing: nested groups, run depth first, split by subtree (the batchllm order).

BatchLLM's groups share one level of prefix (grouping.py). Deeper prefixes, such as a chat's
turn k+1 extending turn k, are then computed again by every group below. The engines already
reuse deeper levels through their hashed prefix cache (vLLM's automatic prefix caching, the
native block manager's second-level reuse, BatchLLM Sec. 3.2 last paragraph) provided that
what shares a prefix runs close together on one replica. So:

1. Nested groups: a group at every tree node that is at least `min_prefix_len` deep and ends a
   prompt's shared part (has a leaf child); each prompt joins its deepest group. A group's
   prefix is computed once (its own KV owner, hashed from the root); it extends its parent
   group's prefix, which is in the cache by then, so it computes only its own edge (from the
   last whole KV block of the parent's prefix on). A group with one member needs no owner: the
   member runs as a whole prompt, hashed from the root too, and finds the same blocks.
2. Depth-first order over the tree (SGLang's radix-cache order): at each node its members
   first (BatchLLM Eq. 2 order), then its child subtrees, so a prefix is computed just before
   the groups that extend it and is held by running members meanwhile.
3. Units for the partition: contiguous stretches of that order that share nothing but their
   parent's prefix (whole subtrees, or consecutive siblings of one parent merged up to a cap).
   partition.py's dual scanner pairs compute-dense and memory-dense units per replica
   (BlendServe Sec. 5.5) and cuts at most a few of them; a chat's chain stays on one replica.

Predicted costs are what the engines compute with that cache (cost_model.py), so the
partition balances the work the replicas will really do. Everything is numpy over the tree's
arrays: ancestor sums by pointer jumping (O(nodes x log depth)), no Python loop per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixflow.pipeline.cost_model import CostModel, density
from prefixflow.pipeline.grouping import Grouping
from prefixflow.pipeline.homes import HomeHits
from prefixflow.pipeline.partition import Affinity, Partition, ReplicaRuns, partition_runs
from prefixflow.pipeline.prefix_tree import PrefixTree

UNITS_PER_REPLICA = 32  # merged units are at most this share of a replica's work
STICKY_CUT = 0.25  # a cut recomputing more than this share of a unit's cap joins its units
# ... for engines that steal: stealing evens out the balance at the unit grain that the cut would
# buy, so only cuts as cheap as a system prompt's stay (a document's prefix of 250 tokens and up
# joins at scale_bench's grain; bench/results/scale_bench.json's notes).
STICKY_CUT_STEALING = 0.02


@dataclass(frozen=True, slots=True, eq=False)
class NestedGrouping:
    """grouping: each prompt's deepest group (Grouping.group_node, prefix_len; saved_tokens: what
    the nested groups save run in row_order on one replica, whole KV blocks only).
    row_order: [n] prompt indices depth first (at each node its members, then child subtrees).
    prev_lcp: [n] tokens row_order[i] shares with row_order[i - 1] (0 for the first).
    node_start: [num_nodes] position in row_order where each node's subtree starts.
    leaf_of: [n] each prompt's leaf node.
    """

    grouping: Grouping
    row_order: np.ndarray
    prev_lcp: np.ndarray
    node_start: np.ndarray
    leaf_of: np.ndarray


def nested_groups(
    tree: PrefixTree, lengths: np.ndarray, output_lens: np.ndarray | None, min_prefix_len: int = 1, block_size: int = 1
) -> NestedGrouping:
    """Nested groups and their depth-first order (module docstring, steps 1 and 2)."""
    num_nodes, n = tree.num_nodes, len(tree.order)
    leaves = np.flatnonzero(tree.leaf_seq >= 0)
    parent = np.maximum(tree.parent, 0)
    formed = np.zeros(num_nodes, dtype=bool)
    formed[tree.parent[leaves]] = True
    formed &= (tree.leaf_seq < 0) & (tree.depth >= min_prefix_len)
    formed[0] = False
    up = np.where(formed, np.arange(num_nodes), parent)  # nearest group at or above a node
    up[0] = 0
    group_node = np.zeros(n, dtype=np.int64)
    group_node[tree.leaf_seq[leaves]] = _jump_to_fixed_point(up)[tree.parent[leaves]]
    decode = np.ones(n) if output_lens is None else np.asarray(output_lens, dtype=np.float64)
    member_key = -decode / np.maximum(lengths, 1)  # BatchLLM Eq. 2: more decode first
    node_start = _dfs_starts(tree, member_key, -_subtree_r(tree, lengths, decode, output_lens is not None))
    row_order = np.empty(n, dtype=np.int64)
    row_order[node_start[leaves]] = tree.leaf_seq[leaves]
    # The previous row shares exactly the deepest ancestor that started before it (preorder):
    # climb from each leaf while the parent's subtree starts at the same row.
    same = np.where(node_start[parent] == node_start, parent, np.arange(num_nodes))
    same[0] = 0
    top = _jump_to_fixed_point(same)
    leaf_of = np.zeros(n, dtype=np.int64)
    leaf_of[tree.leaf_seq[leaves]] = leaves
    prev_lcp = tree.depth[parent[top[leaf_of[row_order]]]]
    if n:
        prev_lcp[0] = 0
    grouping = Grouping(group_node, tree.depth[group_node], 0)
    starts = group_runs(grouping, row_order, np.zeros(n, dtype=np.int64))
    computed = computed_tokens(grouping, lengths, starts, row_order, prev_lcp, block_size)
    saved = int(lengths.sum()) - int(computed.sum())
    return NestedGrouping(Grouping(group_node, grouping.prefix_len, saved), row_order, prev_lcp, node_start, leaf_of)


def _jump_to_fixed_point(up: np.ndarray) -> np.ndarray:
    while True:
        nxt = up[up]
        if np.array_equal(nxt, up):
            return up
        up = nxt


def _subtree_r(tree: PrefixTree, lengths: np.ndarray, decode: np.ndarray, known: bool) -> np.ndarray:
    """BatchLLM Eq. 3 per subtree: decode tokens over the distinct prompt tokens it computes
    below its parent (each edge once); without output lengths each decode counts 1 and
    R = 1 / tokens. Distinct tokens: the sorted leaves' lengths less what each shares with
    the leaf before it (the first one: its parent's depth), in integers."""
    lens = _range_sums(tree, lengths[tree.order].astype(np.int64))
    cum_lcp = np.r_[0, np.cumsum(tree.lcp, dtype=np.int64)]
    shared = cum_lcp[np.maximum(tree.hi - 1, tree.lo)] - cum_lcp[tree.lo]
    tokens = lens - shared - tree.depth[np.maximum(tree.parent, 0)] * (tree.parent >= 0)
    decode_sums = _range_sums(tree, np.rint(decode[tree.order]).astype(np.int64)) if known else 1
    r: np.ndarray = decode_sums / np.maximum(tokens, 1)
    return r


def _range_sums(tree: PrefixTree, per_position: np.ndarray) -> np.ndarray:
    """Sums over each node's sorted positions, in integers: equal subtrees tie exactly."""
    cum = np.r_[0, np.cumsum(per_position, dtype=np.int64)]
    sums: np.ndarray = cum[tree.hi] - cum[tree.lo]
    return sums


def _dfs_starts(tree: PrefixTree, member_key: np.ndarray, inner_key: np.ndarray) -> np.ndarray:
    """Preorder position of each node's first prompt: at each node its leaves first (by
    member_key, then input order), then its inner children (by inner_key, then their first
    prompt's input position). pos(v) = sum over the path of the prompts in earlier siblings'
    subtrees, summed by pointer jumping."""
    nodes = np.arange(1, tree.num_nodes)
    n = len(tree.order)
    # one int64 sort key: (parent, leaves by member_key then input order, then inner children)
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(member_key, kind="stable")] = np.arange(n, dtype=np.int64)
    inner = np.flatnonzero(tree.leaf_seq < 0)
    inner_rank = np.empty(tree.num_nodes, dtype=np.int64)
    inner_rank[inner[np.lexsort((tree.first_seq[inner], inner_key[inner]))]] = np.arange(len(inner))
    leaf = tree.leaf_seq[nodes]
    within = np.where(leaf >= 0, rank[np.maximum(leaf, 0)], n + inner_rank[nodes])
    sib = nodes[np.argsort(tree.parent[nodes] * (n + tree.num_nodes + 1) + within, kind="stable")]
    size = tree.num_leaves[sib]
    before = np.cumsum(size) - size
    par = tree.parent[sib]
    first_of_parent = np.r_[True, par[1:] != par[:-1]] if len(sib) else np.zeros(0, bool)
    base = np.maximum.accumulate(np.where(first_of_parent, np.arange(len(sib)), 0))
    offset = np.zeros(tree.num_nodes, dtype=np.int64)
    offset[sib] = before - before[base]
    anc = np.maximum(tree.parent, 0)
    while np.any(anc != 0):  # offset[v]: sum from v up to, not including, anc[v]
        offset, anc = offset + offset[anc], anc[anc]
    return offset


def group_runs(grouping: Grouping, order: np.ndarray, replica: np.ndarray) -> np.ndarray:
    """Run starts (plus len(order)): maximal stretches of one group on one replica; an
    ungrouped prompt is a run of its own. replica: [len(order)] replica of each position."""
    key = grouping.group_node[order]
    new = (
        np.r_[True, (key[1:] != key[:-1]) | (key[1:] == 0) | (replica[1:] != replica[:-1])]
        if len(key)
        else np.zeros(0, bool)
    )
    run_starts: np.ndarray = np.r_[np.flatnonzero(new), len(key)].astype(np.int64)
    return run_starts


def run_prefix_lens(grouping: Grouping, lengths: np.ndarray, run_starts: np.ndarray, order: np.ndarray) -> np.ndarray:
    """[num_runs] the shared prefix of each run: its group's, or 0 (its rows run as whole
    prompts, hashed from the root) for an ungrouped prompt, a run of one, or a run whose
    prompts all equal the prefix (each would compute its last token after the owner)."""
    if not len(order):
        return np.zeros(0, dtype=np.int64)
    prefix = grouping.prefix_len[order[run_starts[:-1]]]
    longest = np.maximum.reduceat(lengths[order], run_starts[:-1])
    return np.where((np.diff(run_starts) > 1) & (longest > prefix), prefix, 0)


def row_cached(
    grouping: Grouping,
    lengths: np.ndarray,
    run_starts: np.ndarray,
    order: np.ndarray,
    prev_lcp: np.ndarray,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the engines do not compute, rows in `order` on one replica after another:
    (cached tokens of each row, each run's prefix length, tokens its prefix owner finds cached).
    A member attends to its run's prefix (all but the last token when its prompt is the
    prefix). A run's owner, or a whole prompt, finds in the cache what it shares with the row
    before it (prev_lcp: in a depth-first order no earlier row shares more), in whole blocks,
    the prompt's last token always computed."""
    run_prefix = run_prefix_lens(grouping, lengths, run_starts, order)
    run_len = np.diff(run_starts)
    first_lcp = prev_lcp[run_starts[:-1]]
    owner_hit = (np.minimum(first_lcp, run_prefix) // block_size) * block_size
    p = lengths[order]
    prefix = np.repeat(run_prefix, run_len)
    cached = np.where(p > prefix, prefix, np.maximum(prefix - 1, 0))
    whole = (np.minimum(prev_lcp, p - 1) // block_size) * block_size
    cached = np.where(prefix == 0, np.maximum(whole, 0), cached)
    return cached, run_prefix, np.where(run_prefix > 0, owner_hit, 0)


def computed_tokens(
    grouping: Grouping,
    lengths: np.ndarray,
    run_starts: np.ndarray,
    order: np.ndarray,
    prev_lcp: np.ndarray,
    block_size: int,
) -> np.ndarray:
    """[num_runs] prompt tokens each run computes: its owner's new prefix tokens and its rows'."""
    cached, run_prefix, owner_hit = row_cached(grouping, lengths, run_starts, order, prev_lcp, block_size)
    rows = lengths[order] - cached
    per_run = np.add.reduceat(rows, run_starts[:-1]) if len(rows) else np.zeros(0, np.int64)
    computed: np.ndarray = per_run + run_prefix - owner_hit
    return computed


def row_seconds(
    cm: CostModel,
    grouping: Grouping,
    lengths: np.ndarray,
    outs: np.ndarray,
    run_starts: np.ndarray,
    order: np.ndarray,
    prev_lcp: np.ndarray,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(T_comp of each row of `order`, T_comp of each run's prefix owner, T_mem of each row)."""
    cached, run_prefix, owner_hit = row_cached(grouping, lengths, run_starts, order, prev_lcp, block_size)
    p, d = lengths[order], outs[order]
    owner = cm.compute_seconds(run_prefix, np.zeros_like(run_prefix), owner_hit)
    return cm.compute_seconds(p, d, cached), owner, cm.memory_seconds(p, d)


def boundary_lcp(tree: PrefixTree, ng: NestedGrouping, order: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Tokens order[i] shares with order[i - 1] for each i in `at` (rows that were not
    neighbours in row_order): the depth of their lowest common ancestor, found by climbing."""
    parent, depth = tree.parent.tolist(), tree.depth
    out = np.zeros(len(at), dtype=np.int64)
    for k, i in enumerate(at.tolist()):
        if i == 0:
            continue
        seen, v = set(), int(ng.leaf_of[order[i - 1]])
        while v > 0:
            seen.add(v)
            v = parent[v]
        v = int(ng.leaf_of[order[i]])
        while v > 0 and v not in seen:
            v = parent[v]
        out[k] = depth[max(v, 0)]
    return out


def merged_units(
    tree: PrefixTree,
    ng: NestedGrouping,
    row_cost: np.ndarray,
    num_replicas: int,
    cut_cost: np.ndarray | None = None,
    row_home: np.ndarray | None = None,
    sticky: float = STICKY_CUT,
) -> tuple[np.ndarray, np.ndarray]:
    """(unit starts in row_order plus n, family of each unit), module docstring step 3. A unit
    root is a node whose subtree costs at most cap (a replica's share / UNITS_PER_REPLICA)
    under a parent that costs more (a leaf costing more is a unit of its own); consecutive
    units under one parent merge while their sum stays within cap. The loose members of one
    group (it costs more than cap) are chunks of one family: the partition sorts a family as
    one, so its chunks stay next to each other and a replica's chunks form one run.
    cut_cost: [n] seconds row i recomputes when the row before it runs elsewhere (what it
    shares with it); units whose cut would cost more than `sticky` of the cap stay in one family
    (_costly_cuts), unless their homes differ.
    row_home: [n] the replica holding each row's prefix from earlier windows, -1 for none (rows
    in row_order): units whose first rows have different homes are not merged."""
    n = len(row_cost)
    if n == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    cum = np.r_[0.0, np.cumsum(row_cost)]
    cap = cum[-1] / (num_replicas * UNITS_PER_REPLICA)
    start = ng.node_start
    ok = cum[start + tree.num_leaves] - cum[start] <= cap
    ok[0] = False
    parent = np.maximum(tree.parent, 0)
    root = (ok & ~ok[parent]) | ((tree.leaf_seq >= 0) & ~ok)
    root[0] = False
    roots = np.flatnonzero(root)
    roots = roots[np.argsort(start[roots], kind="stable")]  # disjoint, covering 0..n-1
    unit_start, key = start[roots], parent[roots]
    leaf = tree.leaf_seq[roots]
    member = (leaf >= 0) & (ng.grouping.group_node[np.maximum(leaf, 0)] == key) & (key > 0)
    seg = np.r_[True, (key[1:] != key[:-1]) | (member[1:] != member[:-1])]
    if row_home is not None:
        home = row_home[unit_start]
        seg[1:] |= home[1:] != home[:-1]
    seg_id = np.cumsum(seg) - 1
    seg_base = cum[unit_start][np.flatnonzero(seg)][seg_id]
    chunk = np.floor((cum[unit_start] - seg_base) / max(cap, 1e-30)).astype(np.int64)
    new = seg | np.r_[True, chunk[1:] != chunk[:-1]]
    unit_id = np.cumsum(new) - 1
    family = np.where(member, -1 - seg_id, unit_id)[new]
    starts = unit_start[new]
    if cut_cost is not None:
        homes = None if row_home is None else row_home[starts]
        family = _costly_cuts(family, cut_cost[starts], sticky * cap, homes)
    return np.r_[starts, n].astype(np.int64), np.unique(family, return_inverse=True)[1].ravel()


def _costly_cuts(family: np.ndarray, cost: np.ndarray, limit: float, homes: np.ndarray | None = None) -> np.ndarray:
    """Join a unit to the family before it when splitting them costs more than `limit` seconds
    (STICKY_CUT of a unit's cap; STICKY_CUT_STEALING for engines that steal): scattered, it
    would recompute what it shares with the unit before (a chat's history, when a job is so
    small that one chain spans several units; a document asked many questions). The cap is what the
    split buys (balance at that grain), so at cluster scale, where a unit holds thousands of
    prompts, only cuts below a system prompt happen and none is joined. Families stay contiguous
    stretches of units, scanned as one (partition.py cuts inside one only to fill a replica).
    homes: [k] a replica holding each unit's first row's prefix from earlier windows (the lowest
    of them, HomeHits.first_home; -1: none): a unit never joins a family whose home is another
    replica. A family has one home (_affinity), so the join would send one of them away from
    the cache that holds its prefix, which costs more than the cut: in a small window (a
    windowed job's first ones) every document's prefix costs more than STICKY_CUT of the cap,
    and joined families of documents from different replicas were most of what windows
    recomputed (bench/stream_bench.py)."""
    joined = np.r_[False, (family[1:] == family[:-1]) | (cost[1:] > limit)] if len(family) else family
    out = np.zeros(len(family), dtype=np.int64)
    current, current_home = 0, -1  # the family being built, and its home (-1: none yet)
    for i in range(len(family)):
        home = -1 if homes is None else int(homes[i])
        elsewhere = family[i] != family[i - 1] and home >= 0 and current_home >= 0 and home != current_home
        if i > 0 and (not joined[i] or elsewhere):
            current, current_home = current + 1, -1
        out[i] = current
        current_home = home if current_home < 0 else current_home
    return out


def plan_multi_level(
    tree: PrefixTree,
    ng: NestedGrouping,
    lengths: np.ndarray,
    outs: np.ndarray,
    cm: CostModel,
    num_replicas: int,
    block_size: int,
    stealing: bool = False,
    hits: HomeHits | None = None,
) -> ReplicaRuns:
    """Split the depth-first order's units across replicas (dual scan, BlendServe Sec. 5.5),
    each replica running its parts in depth-first order, then cut into runs. Depth-first, not
    in the order the scan took them: a replica's rows are then a subsequence of a preorder,
    where no earlier row shares more with a row than the one just before it, so the
    prediction's cache hits are the engine's (taken in scan order, a part followed a part of
    the other end and found in the cache what two parts back had left, or had lost it).
    stealing: the replicas steal units at run time: small pieces may join their group's replica
    (build_plan). hits: what rows find in the replicas' caches from earlier windows (homes.py)."""
    n, order, g = len(lengths), ng.row_order, ng.grouping
    starts = group_runs(g, order, np.zeros(n, dtype=np.int64))
    comp, owner, mem = row_seconds(cm, g, lengths, outs, starts, order, ng.prev_lcp, block_size)
    comp[starts[:-1]] += owner
    cut_cost = cm.prefix_seconds((ng.prev_lcp // block_size) * block_size)
    home_s, row_home = _home_costs(cm, hits, order, ng.prev_lcp, block_size, comp)
    sticky = STICKY_CUT_STEALING if stealing else STICKY_CUT
    units, family = merged_units(tree, ng, comp + mem, num_replicas, cut_cost, row_home, sticky)
    unit_owner = _owners_to_units(comp, owner, starts, units)
    affinity = _affinity(units, family, home_s, hits, order, num_replicas) if hits is not None else None
    part = _partition_units(units, family, comp, mem, unit_owner, cut_cost, num_replicas, stealing, affinity)
    pos, replica = _parts_in_replica_order(part, n)
    seq_index = order[pos]
    prev_lcp = _final_prev_lcp(tree, ng, pos, seq_index, replica)
    run_starts = group_runs(g, seq_index, replica)
    run_computed = computed_tokens(g, lengths, run_starts, seq_index, prev_lcp, block_size)
    run_replica = replica[run_starts[:-1]] if n else np.zeros(0, np.int64)
    final_c, final_owner, final_m = row_seconds(cm, g, lengths, outs, run_starts, seq_index, prev_lcp, block_size)
    final_c[run_starts[:-1]] += final_owner

    def per(x: np.ndarray) -> np.ndarray:
        return np.bincount(replica, weights=x, minlength=num_replicas)

    # Saved tokens the split gave up: these rows' computation here, less in the uncut order.
    lost = np.bincount(run_replica, weights=run_computed, minlength=num_replicas) - per(
        _row_computed(g, lengths, starts, order, ng.prev_lcp, block_size)[pos]
    )
    home_hit = np.zeros(n, dtype=np.int64)
    if hits is not None:  # what the rows find on their replica, left by earlier windows
        home_hit = _found_at_home(hits, seq_index, replica, prev_lcp, block_size)
        run_computed = run_computed - (np.add.reduceat(home_hit, run_starts[:-1]) if n else 0)
        final_c -= _home_seconds(cm, home_hit, prev_lcp, block_size)
    preds = _predicted(part, per(final_c), per(final_m), lost)
    replica_runs = np.searchsorted(run_replica, np.arange(num_replicas + 1)).astype(np.int64)
    return ReplicaRuns(
        seq_index,
        run_starts,
        run_prefix_lens(g, lengths, run_starts, seq_index),
        run_computed,
        run_replica,
        replica_runs,
        preds,
        int(home_hit.sum()),
        prev_lcp,
    )


def _predicted(part: Partition, seconds: np.ndarray, memory: np.ndarray, lost: np.ndarray) -> Partition:
    """The scan's parts with each replica's predicted seconds and memory as placed in
    depth-first order, and the saved tokens the split gave up (never below 0)."""
    lost_tokens = np.maximum(np.rint(lost), 0).astype(np.int64)
    return Partition(
        part.part_lo, part.part_hi, part.part_run, part.part_replica, part.replica_parts, seconds, memory, lost_tokens
    )


def _owners_to_units(comp: np.ndarray, owner: np.ndarray, starts: np.ndarray, units: np.ndarray) -> np.ndarray:
    """[num_units] the prefix owner's seconds each unit carries, taken off its run's first row
    in `comp` (in place). A unit inside one run (a group's members, or one of k chunks of them)
    carries the run's owner (a k-th of it): a part holding a unit's rows computes the owner once
    (partition.py prices it per part), and a replica holding some of the k chunks pays it once too."""
    run = np.searchsorted(starts, units[:-1], "right") - 1
    inside = units[1:] <= starts[np.minimum(run + 1, len(starts) - 1)]
    chunks = np.bincount(run[inside], minlength=len(owner))
    unit_owner = np.where(inside, owner[run] / np.maximum(chunks[run], 1), 0.0) if len(owner) else np.zeros(0)
    comp[starts[:-1][np.unique(run[inside])]] -= owner[np.unique(run[inside])]
    return unit_owner


def _partition_units(
    units: np.ndarray,
    family: np.ndarray,
    comp: np.ndarray,
    mem: np.ndarray,
    unit_owner: np.ndarray,
    cut_cost: np.ndarray,
    num_replicas: int,
    stealing: bool,
    affinity: Affinity | None = None,
) -> Partition:
    """The dual scan over the units (partition.py), a family's units sorted as one by the
    family's density; with stealing, pieces under a unit's share may join their group's replica;
    affinity: each unit's home and what it saves there, placed first (partition.py)."""
    cum_c, cum_m = np.r_[0.0, np.cumsum(comp)], np.r_[0.0, np.cumsum(mem)]
    fam_c = np.bincount(family, weights=np.diff(cum_c[units]) + unit_owner)
    fam_m = np.bincount(family, weights=np.diff(cum_m[units]))
    return partition_runs(
        units,
        comp,
        mem,
        unit_owner,
        np.zeros(len(units) - 1, np.int64),
        num_replicas,
        run_density=density(fam_c, fam_m)[family],
        row_cut_compute=cut_cost,
        join_s=float(comp.sum() + unit_owner.sum()) / (num_replicas * UNITS_PER_REPLICA) if stealing else 0.0,
        affinity=affinity,
    )


def _home_tokens(hits: HomeHits, order: np.ndarray, prev_lcp: np.ndarray, block_size: int) -> np.ndarray:
    """[n] tokens each row of `order` finds in the homes beyond what the row before it left in
    the cache (in whole blocks; its hit is at most its length - 1)."""
    base = (prev_lcp // block_size) * block_size
    found: np.ndarray = np.maximum(hits.hit[order] - base, 0)
    return found


def _home_costs(
    cm: CostModel, hits: HomeHits | None, order: np.ndarray, prev_lcp: np.ndarray, block_size: int, comp: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """(seconds each row of `order` saves where its hit is, each row's home or None), and
    `comp` less what rows find on every replica (in place)."""
    if hits is None:
        return np.zeros(len(order)), None
    home_s = _home_seconds(cm, _home_tokens(hits, order, prev_lcp, block_size), prev_lcp, block_size)
    comp -= np.where(hits.everywhere[order], home_s, 0.0)
    return home_s, hits.first_home(len(order))[order]


def _found_at_home(
    hits: HomeHits, seq_index: np.ndarray, replica: np.ndarray, prev_lcp: np.ndarray, block_size: int
) -> np.ndarray:
    """[n] tokens each plan row finds in its own replica's cache from earlier windows."""
    row_replica = np.empty(len(seq_index), dtype=np.int64)
    row_replica[seq_index] = replica
    found: np.ndarray = _home_tokens(hits, seq_index, prev_lcp, block_size) * hits.on_replica(row_replica)[seq_index]
    return found


def _home_seconds(cm: CostModel, found: np.ndarray, prev_lcp: np.ndarray, block_size: int) -> np.ndarray:
    """[n] compute seconds rows save by finding `found` tokens (_home_tokens) past what the row
    before each left in the cache."""
    base = (prev_lcp // block_size) * block_size
    saved: np.ndarray = cm.compute_seconds(base + found, np.zeros(len(found)), base)
    return saved


def _affinity(
    units: np.ndarray, family: np.ndarray, home_s: np.ndarray, hits: HomeHits, order: np.ndarray, num_replicas: int
) -> Affinity:
    """Each unit's home replica (-1 for none) and the seconds its rows save there. A family's
    units share one home, the replica where the family's rows save the most, so that a chain
    placed at home is not cut."""
    num_units, num_families = len(units) - 1, int(family.max()) + 1 if len(family) else 0
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    pos = position[hits.pair_row]
    unit = np.searchsorted(units, pos, "right") - 1
    weight, rep = home_s[pos], hits.pair_replica
    by_family = np.bincount(family[unit] * num_replicas + rep, weights=weight, minlength=num_families * num_replicas)
    by_family = by_family.reshape(num_families, num_replicas)
    home = np.where(by_family.max(axis=1) > 0, by_family.argmax(axis=1), -1)[family] if num_families else family
    by_unit = np.bincount(unit * num_replicas + rep, weights=weight, minlength=num_units * num_replicas)
    saving = by_unit.reshape(num_units, num_replicas)[np.arange(num_units), np.maximum(home, 0)]
    return Affinity(home.astype(np.int64), np.where(home >= 0, saving, 0.0), family)


def _parts_in_replica_order(part: Partition, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(position in row_order of each plan row, its replica): the parts laid end to end in the
    partition's order (replica by replica), each part's rows in depth-first order."""
    part_len = part.part_hi - part.part_lo
    new_starts = np.r_[0, np.cumsum(part_len)].astype(np.int64)
    pos = np.arange(n, dtype=np.int64) + np.repeat(part.part_lo - new_starts[:-1], part_len)
    replica = np.repeat(part.part_replica.astype(np.int64), part_len)
    return pos, replica


def _final_prev_lcp(
    tree: PrefixTree, ng: NestedGrouping, pos: np.ndarray, seq_index: np.ndarray, replica: np.ndarray
) -> np.ndarray:
    """prev_lcp in plan order: a replica's first row shares nothing; a row whose neighbour
    changed (a part boundary) shares their lowest common ancestor."""
    prev_lcp: np.ndarray = ng.prev_lcp[pos]
    if not len(pos):
        return prev_lcp
    first = np.r_[True, replica[1:] != replica[:-1]]
    moved = np.flatnonzero(np.r_[False, pos[1:] != pos[:-1] + 1] & ~first)
    prev_lcp[moved] = boundary_lcp(tree, ng, seq_index, moved)
    prev_lcp[first] = 0
    return prev_lcp


def _row_computed(
    g: Grouping, lengths: np.ndarray, run_starts: np.ndarray, order: np.ndarray, prev_lcp: np.ndarray, block_size: int
) -> np.ndarray:
    """Prompt tokens each row of `order` computes, its run's owner charged to its first row."""
    cached, run_prefix, owner_hit = row_cached(g, lengths, run_starts, order, prev_lcp, block_size)
    rows: np.ndarray = (lengths[order] - cached).astype(np.float64)
    if len(rows):
        rows[run_starts[:-1]] += run_prefix - owner_hit
    return rows
