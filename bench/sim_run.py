"""The cluster, each policy's stream and dispatch, and one simulated run.

Policies (POLICIES, and plan_vllm for callers that ask):
  arrival     ray.data.llm on rows in arrival order (RayData: whole blocks, bundled into tasks of
              about batch_size rows, pulled by the engine actors with a cap on tasks in flight);
  sorted      the same after `ds.sort` on the prompt text (a sort keeps the block count);
  plan        prefixflow's plan, static: each replica runs its own units in plan order (native
              engine: each group's prefix computed once);
  plan_steal  the plan with work stealing: a replica that runs dry takes the last unstarted unit
              of the replica with the most predicted work left, whole; the unit's prefix is
              computed on the thief (a hit only if the thief's cache holds it). The engines'
              queue (work_queue.py) picks, of the victim's unstarted units, the one whose
              shared prefix the thief computes again least, and each engine runs its loose
              units (sharing nothing past the system prompt with their neighbours) last, where
              thieves find them: the simulator runs the loose units last (plan_units), so its
              thieves take them first, but not the choice among the others (its plan_steal may
              overstate what stealing computes again);
  plan_vllm   the static plan on prefixflow's vLLM backend (members as whole prompts in plan
              order, sharing only through vLLM's prefix cache);
  plan_steal_unjoined  stealing over the static plan (build_plan stealing=False: a small piece of
              a group stays where the balance puts it), against plan_steal's plan, whose small
              pieces join their group's replica (what a job with work_stealing gets).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixflow.bench import sim_dispatch as dispatch
from prefixflow.bench.sim_items import BLOCK_SIZE, OWNER, PlanStream, _Items, plain_items, plan_stream, plan_workload
from prefixflow.bench.sim_workloads import Workload, levels
from prefixflow.operators.stages.work_queue import loose_units, shared_beyond_floor
from prefixflow.pipeline.cost_model import CostModel

MAX_NUM_SEQS = 256  # vLLM's default request cap (every system gets the same)
POLICIES = ("arrival", "sorted", "plan", "plan_steal")
ALL_POLICIES = (*POLICIES, "plan_vllm", "plan_steal_unjoined")


@dataclass(frozen=True, slots=True)
class Cluster:
    """R replicas, each with a prefix cache of `cache_tokens` tokens in blocks of block_size,
    at most max_num_seqs running requests."""

    num_replicas: int
    cache_tokens: int
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = MAX_NUM_SEQS

    def __post_init__(self) -> None:
        for name in ("num_replicas", "block_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"Cluster.{name}={getattr(self, name)} is invalid: use at least 1")
        if self.cache_tokens < self.block_size:
            raise ValueError(
                f"Cluster.cache_tokens={self.cache_tokens} is below one block "
                f"({self.block_size} tokens): give the KV cache's size in tokens"
            )

    @property
    def cache_blocks(self) -> int:
        return self.cache_tokens // self.block_size


@dataclass(frozen=True, slots=True)
class RayData:
    """How ray.data.llm hands rows to its engine actors (Ray 2.60): the dataset's rows in
    num_blocks whole blocks, taken here as equal (within a row: `repartition` cuts so, and read
    tasks get np.array_split shares of the files; None: a careful user's 4 x replicas x
    max_tasks_in_flight_per_actor), map_batches bundling consecutive blocks into a task until it
    holds batch_size rows, each actor holding at most max_tasks_in_flight_per_actor tasks
    (2 x max_concurrent_batches = 16 by default). Given blocks (measured) replace num_blocks."""

    num_blocks: int | None = None
    batch_size: int = 32
    max_tasks_in_flight_per_actor: int = 16

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_tasks_in_flight_per_actor"):
            if getattr(self, name) < 1:
                raise ValueError(f"RayData.{name}={getattr(self, name)} is invalid: use at least 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"RayData.num_blocks={self.num_blocks} is invalid: use at least 1, or None")

    def block_rows(self, num_rows: int, num_replicas: int) -> np.ndarray:
        blocks = self.num_blocks or 4 * num_replicas * self.max_tasks_in_flight_per_actor
        return split_rows(num_rows, blocks)


def split_rows(num_rows: int, num_blocks: int) -> np.ndarray:
    """Rows per block: num_rows in num_blocks blocks (at most num_rows), as np.array_split cuts."""
    b = max(1, min(num_blocks, num_rows))
    return np.full(b, num_rows // b, np.int64) + (np.arange(b) < num_rows % b)


def bundle_blocks(block_rows: np.ndarray, batch_size: int) -> np.ndarray:
    """Task boundaries in blocks: consecutive whole blocks until a task holds batch_size rows or
    more (Ray Data's EstimateSize rebundling; a block is never split), the rest one last task."""
    starts, rows = [0], 0
    for b, n in enumerate(np.asarray(block_rows, np.int64)):
        rows += int(n)
        if rows >= batch_size:
            starts.append(b + 1)
            rows = 0
    if starts[-1] != len(block_rows):
        starts.append(len(block_rows))
    return np.asarray(starts, np.int64)


@dataclass(frozen=True, slots=True, eq=False)
class Tasks:
    """Ray Data's dispatch of a stream: starts [num_tasks + 1] item boundaries of its tasks;
    ready_s: [num_replicas] when each engine actor takes its first task (None: every actor ready
    at 0); arrive_s: [num_tasks] when each task's blocks reach the engine stage (None: all at 0,
    the data ready before the engines); data_node: [num_tasks, K] the nodes holding each task's
    blocks, most bytes first (-1 after the last; [num_tasks]: one each, the node holding most)
    and actor_node: [num_replicas] each actor's node (node numbers, -1: not known; None: all
    -1): an actor up with room on the first of a task's data nodes that has one takes it (Ray
    Data's actor locality, on by default), else the least busy actor up anywhere; among actors
    as busy, the one whose tasks in flight changed last (Ray's actor heap: sim_dispatch.rank_actor);
    speed: [num_replicas] each actor's pace, its work's seconds per second (None: all 1), which
    moves when its tasks end (the Run's busy times stay the cost model's seconds)."""

    starts: np.ndarray
    max_in_flight: int
    ready_s: np.ndarray | None = None
    arrive_s: np.ndarray | None = None
    data_node: np.ndarray | None = None
    actor_node: np.ndarray | None = None
    speed: np.ndarray | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Units:
    """A plan's dispatch: units of the stream (starts [num_units + 1]), each owned by a replica
    and predicted to take `seconds`; steal: a replica that runs dry takes others' units; last
    (None: none): the units each replica runs after its others, in plan order (its loose
    units, where a thief takes from first: work_queue.loose_units)."""

    starts: np.ndarray
    owner: np.ndarray
    seconds: np.ndarray
    steal: bool = False
    last: np.ndarray | None = None


def h100_cluster(num_replicas: int, cost_model: CostModel | None = None) -> Cluster:
    """Replicas with the KV cache of one H100 serving Llama-3.1-8B (cost_model.py)."""
    cm = cost_model or CostModel.create(None, "h100")
    return Cluster(num_replicas, int(cm.kv_budget_bytes // cm.model.kv_bytes_per_token))


def cost_coefficients(cm: CostModel) -> np.ndarray:
    """cost_model.CostModel's formulas as four per-token constants (seconds): T_comp =
    a * (p - s + d) + b * d + c * (p^2 - s^2), T_mem = m * (d * p + d * (d + 1) / 2)."""
    m, hw = cm.model, cm.hardware
    return np.array(
        [
            2.0 * m.layer_params / hw.peak_flops,
            2.0 * m.hidden_size * m.vocab_size / hw.peak_flops,
            2.0 * m.num_layers * m.num_heads * m.head_dim / hw.peak_flops,
            m.kv_bytes_per_token / hw.mem_bandwidth,
        ]
    )


@dataclass(frozen=True, slots=True, eq=False)
class Run:
    """One simulated run: per item its cached start and replica (items in stream order), per
    replica predicted T_comp and T_mem (seconds), and per task or unit (`dispatch`'s) the
    replica that ran it and its finish (tasks) or start (units) time."""

    items: _Items
    cached_start: np.ndarray
    item_replica: np.ndarray
    compute_s: np.ndarray
    memory_s: np.ndarray
    dispatch: Tasks | Units
    grain_replica: np.ndarray
    grain_time_s: np.ndarray

    @property
    def busy_s(self) -> np.ndarray:
        """[num_replicas] each replica's busy time: BlendServe's max(T_comp, T_mem)."""
        return np.maximum(self.compute_s, self.memory_s)

    def computed_tokens(self, w: Workload) -> np.ndarray:
        """Prompt tokens each item computed ([num_items])."""
        return w.depth[self.items.node] - self.cached_start

    def replica_computed(self, w: Workload, num_replicas: int) -> np.ndarray:
        return np.bincount(self.item_replica, weights=self.computed_tokens(w), minlength=num_replicas).astype(np.int64)


def simulate(
    w: Workload, items: _Items, cluster: Cluster, cost_model: CostModel, how: Tasks | Units | None = None
) -> Run:
    """Run the items through the cluster's caches (sim_cache.py), dispatched `how` (sim_dispatch.py);
    None: each item on its `replica` (units of equal replicas, no stealing)."""
    how = how or fixed_units(items.replica)
    if how.starts[0] != 0 or how.starts[-1] != len(items.kind) or np.any(np.diff(how.starts) < 0):
        raise ValueError(f"simulate: the dispatch's boundaries must run from 0 to the {len(items.kind)} items")
    R = cluster.num_replicas
    max_chain = int(levels(w.parent).max()) + 2
    seqs = max(1, min(cluster.max_num_seqs, len(items.kind)))
    pool = R * (cluster.cache_blocks + seqs * (max_chain + 2) + 4)
    st, buf = dispatch.new_state(R, seqs, pool, max_chain)
    n = len(items.kind)
    out = (np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, -1.0), np.zeros(R), np.zeros(R))
    it = tuple(np.ascontiguousarray(a, np.int64) for a in (items.kind, items.node, items.anchor, items.output_len))
    args = (
        st,
        buf,
        it,
        (w.parent, w.depth),
        (R, seqs, cluster.cache_blocks, cluster.block_size, len(w.parent)),
        cost_coefficients(cost_model),
        out,
        how.starts.astype(np.int64),
    )
    with np.errstate(over="ignore"):  # cache._home's multiplicative hash wraps on purpose (as in numba)
        if isinstance(how, Tasks):
            ready = _times(how.ready_s, R, "ready_s", "actors")
            if not np.isfinite(ready).any():
                raise ValueError("simulate: Tasks.ready_s must bring at least one actor up (a finite time)")
            arrive = _times(how.arrive_s, len(how.starts) - 1, "arrive_s", "tasks")
            nodes = (
                node_numbers(how.data_node, len(how.starts) - 1, "data_node", "tasks", ndim=2),
                node_numbers(how.actor_node, R, "actor_node", "actors"),
            )
            speed = np.ones(R) if how.speed is None else np.asarray(how.speed, np.float64)
            if speed.shape != (R,) or not np.all(speed > 0):
                raise ValueError(f"simulate: Tasks.speed must give each of the {R} actors a pace > 0")
            kernel = dispatch.kernel("_dispatch_tasks", n)
            grain, when = kernel(*args, how.max_in_flight, ready, arrive, nodes, speed)
        else:
            last = np.zeros(len(how.owner), bool) if how.last is None else np.asarray(how.last, bool)
            order = np.lexsort((last, how.owner))  # by owner, its loose units last, else plan order
            own_starts = np.searchsorted(how.owner[order], np.arange(R + 1)).astype(np.int64)
            grain, when = dispatch.kernel("_dispatch_units", n)(
                *args, order.astype(np.int64), own_starts, how.seconds.astype(np.float64), bool(how.steal)
            )
    return Run(items, out[0], out[1], out[3], out[4], how, grain, when)


def _times(given: np.ndarray | None, n: int, name: str, what: str) -> np.ndarray:
    """A Tasks time field as the kernel takes it: [n] seconds >= 0 (None: all 0)."""
    times = np.zeros(n) if given is None else np.asarray(given, np.float64)
    if times.shape != (n,) or not np.all(times >= 0):  # NaN too
        raise ValueError(f"simulate: Tasks.{name} must give each of the {n} {what} a time >= 0")
    return times


def node_numbers(given: np.ndarray | None, n: int, name: str, what: str, ndim: int = 1) -> np.ndarray:
    """A Tasks node field as the kernel takes it: [n] node numbers >= 0, or -1 (None: all -1);
    ndim=2: [n, K], K nodes each in order ([n] given: one each)."""
    nodes = np.full(n, -1, np.int64) if given is None else np.asarray(given, np.int64)
    if ndim == 2 and nodes.ndim == 1:
        nodes = nodes[:, None]
    if nodes.ndim != ndim or len(nodes) != n or not np.all(nodes >= -1):
        raise ValueError(f"simulate: Tasks.{name} must give each of the {n} {what} a node number, or -1")
    return nodes


def fixed_units(replica: np.ndarray) -> Units:
    """Each item on its given replica: units are the runs of one replica, nothing stolen."""
    if len(replica) and replica.min() < 0:
        raise ValueError("simulate: give each item a replica, or a dispatch")
    cut = np.flatnonzero(np.r_[True, replica[1:] != replica[:-1]]) if len(replica) else np.zeros(0, np.int64)
    return Units(np.r_[cut, len(replica)].astype(np.int64), replica[cut].astype(np.int64), np.zeros(len(cut)))


def ray_tasks(
    num_items: int,
    ray: RayData,
    num_replicas: int,
    block_rows: np.ndarray | None = None,
    ready_s: np.ndarray | None = None,
    arrive_s: np.ndarray | None = None,
) -> Tasks:
    """Ray Data's tasks over a stream of rows: its blocks (given, or RayData's), bundled;
    ready_s, arrive_s: Tasks'."""
    blocks = ray.block_rows(num_items, num_replicas) if block_rows is None else np.asarray(block_rows, np.int64)
    if int(blocks.sum()) != num_items:
        raise ValueError(
            f"block_rows sum to {int(blocks.sum())} rows for a stream of {num_items}: give every row a block"
        )
    edges = np.r_[0, np.cumsum(blocks)].astype(np.int64)
    return Tasks(edges[bundle_blocks(blocks, ray.batch_size)], ray.max_tasks_in_flight_per_actor, ready_s, arrive_s)


def joins_pieces(policy: str) -> bool:
    """Whether the policy runs the plan a job whose engines steal gets (build_plan stealing=True:
    a group's small pieces joined to its replica); the other plan policies run the static plan."""
    return policy == "plan_steal"


def plan_units(stream: PlanStream, steal: bool) -> Units:
    """The plan's units as its engines' queue (work_queue.py) holds them: with stealing each
    replica runs its loose units last (where thieves take first), without it in plan order."""
    last = None
    if steal:
        last = np.asarray(loose_units(shared_beyond_floor(stream.unit_owner.tolist(), stream.unit_shared.tolist())))
    return Units(stream.unit_starts, stream.unit_owner, stream.unit_seconds, steal, last)


def policy_stream(
    w: Workload,
    policy: str,
    num_replicas: int,
    plan=None,
    outs: np.ndarray | None = None,
    ray: RayData | None = None,
    block_size: int = BLOCK_SIZE,
) -> tuple[_Items, Tasks | Units]:
    """The stream a policy feeds the replicas and how it is dispatched (module doc). plan: for the
    plan policies (items.make_plan's, with stealing=joins_pieces(policy); one made here when not
    given); outs: [n] tokens each row decodes (default its cap); ray: the arrival and sorted
    policies' hand-out."""
    if policy in ("arrival", "sorted"):
        order = np.arange(len(w), dtype=np.int64) if policy == "arrival" else w.sorted_order.astype(np.int64)
        return plain_items(w, order, outs), ray_tasks(len(w), ray or RayData(), num_replicas)
    if policy in ("plan", "plan_steal", "plan_vllm", "plan_steal_unjoined"):
        if plan is None:
            plan = plan_workload(w, num_replicas, block_size, stealing=joins_pieces(policy))
        stream = plan_stream(w, plan, outs)
        if policy != "plan_vllm":
            return stream.items, plan_units(stream, policy.startswith("plan_steal"))
        rows = stream.items.kind != OWNER  # the vLLM backend has no prefix owners
        before = np.r_[0, np.cumsum(rows)]
        return stream.items.rows_only(), Units(before[stream.unit_starts], stream.unit_owner, stream.unit_seconds)
    raise ValueError(f"policy={policy!r} is not known: use one of {', '.join(ALL_POLICIES)}")
