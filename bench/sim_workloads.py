"""The simulated jobs: prompts as paths in a segment trie (three mixes, or real token ids), and
their output lengths: each row's cap (max_tokens, what the planner is told) and the length the
model decides (what the row costs).

Mixes (rows shuffled):
  docs_questions  documents x questions: Zipf(2) questions per document (most 1-5, a few
                  hundreds), documents log-uniform 300-3000 tokens under one of 4 system
                  prompts of 200-800 tokens, questions 10-100 tokens;
  conversations   multi-turn chats, every turn a row: turn k's prompt is turn k-1's prompt plus
                  its recorded answer (50-400) and the next user message (20-200); Geometric
                  turns (mean 4, at most 24) under one of 4 system prompts;
  no_sharing      100-4000 tokens (log-uniform), distinct from the first token.

Output lengths (OUTPUT_MODELS):
  fixed           every row makes exactly its cap, uniform 8..128 tokens (ignore_eos: today's
                  benchmarks);
  model_decided   the model stops at EOS: length = cap x exp(N(log 0.25, 1.0)), rounded, at least
                  1 and at most the cap (about 8% of rows reach it; median a quarter of the cap,
                  10th percentile 7%). Half of the log-variance is shared by the rows of one
                  family (a document's questions, a conversation's turns: answers about one
                  text are alike in length), half is the row's own. Seeded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from prefixflow.pipeline.prefix_tree import PrefixTree
from prefixflow.pipeline.ragged import RaggedTokens

OUTPUT_MODELS = ("fixed", "model_decided")
CAP_RANGE = (8, 128)  # max_tokens per row, uniform
DECIDED_MEDIAN_SHARE = 0.25  # model_decided: median length over the cap
DECIDED_SIGMA = 1.0  # model_decided: log-normal spread
DECIDED_FAMILY_SHARE = 0.5  # model_decided: share of the log-variance a family shares


@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """Prompts as paths in a segment trie.

    parent: [num_nodes] int64, -1 for the root (node 0). depth: [num_nodes] tokens from the
    root to the end of each node. end_node: [n] the node where prompt i ends (its tokens are the
    path's segments). output_len: [n] each row's cap (max_tokens). sorted_order: [n] prompt
    indices in the order a sort on the prompt text gives.
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
    first = np.searchsorted(owner, owner, side="left")  # owner-sorted: first child of each owner
    return owner_node[owner] + 1 + before - before[first]


def docs_questions(
    n: int,
    seed: int = 0,
    num_system: int = 4,
    sys_len: tuple[int, int] = (200, 800),
    doc_len: tuple[int, int] = (300, 3000),
    q_len: tuple[int, int] = (10, 100),
    max_questions: int = 1000,
) -> Workload:
    """Documents x questions: Zipf(2) questions per document (most 1-5, a few hundreds, at most
    max_questions), documents log-uniform in doc_len tokens under one of `num_system` system
    prompts (uniform in sys_len), questions uniform in q_len."""
    rng = np.random.default_rng(seed)
    q = _zipf_counts(rng, n, 2.0, max_questions)
    nd = len(q)
    sys_of = np.sort(rng.integers(0, num_system, nd))  # docs in random order per system
    sys_size = 1 + np.bincount(sys_of, weights=1 + q, minlength=num_system).astype(np.int64)
    sys_node = 1 + np.cumsum(sys_size) - sys_size
    doc_node = _preorder_ids(sys_of, 1 + q, sys_node)
    doc_of_q = np.repeat(np.arange(nd), q)
    q_node = doc_node[doc_of_q] + 1 + np.arange(n) - np.repeat(np.cumsum(q) - q, q)
    docs = np.exp(rng.uniform(np.log(doc_len[0]), np.log(doc_len[1]), nd)).astype(np.int64)
    systems = rng.integers(sys_len[0], sys_len[1] + 1, num_system)
    parent, depth = _trie(
        [
            (sys_node, np.zeros(num_system, np.int64), systems),
            (doc_node, sys_node[sys_of], docs),
            (q_node, doc_node[doc_of_q], rng.integers(q_len[0], q_len[1] + 1, n)),
        ],
        1 + int(sys_size.sum()),
    )
    return _shuffled("docs_questions", parent, depth, q_node, rng)


def conversations(
    n: int,
    seed: int = 0,
    num_system: int = 4,
    sys_len: tuple[int, int] = (200, 800),
    user_len: tuple[int, int] = (20, 200),
    answer_len: tuple[int, int] = (50, 400),
    max_turns: int = 24,
) -> Workload:
    """Multi-turn chats: turn k's prompt is turn k-1's prompt, its recorded answer (answer_len
    tokens) and the next user message (user_len); Geometric(0.25) turns (mean 4, at most
    max_turns), every turn a row; one of `num_system` system prompts (sys_len) first."""
    rng = np.random.default_rng(seed)
    turns = np.minimum(rng.geometric(0.25, size=n), max_turns)
    turns = turns[: int(np.searchsorted(np.cumsum(turns), n)) + 1]
    turns[-1] -= int(turns.sum()) - n
    nc = len(turns)
    sys_of = np.sort(rng.integers(0, num_system, nc))
    sys_size = 1 + np.bincount(sys_of, weights=turns, minlength=num_system).astype(np.int64)
    sys_node = 1 + np.cumsum(sys_size) - sys_size
    first = _preorder_ids(sys_of, turns, sys_node)  # a chat is a chain of turn nodes
    k = np.arange(n) - np.repeat(np.cumsum(turns) - turns, turns)
    node = np.repeat(first, turns) + k
    par = np.where(k == 0, np.repeat(sys_node[sys_of], turns), node - 1)
    edge = rng.integers(user_len[0], user_len[1] + 1, n) + np.where(
        k == 0, 0, rng.integers(answer_len[0], answer_len[1] + 1, n)
    )
    by_k = np.argsort(k, kind="stable")  # turn by turn: parents first
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


def _shuffled(
    name: str, parent: np.ndarray, depth: np.ndarray, prompt_nodes: np.ndarray, rng: np.random.Generator
) -> Workload:
    """Rows in random order. Node ids are in preorder with siblings in random order, so the
    text sort is the order of the end nodes (a prompt before its extensions)."""
    end = prompt_nodes[rng.permutation(len(prompt_nodes))]
    outs = rng.integers(CAP_RANGE[0], CAP_RANGE[1] + 1, len(end))
    return Workload(name, parent, depth, end, outs, np.argsort(end, kind="stable"))


def workload_from_tokens(
    prompts: Sequence[Sequence[int]] | RaggedTokens, output_lens: Sequence[int] | np.ndarray | int = 8
) -> Workload:
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


def levels(parent: np.ndarray) -> np.ndarray:
    """Edges from the root to each node."""
    lev = np.zeros(len(parent), np.int64)
    idx = np.flatnonzero(parent >= 0)
    up = parent[idx]
    while len(idx):
        lev[idx] += 1
        keep = up > 0
        idx, up = idx[keep], parent[up[keep]]
    return lev


def families(w: Workload) -> np.ndarray:
    """Each prompt's family: its ancestor-or-self two edges below the root (a document, a
    conversation's first turn; under a system prompt), or its own end node when shallower."""
    lev = levels(w.parent)
    fam = w.end_node.copy()
    idx = np.flatnonzero(lev[fam] > 2)
    while len(idx):
        fam[idx] = w.parent[fam[idx]]
        idx = idx[lev[fam[idx]] > 2]
    return fam


def model_decided_lengths(
    w: Workload,
    seed: int = 0,
    median_share: float = DECIDED_MEDIAN_SHARE,
    sigma: float = DECIDED_SIGMA,
    family_share: float = DECIDED_FAMILY_SHARE,
) -> np.ndarray:
    """[n] output lengths the model decides (module doc): cap x a log-normal share, part of its
    log shared by the rows of a family, rounded, clipped to [1, cap]."""
    if not (0 < median_share <= 1 and sigma >= 0 and 0 <= family_share <= 1):
        raise ValueError(
            f"model_decided_lengths: median_share={median_share} must be in (0, 1], "
            f"sigma={sigma} >= 0 and family_share={family_share} in [0, 1]"
        )
    rng = np.random.default_rng([seed, 38])
    fam = families(w)
    _, fam_index = np.unique(fam, return_inverse=True)
    z_family = rng.standard_normal(int(fam_index.max(initial=-1)) + 1)[fam_index]
    z_row = rng.standard_normal(len(w))
    z = np.sqrt(family_share) * z_family + np.sqrt(1 - family_share) * z_row
    decided = np.rint(w.output_len * median_share * np.exp(sigma * z)).astype(np.int64)
    return np.clip(decided, 1, w.output_len)


def output_lengths(w: Workload, model: str, seed: int = 0) -> np.ndarray:
    """[n] the tokens each row really makes under an output model (OUTPUT_MODELS)."""
    if model == "fixed":
        return w.output_len.copy()
    if model == "model_decided":
        return model_decided_lengths(w, seed)
    raise ValueError(f"output model={model!r} is not known: use one of {', '.join(OUTPUT_MODELS)}")
