"""The simulator on real prompts (token ids): what R replicas compute under a policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from prefixflow.bench.sim_items import BLOCK_SIZE, plan_workload
from prefixflow.bench.sim_run import MAX_NUM_SEQS, Cluster, RayData, Tasks, Units, joins_pieces, policy_stream, simulate
from prefixflow.bench.sim_workloads import workload_from_tokens
from prefixflow.pipeline.cost_model import CostModel
from prefixflow.pipeline.ragged import RaggedTokens


@dataclass(frozen=True, slots=True, eq=False)
class Prediction:
    """Simulated prompt work of real prompts: totals, per replica, and per row (input order)."""

    prompt_tokens: int
    computed_prompt_tokens: int
    replica_computed: np.ndarray  # [num_replicas] prompt tokens computed (a plan's prefixes too)
    row_cached: np.ndarray  # [num_rows] prompt tokens each row did not compute
    row_replica: np.ndarray  # [num_rows] the replica that ran each row
    replica_busy_s: np.ndarray  # [num_replicas] predicted busy time (cost model)


def predict_computed_tokens(
    prompts: Sequence[Sequence[int]] | RaggedTokens,
    num_replicas: int,
    cache_tokens: int,
    policy: str,
    *,
    block_size: int = BLOCK_SIZE,
    max_num_seqs: int | None = MAX_NUM_SEQS,
    batch_size: int = 32,
    output_lens: Sequence[int] | np.ndarray | int = 8,
    row_replica: Sequence[int] | np.ndarray | None = None,
    cost_model: CostModel | None = None,
    ray: RayData | None = None,
    decoded_lens: Sequence[int] | np.ndarray | None = None,
) -> Prediction:
    """The prompt tokens R replicas compute for these prompts under a policy (sim_run.py).

    prompts: token-id lists, in arrival order. cache_tokens: each replica's prefix cache (for
    vLLM: (num_gpu_blocks - 1) * block_size; one block is its null block). policy: one of
    simulate.ALL_POLICIES. max_num_seqs: requests a replica runs at once (None: no cap).
    output_lens: per row or one for all: the caps the planner is told; decoded_lens: the
    tokens each row really makes (default the caps; they size a running request's KV and time
    the dispatch). ray: the arrival and sorted hand-out (default RayData(batch_size=batch_size)).
    row_replica: for arrival and sorted, the replica each row ran on in a measured run,
    instead of the simulated hand-out; each replica then runs its rows in the policy's order.
    """
    w = workload_from_tokens(prompts, output_lens)
    cluster = Cluster(num_replicas, cache_tokens, block_size, max_num_seqs or len(w))
    cm = cost_model or CostModel.create(None, "h100")
    plan = (
        plan_workload(w, num_replicas, block_size, prompts, stealing=joins_pieces(policy))
        if policy.startswith("plan")
        else None
    )
    outs = None if decoded_lens is None else np.asarray(decoded_lens, np.int64)
    how: Tasks | Units | None  # None: each item on its given replica (simulate)
    items, how = policy_stream(w, policy, num_replicas, plan, outs, ray or RayData(batch_size=batch_size), block_size)
    if row_replica is not None:
        given = np.asarray(row_replica, np.int64)
        bad = given.shape != (len(w),) or np.any((given < 0) | (given >= num_replicas))
        if policy not in ("arrival", "sorted") or bad:
            raise ValueError(
                f"row_replica must give each of the {len(w)} rows a replica in [0, {num_replicas}), "
                f"and only for the arrival and sorted policies (got policy={policy!r})"
            )
        items, how = items.with_replica(given[items.row]), None
    run = simulate(w, items, cluster, cm, how)
    rows = items.row >= 0
    cached = np.zeros(len(w), np.int64)
    replica = np.zeros(len(w), np.int64)
    row = items.row[rows]
    cached[row] = np.minimum(run.cached_start[rows], w.prompt_lens[row])
    replica[row] = run.item_replica[rows]
    computed = run.replica_computed(w, num_replicas)
    return Prediction(int(w.prompt_lens.sum()), int(computed.sum()), computed, cached, replica, run.busy_s)
