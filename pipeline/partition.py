"""Data-parallel partitioning: which replica runs which runs of the plan.

This first version balances the prompt tokens each replica computes, keeping every run (and so
every shared prefix) on one replica: longest-processing-time-first onto the least-loaded
replica, and each replica keeps the plan order of its runs.
"""

from __future__ import annotations

import heapq

import numpy as np


def partition_runs(run_cost: np.ndarray, num_replicas: int) -> np.ndarray:
    """Replica of each run, balancing the sum of `run_cost` per replica (LPT greedy).

    run_cost: [num_runs] predicted cost of each run (e.g. prompt tokens computed).
    Returns [num_runs] int32 replica ids.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas} is invalid: use at least 1")
    replica = np.zeros(len(run_cost), dtype=np.int32)
    if num_replicas == 1 or len(run_cost) == 0:
        return replica
    heap = [(0.0, r) for r in range(num_replicas)]
    for i in np.argsort(-np.asarray(run_cost, dtype=np.float64), kind="stable"):
        load, r = heapq.heappop(heap)
        replica[i] = r
        heapq.heappush(heap, (load + float(run_cost[i]), r))
    return replica
