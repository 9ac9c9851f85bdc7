"""BlendServe ordering: resource-aware prefix tree, layer-wise sort, conditional split, dual scan.

BlendServe (Sec. 5) orders an offline job so that every stretch of the run mixes compute-dense
work (long prompts, short outputs) with memory-dense work (long decodes) at the ratio of the
whole job, while keeping requests that share a prefix together:

1. Resource-aware tree (Sec. 5.1): each node gets the compute and memory time of the requests in
   its subtree (cost_model.py); a group's shared prefix is computed once, so its compute is
   spread over its members. Node density = sum(T_comp) / sum(T_mem).
2. Layer-wise sort (Sec. 5.2, A.1): the children of every node in descending density. The leaves
   in depth-first order then run from compute-dense to memory-dense, up to local outliers.
3. Conditional split (Sec. 5.2, 5.4): outliers (leaves off the longest non-increasing run of
   densities) move under the root, where the sort places them by their own density. Moving a
   leaf away from its siblings recomputes the prefix it shared with them (depth of its parent).
   A leaf splits only if that cost is at most theta, the largest cost that keeps the total within
   1 - sharing_keep of the saved tokens (99% of the sharing kept). Repeat "sort, split" until
   (C1) the densities are non-increasing, or (C2) every outlier costs more than theta (or was
   split already: each leaf splits at most once).
4. Dual scan (Sec. 5.3, Alg. 3): scan from the compute-dense left end and the memory-dense right
   end at once. Per batch of KV memory M, split M = M_c + M_m so that
       M_c + M_m = M   and   rho_c * M_c + rho_m * M_m = rho_root * M,
   fill M_c from the left and M_m from the right. Chunks alternate sides (L R, R L, L R, ...),
   so a group cut at a batch boundary continues in the next chunk of its side. If the scan's
   cuts and the splits together lose more than 1 - sharing_keep of the saving, the splits are
   redone with what the scan leaves of that allowance.

Output lengths: given per request, or sampled for some (Sec. 5.1: unknown entries < 0 take the
mean of the samples in their smallest sampled subtree, i.e. their own or a sibling's), or a default.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from prefixflow.pipeline.cost_model import DEFAULT_OUTPUT_LEN, CostModel, density
from prefixflow.pipeline.grouping import Grouping, group_keys, runs
from prefixflow.pipeline.prefix_tree import PrefixTree


@dataclass(frozen=True, slots=True, eq=False)
class BlendServeResult:
    """order: [n] prompt indices in run order. sorted_order: after sort and split, before the scan.
    batch_starts: [num_batches + 1] positions in `order` where each dual-scan batch begins.
    stop_reason: "C1" (non-increasing) or "C2" (every outlier costs more than theta).
    sharing_kept: tokens `order` saves when cut into runs, over the grouping's saved tokens.
    """

    order: np.ndarray
    sorted_order: np.ndarray
    batch_starts: np.ndarray
    root_density: float
    num_splits: int
    split_cost_tokens: int
    theta: int
    stop_reason: str
    sharing_kept: float
    compute_s: np.ndarray
    memory_s: np.ndarray


def blendserve_order(
    tree: PrefixTree,
    grouping: Grouping,
    lengths: np.ndarray,
    output_lens: np.ndarray | None = None,
    cost_model: CostModel | None = None,
) -> np.ndarray:
    """The run order (a permutation of prompt indices) under BlendServe; see `blendserve_plan`."""
    return blendserve_plan(tree, grouping, lengths, output_lens, cost_model=cost_model).order


def blendserve_plan(
    tree: PrefixTree,
    grouping: Grouping,
    lengths: np.ndarray,
    output_lens: np.ndarray | None = None,
    *,
    cost_model: CostModel | None = None,
    sharing_keep: float = 0.99,
    kv_budget_bytes: float | None = None,
    default_output_len: int = DEFAULT_OUTPUT_LEN,
) -> BlendServeResult:
    """The BlendServe order with its diagnostics (module docstring, steps 1-4).

    output_lens: [n] estimates; entries < 0 are unknown (sampled estimation, Sec. 5.1); None:
        `default_output_len` for all. cost_model: model shape and hardware (default Llama-3.1-8B
        on H100). sharing_keep: share of the grouping's saved tokens the order must keep.
    kv_budget_bytes: the KV memory one batch fills (default: the hardware's budget).
    """
    if not 0.0 < sharing_keep <= 1.0:
        raise ValueError(f"sharing_keep={sharing_keep} is invalid: use a fraction in (0, 1], e.g. 0.99")
    cm = cost_model or CostModel()
    budget = cm.kv_budget_bytes if kv_budget_bytes is None else float(kv_budget_bytes)
    if budget <= 0:
        raise ValueError(f"kv_budget_bytes={kv_budget_bytes} is invalid: give a positive number of bytes")
    outs = estimate_output_lens(tree, output_lens, default_output_len)
    comp, mem = request_costs(cm, grouping, lengths, outs)
    kv_total = float((lengths + outs).sum()) * cm.model.kv_bytes_per_token
    # One batch per KV budget's worth of footprint, in memory time (see dual_scan).
    batch_mem_s = float(mem.sum()) * min(budget / max(kv_total, 1.0), 1.0)
    allowed = (1.0 - sharing_keep) * grouping.saved_tokens
    split = sort_and_split(tree, comp, mem, allowed)
    order, starts = dual_scan(split.order, comp, mem, batch_mem_s)
    # The scan cuts groups at batch edges too: if that pushes the loss past the allowance,
    # give the splits only what the scan leaves. (The scan can also join what the splits had
    # parted, a negative loss: that never widens the splits' allowance.)
    scan_loss = max(_saved_tokens(split.order, grouping) - _saved_tokens(order, grouping), 0)
    if split.num_splits and grouping.saved_tokens - _saved_tokens(order, grouping) > allowed:
        split = sort_and_split(tree, comp, mem, max(allowed - scan_loss, 0.0))
        order, starts = dual_scan(split.order, comp, mem, batch_mem_s)
    kept = _saved_tokens(order, grouping) / grouping.saved_tokens if grouping.saved_tokens else 1.0
    return BlendServeResult(
        order,
        split.order,
        starts,
        float(density(comp.sum(), mem.sum())),
        split.num_splits,
        split.cost_tokens,
        split.theta,
        split.stop_reason,
        kept,
        comp,
        mem,
    )


def estimate_output_lens(
    tree: PrefixTree, output_lens: np.ndarray | None, default: int = DEFAULT_OUTPUT_LEN
) -> np.ndarray:
    """Per-request output lengths; entries < 0 are unknown and estimated per subtree (Sec. 5.1)."""
    n = len(tree.order)
    if output_lens is None:
        return np.full(n, default, dtype=np.int64)
    outs = np.asarray(output_lens, dtype=np.int64)
    known = outs >= 0
    if known.all():
        return outs
    cum_sum = np.r_[0, np.cumsum(np.where(known, outs, 0)[tree.order])]
    cum_cnt = np.r_[0, np.cumsum(known[tree.order])]
    node_sum = (cum_sum[tree.hi] - cum_sum[tree.lo]).tolist()
    node_cnt = (cum_cnt[tree.hi] - cum_cnt[tree.lo]).tolist()
    parent = tree.parent.tolist()
    est = [float(default)] * tree.num_nodes
    for v in tree.post_order[::-1].tolist():  # parents before children
        if node_cnt[v]:
            est[v] = node_sum[v] / node_cnt[v]
        elif v:
            est[v] = est[parent[v]]
    leaves = np.flatnonzero(tree.leaf_seq >= 0)
    by_seq = np.empty(n, dtype=np.float64)
    by_seq[tree.leaf_seq[leaves]] = np.asarray(est)[leaves]
    return np.where(known, outs, np.rint(by_seq).astype(np.int64))


def request_costs(
    cm: CostModel, grouping: Grouping, lengths: np.ndarray, outs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """T_comp and T_mem per request; a group's prefix compute is spread over its members."""
    key = group_keys(grouping)
    _, gid, size = np.unique(key, return_inverse=True, return_counts=True)
    prefix = np.where(size[gid] > 1, grouping.prefix_len, 0)
    comp = cm.compute_seconds(lengths, outs, prefix) + cm.prefix_seconds(prefix) / size[gid]
    return comp, cm.memory_seconds(lengths, outs)


@dataclass(frozen=True, slots=True, eq=False)
class SplitResult:
    order: np.ndarray
    num_splits: int
    cost_tokens: int
    theta: int
    stop_reason: str


def sort_and_split(tree: PrefixTree, comp: np.ndarray, mem: np.ndarray, budget_tokens: float) -> SplitResult:
    """Layer-wise sort and conditional node split until C1 or C2 (Sec. 5.2, 5.4)."""
    n = len(tree.order)
    ptr, kids = tree.children()
    ptr, kids = ptr.tolist(), kids.tolist()
    children = [kids[ptr[v] : ptr[v + 1]] for v in range(tree.num_nodes)]
    parent = tree.parent.copy()
    node_c, node_m = _subtree_sums(tree, comp), _subtree_sums(tree, mem)
    leaf_rho = density(comp, mem)
    spent, num_splits, theta_out = 0.0, 0, -1
    while True:
        leaves = _sorted_leaves(children, density(node_c, node_m), tree.leaf_seq)
        seqs = tree.leaf_seq[leaves]
        rho, fixed = leaf_rho[seqs], parent[leaves] == 0
        outlier = _outliers(rho, fixed)
        if n == 0 or not outlier.any():
            return SplitResult(seqs, num_splits, int(spent), theta_out, "C1")
        cand = leaves[outlier & ~fixed]
        cost = tree.depth[parent[cand]]  # the prefix shared with its siblings, recomputed
        by_cost = np.argsort(cost, kind="stable")
        fits = np.cumsum(cost[by_cost]) <= budget_tokens - spent
        take = cand[by_cost[fits]]
        if len(take) == 0:  # C2: every outlier left costs more than the threshold
            return SplitResult(seqs, num_splits, int(spent), theta_out, "C2")
        theta_out = max(theta_out, int(cost[by_cost[fits]][-1]))
        spent += float(tree.depth[parent[take]].sum())
        num_splits += len(take)
        _move_to_root(take, children, parent, node_c, node_m)


def _outliers(rho: np.ndarray, fixed: np.ndarray) -> np.ndarray:
    """Leaves off a longest non-increasing run of densities that keeps every fixed leaf.

    Fixed leaves (children of the root) are already in density order among themselves; a
    movable leaf denser than a fixed leaf before it, or sparser than one after it, is an outlier;
    of the others, those off a longest non-increasing subsequence are outliers too.
    """
    big = np.finfo(np.float64).max
    min_before = np.minimum.accumulate(np.r_[big, np.where(fixed, rho, big)])[:-1]
    max_after = np.maximum.accumulate(np.r_[np.where(fixed, rho, -big), -big][::-1])[::-1][1:]
    out = ~fixed & ((rho > min_before) | (rho < max_after))
    free = np.flatnonzero(~fixed & ~out)
    out[free[~_longest_nonincreasing(rho[free])]] = True
    return out


def _move_to_root(
    take: np.ndarray, children: list[list[int]], parent: np.ndarray, node_c: np.ndarray, node_m: np.ndarray
) -> None:
    """Re-insert leaves under the root; their old ancestors lose their time (Sec. 5.2)."""
    moved = set(take.tolist())
    for v in set(parent[take].tolist()):
        children[v] = [c for c in children[v] if c not in moved]
    for leaf in take.tolist():
        v = int(parent[leaf])
        while v > 0:
            node_c[v] -= node_c[leaf]
            node_m[v] -= node_m[leaf]
            v = int(parent[v])
        parent[leaf] = 0
        children[0].append(leaf)


def _saved_tokens(order: np.ndarray, grouping: Grouping) -> int:
    """Prompt tokens the plan saves when `order` is cut into runs of one group (plan.py)."""
    starts = runs(order, grouping)
    run_len = np.diff(starts)
    prefix = np.where(run_len > 1, grouping.prefix_len[order[starts[:-1]]], 0) if len(order) else 0
    return int(((run_len - 1) * prefix).sum())


def _subtree_sums(tree: PrefixTree, per_seq: np.ndarray) -> np.ndarray:
    cum = np.r_[0.0, np.cumsum(per_seq[tree.order])]
    sums: np.ndarray = cum[tree.hi] - cum[tree.lo]
    # A leaf's own value, not a difference of running sums: those round differently with the
    # sort's order, and equal leaves must stay equal for ties to fall by input order.
    leaf = tree.leaf_seq >= 0
    sums[leaf] = per_seq[tree.leaf_seq[leaf]]
    return sums


def _sorted_leaves(children: list[list[int]], rho: np.ndarray, leaf_seq: np.ndarray) -> np.ndarray:
    """Leaf nodes depth first, children in descending density (stable)."""
    rho_l, is_leaf = _rounded(rho).tolist(), (leaf_seq >= 0).tolist()
    out: list[int] = []
    stack = [0]
    while stack:
        v = stack.pop()
        if is_leaf[v]:
            out.append(v)
            continue
        stack.extend(sorted(children[v], key=lambda c: rho_l[c]))  # pops densest first
    return np.asarray(out, dtype=np.int64)


def _rounded(values: np.ndarray, bits: int = 40) -> np.ndarray:
    """Values to `bits` of mantissa: sums that differ only in rounding (summation order) tie."""
    mantissa, exponent = np.frexp(values)
    rounded: np.ndarray = np.ldexp(np.round(mantissa * 2.0**bits), exponent - bits)
    return rounded


def _longest_nonincreasing(values: np.ndarray) -> np.ndarray:
    """Mask of one longest non-increasing subsequence (patience sorting, O(n log n))."""
    neg = (-values).tolist()
    tails: list[float] = []
    tail_idx: list[int] = []
    prev = [-1] * len(neg)
    for i, x in enumerate(neg):
        j = bisect_right(tails, x)
        prev[i] = tail_idx[j - 1] if j else -1
        if j == len(tails):
            tails.append(x)
            tail_idx.append(i)
        else:
            tails[j], tail_idx[j] = x, i
    mask = np.zeros(len(neg), dtype=bool)
    i = tail_idx[-1] if tail_idx else -1
    while i >= 0:
        mask[i] = True
        i = prev[i]
    return mask


def dual_scan(seq: np.ndarray, comp: np.ndarray, mem: np.ndarray, batch_mem_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Dual scanner (Sec. 5.3, Alg. 3) over `seq` sorted compute-dense first.

    Returns (order, batch_starts). Sec. 4.2: every decode step reads all resident KV, so a share
    of the KV memory is a share of each step's memory time. Each batch of T = `batch_mem_s`
    seconds of memory time is split T = T_c + T_m with rho_c * T_c + rho_m * T_m = rho_root * T
    (the paper's two constraints); rho_c and rho_m are the densities of the requests the two
    ends would admit, so T_c is found by bisection over how many requests the left end admits.
    """
    n = len(seq)
    cum_c, cum_m = np.r_[0.0, np.cumsum(comp[seq])], np.r_[0.0, np.cumsum(mem[seq])]
    rho_root = float(density(cum_c[-1], cum_m[-1]))
    lo, hi, starts, flip = 0, n, [0], False
    chunks: list[np.ndarray] = []
    while lo < hi:
        left, right = _balance(cum_c, cum_m, lo, hi, batch_mem_s, rho_root)
        if left == lo and right == hi:  # the batch is smaller than one request: take one
            left = lo + 1
        left_part, right_part = seq[lo:left], seq[right:hi][::-1]
        chunks.extend((right_part, left_part) if flip else (left_part, right_part))
        flip = not flip
        starts.append(starts[-1] + (left - lo) + (hi - right))
        lo, hi = left, right
    order = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    return order.astype(np.int64), np.asarray(starts, dtype=np.int64)


def _balance(cum_c: np.ndarray, cum_m: np.ndarray, lo: int, hi: int, t: float, rho_root: float) -> tuple[int, int]:
    """(left, right): admit lo..left-1 and right..hi-1 so that their memory time is about t and
    their compute is as close as possible to rho_root times it."""

    def right_of(j: int) -> int:
        return max(min(_from(cum_m, cum_m[hi] - max(t - (cum_m[j] - cum_m[lo]), 0.0)), hi), j)

    def excess(j: int) -> float:  # compute above the root density's share, for left end j
        r = right_of(j)
        c = cum_c[j] - cum_c[lo] + cum_c[hi] - cum_c[r]
        surplus: float = c - rho_root * (cum_m[j] - cum_m[lo] + cum_m[hi] - cum_m[r])  # a numpy float64
        return surplus

    a, b = lo, min(max(_upto(cum_m, cum_m[lo] + t), lo + 1), hi)
    if excess(b) <= 0:
        return b, right_of(b)
    while b - a > 1:  # excess grows with j while the left end is denser than the right one
        mid = (a + b) // 2
        a, b = (a, mid) if excess(mid) > 0 else (mid, b)
    j = a if abs(excess(a)) <= abs(excess(b)) else b
    return j, right_of(j)


def _upto(cum: np.ndarray, limit: float) -> int:
    """Largest j with cum[j] <= limit (items lo..j-1 fit)."""
    return int(np.searchsorted(cum, limit * (1 + 1e-12), "right")) - 1


def _from(cum: np.ndarray, limit: float) -> int:
    """Smallest j with cum[j] >= limit (items j..hi-1 fit)."""
    return int(np.searchsorted(cum, limit * (1 - 1e-12), "left"))
