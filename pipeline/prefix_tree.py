"""A compact prefix tree (radix tree) over all prompts of a job, built without per-token Python.

Construction has two steps:

1. `sort_with_lcp`: a vectorised most-significant-digit radix sort whose digits are blocks of
   `block` tokens. All prompts start in one bucket; at each level the block of every prompt that
   is still in a bucket of two or more is gathered with numpy and compared with its bucket's first
   member. Only buckets whose members differ are sorted (lexsort on the block's tokens) and split,
   and the split position gives the exact longest common prefix (LCP) of the two neighbours. The
   work is proportional to the tokens that prompts share, not to tokens times prompts, and the
   comparisons are exact (no hashes, so no collisions).
2. `PrefixTree.from_sorted`: the LCP-interval tree of the sorted prompts (one pass with a stack, as
   suffix trees are built from suffix and LCP arrays). Internal nodes are the distinct LCP
   intervals; every prompt is a leaf, possibly with an edge of zero tokens when it ends exactly
   at an internal node (a prompt that is a prefix of others, or a duplicate).

Nodes hold integers only (depths, parents, ranges of sorted positions), never tokens: a node's
tokens are `tokens[order[lo]][depth[parent]:depth[node]]`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Callable

import numpy as np

from prefixflow.pipeline.ragged import RaggedTokens

DEFAULT_BLOCK = 32


def sort_with_lcp(tokens: RaggedTokens, block: int = DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Lexicographic order of the sequences, and the LCP of each adjacent pair in that order.

    Returns (order [n] int64: sequence indices, lcp [n-1] int64: lcp[k] is the LCP length of
    order[k] and order[k+1]). A shorter sequence sorts before its extensions; equal sequences
    keep their input order.
    """
    return sort_by_gather(tokens.lengths, ragged_gather(tokens), block)


# A gather callback: (sequence indices [A], depth, width) -> symbols depth .. depth+width-1 of
# each sequence as int64 [A, width], -1 past its end (symbols themselves are non-negative).
Gather = Callable[[np.ndarray, int, int], np.ndarray]


def ragged_gather(seqs: RaggedTokens) -> Gather:
    """A `Gather` over sequences held in memory (token ids, or block hashes)."""
    flat, starts_at, lens = seqs.flat, seqs.offsets[:-1], seqs.lengths

    def gather(idx: np.ndarray, depth: int, width: int) -> np.ndarray:
        return _gather_block(flat, starts_at[idx], lens[idx], depth, np.arange(width, dtype=np.int64))

    return gather


def sort_by_gather(
    lens: np.ndarray, gather: Gather, block: int = DEFAULT_BLOCK, max_cells: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`sort_with_lcp` over sequences that need not be in memory: `gather` fetches `width`
    symbols of the still-undecided sequences per level (from a flat buffer, or from the blocks
    of a dataset). max_cells bounds the symbols held per level (width shrinks while many
    sequences are undecided, never below 1), which bounds the sort's memory."""
    n = len(lens)
    order = np.arange(n, dtype=np.int64)
    lcp = np.zeros(max(n - 1, 0), dtype=np.int64)
    act = np.arange(n, dtype=np.int64) if n > 1 else np.zeros(0, dtype=np.int64)
    bucket_start = np.zeros(len(act), dtype=bool)
    bucket_start[:1] = True
    depth = 0
    while len(act):
        width = block if max_cells is None else max(1, min(block, max_cells // len(act)))
        seqs = order[act]
        vals = gather(seqs, depth, width)  # [A, width]
        bucket = np.cumsum(bucket_start) - 1
        first_row = np.flatnonzero(bucket_start)[bucket]
        differs = (vals != vals[first_row]).any(axis=1)
        bucket_differs = np.bincount(bucket, weights=differs, minlength=bucket[-1] + 1) > 0
        rows = np.flatnonzero(bucket_differs[bucket])
        del first_row, differs
        new_start = bucket_start.copy()
        if len(rows):
            # Sort the members of differing buckets by the block's symbols (bucket is the primary
            # key, so every bucket stays within its own range of positions), then split.
            keys = [vals[rows, c] for c in range(width - 1, -1, -1)] + [bucket[rows]]
            perm = rows[np.lexsort(keys)]
            del keys
            order[act[rows]] = seqs[perm]
            sub = vals[perm]
            same_bucket = bucket[rows[1:]] == bucket[rows[:-1]]
            neq = sub[1:] != sub[:-1]
            del sub
            split = same_bucket & neq.any(axis=1)
            k = np.flatnonzero(split)
            lcp[act[rows[k]]] = depth + neq[k].argmax(axis=1)
            new_start[rows[k + 1]] = True
            seqs = order[act]
            del neq
        del vals
        # Members of one bucket now have equal blocks. Those that end inside this block (padding
        # present) are duplicates: their LCP is their length, and they are done.
        ended = lens[seqs] < depth + width
        dup = ~new_start[1:] & ended[1:]
        lcp[act[:-1][dup]] = lens[seqs[1:][dup]]
        new_bucket = np.cumsum(new_start) - 1
        size = np.bincount(new_bucket)
        keep = (size[new_bucket] >= 2) & ~ended
        act, bucket_start = act[keep], new_start[keep]
        depth += width
    return order, lcp


def _gather_block(
    flat: np.ndarray, starts_at: np.ndarray, lens: np.ndarray, depth: int, cols: np.ndarray
) -> np.ndarray:
    """Tokens depth .. depth+block-1 of each sequence, -1 past its end. -> [A, block]"""
    pos = depth + cols  # [block]
    valid = pos[None, :] < lens[:, None]  # [A, block]
    idx = np.where(valid, starts_at[:, None] + pos[None, :], 0)
    vals = flat[idx] if len(flat) else np.zeros(idx.shape, dtype=np.int64)
    vals = vals.astype(np.int64, copy=False) if vals.dtype.kind == "u" else vals
    vals[~valid] = -1
    return vals


@dataclass(frozen=True, slots=True, eq=False)
class PrefixTree:
    """Compact prefix tree. Node 0 is the root (depth 0). Arrays are indexed by node id.

    depth: tokens from the root to the end of the node (a prompt's leaf has depth = its length).
    parent: parent node id (-1 for the root).
    lo, hi: the node covers sorted positions lo .. hi-1, i.e. sequences order[lo:hi].
    leaf_seq: the sequence a leaf stands for, -1 for internal nodes.
    post_order: node ids, children before parents (root last).
    order: sequence indices in sorted order (lexicographic, or by block hash); lcp: LCP of
    adjacent sorted sequences.
    first_seq: the smallest sequence index under each node.
    """

    depth: np.ndarray
    parent: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    leaf_seq: np.ndarray
    post_order: np.ndarray
    order: np.ndarray
    lcp: np.ndarray
    first_seq: np.ndarray

    @classmethod
    def build(cls, tokens: RaggedTokens, block: int = DEFAULT_BLOCK) -> "PrefixTree":
        order, lcp = sort_with_lcp(tokens, block)
        return cls.from_sorted(order, lcp, tokens.lengths)

    @classmethod
    def from_sorted(cls, order: np.ndarray, lcp: np.ndarray, lens: np.ndarray) -> "PrefixTree":
        """LCP-interval tree of sorted sequences (one stack pass, O(n)).

        The pass appends to typed arrays (8 bytes a value) and reads numpy memory through
        memoryviews, never Python lists of ints (36 bytes a value): at ten million prompts that
        is the difference between 1 and 5 GB of driver memory."""
        n = len(order)
        depth, parent, lo, hi, leaf_seq = (_int64s([v]) for v in (0, -1, 0, n, -1))
        first = _int64s([n])  # smallest sequence index in each subtree (sibling order)
        post = _int64s([])
        is_leaf = bytearray(b"\0")
        sorted_lens = int64_view(lens[order])
        lcp_view = int64_view(lcp)
        order_view = int64_view(order)
        stack = [0]
        for k in range(n + 1):
            boundary = lcp_view[k - 1] if 0 < k < n else 0
            if k > 0:
                last = -1
                # Close every node deeper than the boundary (and the previous leaf, always).
                while depth[stack[-1]] > boundary or is_leaf[stack[-1]]:
                    last = stack.pop()
                    hi[last] = k
                    post.append(last)
                    # closed, so final; its parent (or a node inserted below it) is an ancestor
                    up = parent[last]
                    if first[last] < first[up]:
                        first[up] = first[last]
                top = stack[-1]
                if depth[top] < boundary:  # the closed node and the next one meet deeper
                    mid = len(depth)
                    depth.append(boundary)
                    parent.append(top)
                    lo.append(lo[last])
                    hi.append(-1)
                    leaf_seq.append(-1)
                    is_leaf.append(0)
                    first.append(first[last])
                    parent[last] = mid
                    stack.append(mid)
            if k == n:
                break
            leaf = len(depth)
            depth.append(sorted_lens[k])
            parent.append(stack[-1])
            lo.append(k)
            hi.append(k + 1)
            leaf_seq.append(order_view[k])
            is_leaf.append(1)
            first.append(order_view[k])
            stack.append(leaf)
        post.append(0)
        return cls._from_typed_arrays(depth, parent, lo, hi, leaf_seq, post, order, lcp, first)

    @classmethod
    def _from_typed_arrays(
        cls,
        depth: array,
        parent: array,
        lo: array,
        hi: array,
        leaf_seq: array,
        post: array,
        order: np.ndarray,
        lcp: np.ndarray,
        first: array,
    ) -> "PrefixTree":
        """The tree from from_sorted's typed arrays, as numpy arrays over their memory (no copy)."""
        return cls(
            _int64_array(depth),
            _int64_array(parent),
            _int64_array(lo),
            _int64_array(hi),
            _int64_array(leaf_seq),
            _int64_array(post),
            order,
            lcp,
            _int64_array(first),
        )

    @property
    def num_nodes(self) -> int:
        return len(self.depth)

    @property
    def num_leaves(self) -> np.ndarray:
        """Prompts in each node's subtree."""
        leaves: np.ndarray = self.hi - self.lo
        return leaves

    def edge_tokens(self) -> np.ndarray:
        """Tokens on the edge into each node (0 for the root)."""
        up = np.where(self.parent >= 0, self.depth[np.maximum(self.parent, 0)], 0)
        edge: np.ndarray = self.depth - up
        return edge

    def tree_tokens(self) -> int:
        """Distinct prompt tokens: what the multi-level optimum computes (each edge once)."""
        return int(self.edge_tokens().sum())

    def children(self) -> tuple[np.ndarray, np.ndarray]:
        """CSR children lists: children of v are child_ids[child_ptr[v]:child_ptr[v+1]], in the
        input order of their first sequences. Not the sorted order: a plan from block hashes
        (block_hash.py) sorts by hash, and every policy's ties must fall the same way."""
        nodes = np.arange(1, self.num_nodes)
        by_parent = nodes[np.lexsort((self.first_seq[nodes], self.parent[nodes]))]
        counts = np.bincount(self.parent[nodes], minlength=self.num_nodes)
        ptr = np.zeros(self.num_nodes + 1, dtype=np.int64)
        np.cumsum(counts, out=ptr[1:])
        return ptr, by_parent


def _int64s(values: list[int]) -> array:
    return array("q", values)


def _int64_array(values: array) -> np.ndarray:
    """A typed array of int64 as a numpy array over the same memory (an empty one: a new array)."""
    return np.frombuffer(values, dtype=np.int64) if len(values) else np.zeros(0, np.int64)


def int64_view(values: np.ndarray) -> memoryview:
    """Python ints from numpy memory one at a time, without a list of them (see from_sorted)."""
    return np.ascontiguousarray(values, dtype=np.int64).data.cast("B").cast("q")  # .data: memoryview(array)
