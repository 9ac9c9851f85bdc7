"""The global planner: pure Python + numpy (no torch, no ray).

from prefixflow.pipeline import build_plan
plan = build_plan(token_id_lists, order="batchllm", num_replicas=2)
plan.summary["token_saving_ratio"], plan.groups(replica=0)
"""

from prefixflow.pipeline.block_hash import HashedPrompts, block_hashes
from prefixflow.pipeline.cost_model import CostModel, HardwareProfile, ModelShape
from prefixflow.pipeline.ordering import ORDER_POLICIES
from prefixflow.pipeline.plan import Plan, build_plan
from prefixflow.pipeline.prefix_tree import PrefixTree, sort_with_lcp
from prefixflow.pipeline.ragged import RaggedTokens
from prefixflow.requests import PrefixGroup

__all__ = [
    "ORDER_POLICIES",
    "CostModel",
    "HardwareProfile",
    "HashedPrompts",
    "ModelShape",
    "Plan",
    "PrefixGroup",
    "PrefixTree",
    "RaggedTokens",
    "block_hashes",
    "build_plan",
    "sort_with_lcp",
]
