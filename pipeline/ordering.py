"""Order policies: the sequence in which a replica runs its prompts.

- fcfs: input order (what engines do today; the baseline).
- dfs: depth-first over the prefix tree, heaviest subtree (most prompt tokens) first, like
  SGLang's cache-aware scheduling: neighbours share prefixes, groups may interleave.
- batchllm: whole prefix-sharing groups, ordered by R_group (BatchLLM Eq. 2 and 3): groups with
  more decoding per prefill token first, so later, longer prefills mix with earlier decodes.

Every policy returns a permutation of the prompts; `runs` then cuts it into maximal runs of one
group, which is what the engine schedules together.
"""

from __future__ import annotations

import numpy as np

from prefixflow.pipeline.blendserve import blendserve_order
from prefixflow.pipeline.cost_model import CostModel
from prefixflow.pipeline.grouping import Grouping, group_keys, runs
from prefixflow.pipeline.prefix_tree import PrefixTree

__all__ = ["ORDER_POLICIES", "batchllm_order", "dfs_order", "group_keys", "order_prompts", "runs"]

ORDER_POLICIES = ("fcfs", "dfs", "batchllm", "blendserve")


def order_prompts(
    policy: str,
    tree: PrefixTree,
    grouping: Grouping,
    lengths: np.ndarray,
    output_lens: np.ndarray | None = None,
    cost_model: CostModel | None = None,
) -> np.ndarray:
    """A permutation of prompt indices in run order under `policy`.

    cost_model: a `cost_model.CostModel` for resource-aware policies (blendserve)."""
    if policy == "fcfs":
        return np.arange(len(lengths), dtype=np.int64)
    if policy == "dfs":
        return dfs_order(tree, lengths)
    if policy == "batchllm":
        return batchllm_order(grouping, lengths, output_lens)
    if policy == "blendserve":
        return blendserve_order(tree, grouping, lengths, output_lens, cost_model=cost_model)
    raise ValueError(f"order={policy!r} is not a known policy: use one of {', '.join(ORDER_POLICIES)}")


def batchllm_order(grouping: Grouping, lengths: np.ndarray, output_lens: np.ndarray | None = None) -> np.ndarray:
    """Groups by R_group descending (BatchLLM Eq. 3), members by R = L_decode / L_prefill (Eq. 2).

    Without output-length estimates every request's L_decode is normalised to 1 (Sec. 3.3.2),
    so R_group = 1 / (L_prefix + sum L_distinct): short groups first. With estimates,
    R_group = sum L_decode / (L_prefix + sum L_distinct). Ties keep input order.
    """
    n = len(lengths)
    idx = np.arange(n, dtype=np.int64)
    key = group_keys(grouping)
    _, gid = np.unique(key, return_inverse=True)
    distinct = lengths - grouping.prefix_len
    prefix_of_group = np.zeros(gid.max() + 1 if n else 0, dtype=np.int64)
    prefix_of_group[gid] = grouping.prefix_len
    computed = np.bincount(gid, weights=distinct) + prefix_of_group  # L_prefix + sum L_distinct
    if output_lens is None:
        decode = np.ones(n)
        r_group = 1.0 / np.maximum(computed, 1)  # Eq. 3 as written
    else:
        decode = np.asarray(output_lens, dtype=np.float64)
        r_group = np.bincount(gid, weights=decode) / np.maximum(computed, 1)
    r_member = decode / np.maximum(lengths, 1)
    first_index = np.full(len(r_group), n, dtype=np.int64)
    np.minimum.at(first_index, gid, idx)
    # lexsort: last key is primary.
    order: np.ndarray = np.lexsort((idx, -r_member, first_index[gid], -r_group[gid])).astype(np.int64)
    return order


def dfs_order(tree: PrefixTree, lengths: np.ndarray) -> np.ndarray:
    """Leaves of the tree depth first, children with the most prompt tokens first."""
    ptr, kids = tree.children()
    cum = np.zeros(len(tree.order) + 1, dtype=np.int64)
    np.cumsum(lengths[tree.order], out=cum[1:])
    weight = (cum[tree.hi] - cum[tree.lo]).tolist()
    ptr, kids, leaf_seq = ptr.tolist(), kids.tolist(), tree.leaf_seq.tolist()
    out: list[int] = []
    stack = [0]
    while stack:
        v = stack.pop()
        if leaf_seq[v] >= 0:
            out.append(leaf_seq[v])
            continue
        children = kids[ptr[v] : ptr[v + 1]]
        # Stable: heaviest first, ties by their first prompt's input position (PrefixTree.children);
        # the stack pops the last pushed.
        children = sorted(children, key=lambda c: -weight[c])
        stack.extend(reversed(children))
    return np.asarray(out, dtype=np.int64)
