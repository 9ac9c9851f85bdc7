"""Prefix-sharing groups: BatchLLM's first-level prefix enlargement (Alg. 1, MaximizeReuse).

The engine shares one level of prefix per group (BatchLLM Sec. 3.2): a group's prefix KV is
computed once and every member computes only its distinct part. The plain first level of the
tree (the root's children) often misses the best sharing; Alg. 1 "forks" a node and "merges"
it with a grandchild when (leaves(gchild) - 1) * tokens(gchild) > tokens(child).

We solve the same single-level problem exactly rather than greedily. A grouping is a set S of
tree nodes; each prompt joins its deepest ancestor in S (or stays alone), and a group at node v
with m members saves (m - 1) * depth(v) tokens. Define h(v, e) = the best saving inside v's
subtree when prompts left ungrouped in it would join a group at depth e above v. Then

    h(leaf, e) = e
    h(v, e)    = max( sum_c h(c, e),              # no group at v: pass prompts up
                      sum_c h(c, depth(v)) - depth(v) )   # group at v, paid once

and the answer is h at the root with e = 0. h(v, .) is only ever needed at the depths of v's
ancestors, so the DP keeps one short vector per node (O(sum of node depths), in practice O(n)).
Every fork-and-merge of Alg. 1 is a group formed at a deeper node, so the result is at least as
good as Alg. 1 and equals the brute-force optimum of the single-level problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixflow.pipeline.prefix_tree import PrefixTree, int64_view


@dataclass(frozen=True, slots=True, eq=False)
class Grouping:
    """Single-level grouping of the prompts.

    group_node: [num_seqs] tree node each prompt is grouped at (0, the root, means ungrouped).
    prefix_len: [num_seqs] the shared prefix length of its group (0 when ungrouped).
    saved_tokens: prompt tokens saved by computing each group's prefix once.
    """

    group_node: np.ndarray
    prefix_len: np.ndarray
    saved_tokens: int


def maximize_reuse(tree: PrefixTree, min_prefix_len: int = 1) -> Grouping:
    """The optimal single-level grouping of the tree's prompts (BatchLLM Alg. 1, made exact).

    min_prefix_len: groups form only at nodes at least this deep. A prefix shorter than a KV
    block saves little and makes its members wait a step for it (the engine passes its block
    size)."""
    if min_prefix_len < 1:
        raise ValueError(f"min_prefix_len={min_prefix_len} is invalid: use 1 or more tokens")
    if len(tree.order) == 0:  # no prompts (every row of a job was bad): nothing to group
        return Grouping(np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
    threshold = _solve(tree, min_prefix_len)
    return _assign(tree, threshold)


def first_level_saved_tokens(tree: PrefixTree) -> int:
    """Saving of the plain first level (the root's children as groups), before enlargement."""
    kids = np.flatnonzero((tree.parent == 0) & (tree.leaf_seq < 0))
    return int(((tree.num_leaves[kids] - 1) * tree.depth[kids]).sum())


def _solve(tree: PrefixTree, min_prefix_len: int) -> np.ndarray:
    """Bottom-up DP. Returns threshold[v]: a group forms at v iff the index (in v's ancestor
    list, root = 0) of the group the prompts would otherwise join is below threshold[v]."""
    ptr_arr, kids_arr = tree.children()
    # memoryviews, not lists: Python ints cost 36 bytes each at millions of nodes (from_sorted)
    ptr, kids, depth, parent = (
        int64_view(ptr_arr),
        int64_view(kids_arr),
        int64_view(tree.depth),
        int64_view(tree.parent),
    )
    threshold = np.zeros(tree.num_nodes, dtype=np.int64)
    thr_view = int64_view(threshold)
    acc: list[list[int] | None] = [None] * tree.num_nodes  # sum of children's h vectors
    path: list[int] = []  # depths of the current ancestors
    stack = [(0, False)]
    while stack:
        v, leaving = stack.pop()
        if not leaving and ptr[v] == ptr[v + 1] and v != 0:  # a leaf: h(leaf, e) = e
            _add(acc, parent[v], path)
            continue
        if not leaving:
            stack.append((v, True))
            path.append(depth[v])
            stack.extend((c, False) for c in reversed(kids[ptr[v] : ptr[v + 1]]))
            continue
        path.pop()
        a = acc[v]
        assert a is not None, "an internal node is left after its children added their h vectors"
        acc[v] = None
        form = a[-1] - depth[v]  # group at v: members earn depth(v), pay once
        passed = a[:-1]  # non-decreasing in the ancestor depth
        t = sum(1 for x in passed if x < form) if depth[v] >= min_prefix_len else 0
        if v == 0:
            thr_view[v] = 1  # the root "groups" whatever reaches it
            break
        thr_view[v] = t  # passed[:t] < form <= passed[t:]
        _add(acc, parent[v], [form] * t + passed[t:])
    return threshold


def _add(acc: list[list[int] | None], node: int, vec: list[int]) -> None:
    cur = acc[node]
    acc[node] = list(vec) if cur is None else [x + y for x, y in zip(cur, vec)]


def _assign(tree: PrefixTree, threshold: np.ndarray) -> Grouping:
    """Top-down: each prompt joins the deepest ancestor where a group forms."""
    ptr_arr, kids_arr = tree.children()
    ptr, kids, thr, leaf_seq = (
        int64_view(ptr_arr),
        int64_view(kids_arr),
        int64_view(threshold),
        int64_view(tree.leaf_seq),
    )
    num_seqs = len(tree.order)
    group_node = np.zeros(num_seqs, dtype=np.int64)
    group_view = int64_view(group_node)
    path_nodes: list[int] = []
    # (node, index in path_nodes of the group its ungrouped prompts join, leaving?)
    stack: list[tuple[int, int, bool]] = [(0, 0, False)]
    while stack:
        v, e_idx, leaving = stack.pop()
        if leaving:
            path_nodes.pop()
            continue
        if leaf_seq[v] >= 0:
            group_view[leaf_seq[v]] = path_nodes[e_idx]
            continue
        child_e = len(path_nodes) if e_idx < thr[v] or v == 0 else e_idx
        path_nodes.append(v)
        stack.append((v, e_idx, True))
        stack.extend((c, child_e, False) for c in reversed(kids[ptr[v] : ptr[v + 1]]))
    prefix_len = tree.depth[group_node]
    counts = np.bincount(group_node, minlength=tree.num_nodes)
    formed = np.flatnonzero(counts > 0)
    saved = int(((counts[formed] - 1) * tree.depth[formed]).sum())
    return Grouping(group_node, prefix_len, saved)


def group_keys(grouping: Grouping) -> np.ndarray:
    """One key per prompt naming its group; ungrouped prompts get a key of their own."""
    n = len(grouping.group_node)
    alone = grouping.group_node == 0
    return np.where(alone, -1 - np.arange(n, dtype=np.int64), grouping.group_node)


def runs(order: np.ndarray, grouping: Grouping) -> np.ndarray:
    """Start positions (in `order`) of maximal runs of prompts from one group, plus len(order)."""
    key = group_keys(grouping)[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(order) else np.zeros(0, np.int64)
    run_starts: np.ndarray = np.r_[starts, len(order)].astype(np.int64)
    return run_starts
