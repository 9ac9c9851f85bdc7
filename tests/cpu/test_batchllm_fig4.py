"""BatchLLM Fig. 4: six prompts whose plain first-level prefix wastes the sharing.

The figure's token values are not in the paper's text, so the prompts below are rebuilt from
everything the text states: the root's right child ('b', one token) is shared by prompts 2-6,
so the plain first level saves 4 tokens; prompts 4 and 5 share their first 8 tokens; the left
node of level 3 is forked and merged with its right child, and then the right node of level 2
is forked and merged with the merged node (Sec. 3.2).
"""

import numpy as np

from prefixflow.pipeline import RaggedTokens, build_plan
from prefixflow.pipeline.grouping import first_level_saved_tokens, maximize_reuse
from prefixflow.pipeline.prefix_tree import PrefixTree

VOCAB = {c: i for i, c in enumerate("abcdefghijklmnpqrstu")}
PROMPTS = ["apq", "bcrs", "bdeflt", "bdefhijkm", "bdefhijkn", "bdegu"]


def tokens(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def test_fig4_tree_shape():
    tree = PrefixTree.build(RaggedTokens.from_sequences([tokens(p) for p in PROMPTS]))
    internal = sorted(int(d) for d, leaf in zip(tree.depth, tree.leaf_seq) if leaf < 0)
    # root, 'b' (level 1), 'de' (level 2, depth 3), 'f' (level 3, depth 4), 'hijk' (depth 8)
    assert internal == [0, 1, 3, 4, 8]
    assert first_level_saved_tokens(tree) == 4  # "reusing the first level saves 4 tokens"


def test_fig4_enlarged_first_level():
    prompts = [tokens(p) for p in PROMPTS]
    tree = PrefixTree.build(RaggedTokens.from_sequences(prompts))
    grouping = maximize_reuse(tree)
    # Prompts 4 and 5 share 8 tokens (saves 8); 3 and 6 share 'bde' (saves 3); 1, 2 alone.
    assert grouping.saved_tokens == 11
    shared = {
        frozenset(np.flatnonzero(grouping.group_node == v).tolist()): int(tree.depth[v])
        for v in set(grouping.group_node.tolist()) - {0}
    }
    assert shared == {frozenset({3, 4}): 8, frozenset({2, 5}): 3}
    plan = build_plan(prompts)
    total = sum(map(len, prompts))
    assert plan.summary["first_level_token_saving_ratio"] == 4 / total
    assert plan.summary["single_level_token_saving_ratio"] == 11 / total
    # multi-level optimum: 36 prompt tokens, 20 distinct tree tokens
    assert plan.summary["optimal_token_saving_ratio"] == 16 / total


def test_fig4_nested_groups_reach_the_multilevel_optimum():
    # The plan nests groups ('b', 'bde', 'bdef', 'bdefhijk') and runs them depth first, so each
    # prompt finds the deepest prefix computed before it: 20 tokens, the tree's, not 36 - 11.
    plan = build_plan([tokens(p) for p in PROMPTS])
    assert plan.summary["computed_prompt_tokens"] == 20
    shared = {frozenset(g.row_ids.tolist()): g.prefix_len for g in plan.groups(0) if g.prefix_len}
    assert shared == {frozenset({3, 4}): 8}
    assert [int(r) for g in plan.groups(0) for r in g.row_ids] == [0, 1, 5, 2, 3, 4]
