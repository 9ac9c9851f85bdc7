"""Cluster-scale simulation: what each way of feeding a data-parallel cluster costs in prompt
compute, GPU time and wall time (issue 28 item 3; made fair in issue 38 item 3).

    python -m prefixflow.bench.cluster_sim [--prompts 10000000] [--replicas 64] [--quick]
        [--blocks N] [--batch-size 32] [--max-tasks-in-flight 16] [--no-validate]

writes bench/results/cluster_sim.json (and .png; --quick: cluster_sim_quick.*). Three mixes
(sim_workloads.py) x two output-length models (each row's cap; lengths the model decides, which the
planner does not know) x four policies (sim_run.py): ray.data.llm on rows in arrival order, on
sorted rows, prefixflow's static plan, and the plan with work stealing. Per cell: prompt tokens
computed, GPU hours busy, makespan with and without start-up (sim_startup.py), the slowest replica
over the mean.

Modules, in data-flow order: sim_workloads.py (prompts as a segment trie; caps and decided lengths)
-> sim_items.py (the streams: rows, or the plan's units with their prefix owners) -> sim_cache.py (one
replica's prefix cache and admission) -> sim_dispatch.py (Ray's pull of tasks, plan units,
stealing; simulated time) -> sim_run.py (cluster, policies, one run) -> sim_predict.py (the same on
real token ids) -> sim_engines.py (the cache model against engine counters) and sim_dispatch_check.py
(the dispatch model against scale_bench's measured ray.data.llm runs: validate_dispatch) ->
sim_startup.py -> sim_report.py (the benchmark and its CLI).

Ray 2.60's dispatch as modelled (read from ray/data/_internal/execution/operators/
actor_pool_map_operator.py, execution/bundle_queue/bundler.py, data/dataset.py's map_batches,
ray/llm/_internal/batch/processor/base.py and vllm_engine_proc.py):
- the dataset is a sequence of whole blocks: read tasks split the files with np.array_split,
  `ds.sort` keeps the block count, `override_num_blocks` / `repartition` set it. Default here:
  a careful user's 4 x replicas x max_tasks_in_flight_per_actor blocks of equal size.
- map_batches(batch_size) bundles consecutive whole blocks into one task until it holds at least
  batch_size rows (EstimateSize: a block is never split, so a large block is a task of its own);
  what is left is one last task. ray.data.llm's batch_size: 32.
- each engine actor holds at most max_tasks_in_flight_per_actor tasks (the ProcessorConfig's,
  else the DataContext's, else 2 x max_concurrent_batches = 16); a task goes to the actor with
  the fewest tasks in flight (Ray's heap, copied with its tie-break: among equals the actor
  re-ranked last; sim_dispatch.rank_actor), and when every actor is full the next task waits
  for the first task to finish and goes to that actor (the pull).
- within an actor the rows of its tasks in flight run as one continuous batch in the order the
  tasks came (FIFO admission, sim_cache.py), with the same engine settings as prefixflow's
  (max_num_seqs 256, one H100's KV cache, prefix caching).
Left out of it: locality (Ray prefers an actor on the node holding the block; with reads spread
over the nodes that is about uniform, and scale_bench's all-on-the-head artifact is not
modelled); the read's own pace and back-pressure (every block exists once start-up ends); the
interleaving of an actor's concurrently running batches (max_concurrent_batches = 8 of them at
once; here FIFO by task); autoscaling pools (a fixed pool of R actors that start together);
failures and retries; per-batch Python overhead.

Plan and stealing (sim_dispatch.py): each replica runs its plan units (Plan.unit_starts, owner from
the plan table's replica column, Plan.unit_seconds) in plan order; with stealing a replica
that has no unit of its own left takes the last unstarted unit of the replica with the most
predicted seconds of unstarted units, whole, and computes its prefix itself (a hit only if its
own cache holds it). Predictions come from the caps; costs from the lengths decoded.

Time (BlendServe Sec. 4, cost_model.py with Llama-3.1-8B on the h100 profile): a request costs
T_comp (prefill of its computed tokens, attention over the cached ones, its decode) and T_mem
(decode reading the KV); a replica's clock is max(sum T_comp, sum T_mem) of what it admitted;
GPU hours busy are the sum over replicas, the makespan the slowest replica (plus start-up).
Not modelled: preemption, chunked-prefill interleaving, the duplicate block copies vLLM may keep
when a request recomputes blocks still in the queue, the network during generation.
"""

from prefixflow.bench.sim_dispatch_check import validate_dispatch
from prefixflow.bench.sim_engines import (
    VALIDATION,
    VllmMeasurement,
    measure_native_plan,
    measure_vllm,
    predict_validation,
    trie_tokens,
    validate,
    validation_workloads,
)
from prefixflow.bench.sim_items import (
    BLOCK_SIZE,
    MEMBER,
    OWNER,
    PLAIN,
    SlicedPlan,
    make_plan,
    plain_items,
    plan_stream,
    plan_workload,
    trie_order_lcp,
)
from prefixflow.bench.sim_predict import Prediction, predict_computed_tokens
from prefixflow.bench.sim_report import main, run_all, run_mix
from prefixflow.bench.sim_run import (
    ALL_POLICIES,
    MAX_NUM_SEQS,
    POLICIES,
    Cluster,
    RayData,
    Run,
    Tasks,
    Units,
    bundle_blocks,
    cost_coefficients,
    h100_cluster,
    policy_stream,
    ray_tasks,
    simulate,
    split_rows,
)
from prefixflow.bench.sim_startup import (
    TEXT_BYTES_PER_TOKEN,
    StartupRates,
    plan_stage_bytes,
    sort_bytes,
    startup_seconds,
)
from prefixflow.bench.sim_workloads import (
    MIXES,
    OUTPUT_MODELS,
    Workload,
    conversations,
    docs_questions,
    model_decided_lengths,
    no_sharing,
    output_lengths,
    workload_from_tokens,
)

__all__ = [
    "ALL_POLICIES",
    "BLOCK_SIZE",
    "MAX_NUM_SEQS",
    "MEMBER",
    "MIXES",
    "OUTPUT_MODELS",
    "OWNER",
    "PLAIN",
    "POLICIES",
    "TEXT_BYTES_PER_TOKEN",
    "VALIDATION",
    "Cluster",
    "Prediction",
    "RayData",
    "Run",
    "SlicedPlan",
    "StartupRates",
    "Tasks",
    "Units",
    "VllmMeasurement",
    "Workload",
    "bundle_blocks",
    "conversations",
    "cost_coefficients",
    "docs_questions",
    "h100_cluster",
    "main",
    "make_plan",
    "measure_native_plan",
    "measure_vllm",
    "model_decided_lengths",
    "no_sharing",
    "output_lengths",
    "plain_items",
    "plan_stage_bytes",
    "plan_stream",
    "plan_workload",
    "policy_stream",
    "predict_computed_tokens",
    "predict_validation",
    "ray_tasks",
    "run_all",
    "run_mix",
    "simulate",
    "sort_bytes",
    "split_rows",
    "startup_seconds",
    "trie_order_lcp",
    "trie_tokens",
    "validate",
    "validate_dispatch",
    "validation_workloads",
    "workload_from_tokens",
]


if __name__ == "__main__":
    main()
