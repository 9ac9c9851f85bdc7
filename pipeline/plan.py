"""Plan: the global stage's output, and `build_plan`, the planner's entry point.

build_plan: prompts -> prefix tree -> groups -> order -> runs of one group -> replicas. The
batchllm order (the default) nests groups at every level of the tree and runs them depth first
(multilevel.py); fcfs, dfs and blendserve use the single-level grouping (BatchLLM Alg. 1,
exact) and the policy's order (ordering.py), split by partition.py. The plan is an Arrow
table, one row per prompt in plan order (replica, then rank), plus a summary of token counts
and saving ratios. Token ids are never copied: groups hand out views into the planner's flat
token buffer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from prefixflow.errors import one_of, require
from prefixflow.pipeline.blendserve import estimate_output_lens
from prefixflow.pipeline.block_hash import HashedPrompts, shared_prefix
from prefixflow.pipeline.cost_model import DEFAULT_OUTPUT_LEN, CostModel, HardwareProfile, ModelShape
from prefixflow.pipeline.grouping import Grouping, first_level_saved_tokens, maximize_reuse, runs
from prefixflow.pipeline.homes import HomeHits, PrefixHomes
from prefixflow.pipeline.multilevel import UNITS_PER_REPLICA, nested_groups, plan_multi_level
from prefixflow.pipeline.ordering import ORDER_POLICIES, order_prompts
from prefixflow.pipeline.partition import Partition, ReplicaRuns, partition_runs
from prefixflow.pipeline.prefix_tree import PrefixTree
from prefixflow.pipeline.ragged import RaggedTokens
from prefixflow.requests import PrefixGroup

# The single-level grouping (maximize_reuse, a Python pass per node) is the batchllm plan's
# yardstick only: above this many tree nodes its summary ratio is NaN (not computed).
SINGLE_LEVEL_METRIC_MAX_NODES = 2_000_000

DEFAULT_ORDER = "batchllm"  # the one default plan order (ProcessorConfig and the job spec use it)


@dataclass(frozen=True, slots=True, eq=False)
class PlanUnit:
    """A stretch of one replica's plan that shares nothing with the rest of it but its parents'
    prefixes (a subtree, or a piece of a group larger than a unit): the grain at which a
    replica that runs dry takes work from another, never split.

    unit_id: its index in the plan (Plan.unit_starts); replica: the replica the plan gave it
    to; groups: its runs in order; predicted_seconds: the cost model's time for it."""

    unit_id: int
    replica: int
    groups: list[PrefixGroup]
    predicted_seconds: float

    @property
    def row_ids(self) -> np.ndarray:
        return (
            np.concatenate([g.row_ids for g in self.groups]).astype(np.int64) if self.groups else np.zeros(0, np.int64)
        )


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """What every replica runs, in which order, sharing which prefix.

    table: one row per prompt in plan order, columns row_id, replica, rank (position in its
        replica's order), group_id, prefix_len, distinct_len, prompt_len, output_len (null when
        unknown).
    summary: num_rows, num_groups, prompt_tokens, computed_prompt_tokens, token_saving_ratio
        (what this plan's order and grouping achieve, with the engines' prefix cache for the
        nested groups of batchllm), single_level_token_saving_ratio (the enlarged first level;
        NaN for batchllm above SINGLE_LEVEL_METRIC_MAX_NODES tree nodes),
        first_level_token_saving_ratio (the tree's plain first level), optimal_token_saving_ratio (multi-level optimum of the tree), per-replica counts, batchllm_plan ("nested", or "single_level" where that computes fewer tokens), ...
    """

    table: pa.Table
    summary: dict[str, Any]
    tokens: RaggedTokens | None  # None when planned from block hashes (then `hashed`)
    seq_index: np.ndarray  # [num_rows] prompt index of each table row
    run_starts: np.ndarray  # [num_runs + 1] table-row boundaries of the runs (groups)
    replica_runs: np.ndarray  # [num_replicas + 1] run boundaries of each replica
    # Units: the partition's parts in plan order (a subtree, or a piece of a large group), what
    # a replica that runs dry may take from another, whole (units(), operators/stages/work_queue.py).
    unit_starts: np.ndarray  # [num_units + 1] table-row boundaries of the units
    unit_seconds: np.ndarray  # [num_units] predicted seconds of each unit (cost_model.py)
    # [num_units] prompt tokens each unit's first row shares with the row before it on its
    # replica (the unit before it; 0 for a replica's first): what a thief that takes the unit
    # computes again while the victim runs its neighbour (work_queue.py).
    unit_shared: np.ndarray
    hashed: HashedPrompts | None = None

    @property
    def num_replicas(self) -> int:
        return len(self.replica_runs) - 1

    @property
    def num_units(self) -> int:
        return len(self.unit_starts) - 1

    @property
    def group_sizes(self) -> np.ndarray:
        """Rows of each group (run), in plan order: the table's group_id counts."""
        return np.diff(self.run_starts).astype(np.int64)

    def groups(self, replica: int = 0) -> list[PrefixGroup]:
        """The replica's prefix-sharing groups in run order.

        A plan made from block hashes (HashedPrompts) fetches this replica's token ids here and
        sets each group's prefix to what its members really share (block_hash.shared_prefix): a
        hash collision shrinks it, the tokens after the last whole block extend it. The table
        keeps the planned (whole-block) prefix_len."""
        first, last = self._replica_range(replica)
        return self._groups(replica, self.run_starts[first : last + 1])

    def units(self, replica: int = 0) -> list[PlanUnit]:
        """The replica's units in plan order, each with its groups: a run that a unit boundary
        cuts gives each unit its piece, with the run's prefix (a piece of one member too). On
        the replica that runs the run, a later piece joins the earlier one's group in the
        engine; on a thief it is a group of its own and computes the prefix there."""
        first, last = self._replica_range(replica)
        lo, hi = int(self.run_starts[first]), int(self.run_starts[last])
        u_lo, u_hi = np.searchsorted(self.unit_starts, [lo, hi])
        cuts = np.union1d(self.run_starts[first : last + 1], self.unit_starts[u_lo : u_hi + 1])
        groups = self._groups(replica, cuts)
        unit_of = np.searchsorted(self.unit_starts, cuts[:-1], side="right") - 1
        units = []
        for u in range(int(u_lo), int(u_hi)):
            mine = [g for g, k in zip(groups, unit_of) if k == u]
            units.append(PlanUnit(u, replica, mine, float(self.unit_seconds[u])))
        return units

    def _replica_range(self, replica: int) -> tuple[int, int]:
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica={replica} is out of range: the plan has {self.num_replicas}")
        return int(self.replica_runs[replica]), int(self.replica_runs[replica + 1])

    def _groups(self, replica: int, cuts: np.ndarray) -> list[PrefixGroup]:
        """One group per stretch between consecutive `cuts` (table rows of one replica, each
        inside one run), with its run's id and prefix."""
        cols = {name: self.table.column(name).to_numpy() for name in ("row_id", "prefix_len")}
        out_col = self.table.column("output_len")
        out_lens = None if out_col.null_count == len(out_col) else out_col.to_numpy(zero_copy_only=False)
        base, end = int(cuts[0]), int(cuts[-1])
        hashed = None
        if self.tokens is not None:
            tokens, index = self.tokens, self.seq_index
        elif self.hashed is not None:  # positions base.. of this replica, fetched in plan order
            hashed = self.hashed
            tokens = hashed.fetch_tokens(self.seq_index[base:end])
            index = np.arange(len(self.seq_index), dtype=np.int64) - base
        else:
            raise ValueError("Plan has neither tokens nor hashed prompts: make it with build_plan")
        run_of = np.searchsorted(self.run_starts, cuts[:-1], side="right") - 1
        groups = []
        for k in range(len(cuts) - 1):
            lo, hi = int(cuts[k]), int(cuts[k + 1])
            prompts = [tokens[int(s)] for s in index[lo:hi]]
            # A piece of a cut run keeps the run's prefix, even alone: on the replica running
            # the run's other pieces it joins their group (engine/native/llm_engine.py).
            plen = int(cols["prefix_len"][lo])
            if hashed is not None:  # planned from block hashes
                plen = shared_prefix(plen, prompts, hashed.block_size)
            groups.append(
                PrefixGroup(
                    group_id=int(run_of[k]),
                    prefix=prompts[0][:plen],
                    row_ids=cols["row_id"][lo:hi],
                    distinct=tuple(p[plen:] for p in prompts),
                    output_lens=None if out_lens is None else out_lens[lo:hi],
                    replica=replica,
                )
            )
        return groups

    def replica_table(self, replica: int) -> pa.Table:
        lo = int(self.run_starts[self.replica_runs[replica]])
        hi = int(self.run_starts[self.replica_runs[replica + 1]])
        return self.table.slice(lo, hi - lo)


def build_plan(
    prompts: Sequence[Sequence[int]] | RaggedTokens | HashedPrompts | Any,
    *,
    row_ids: Sequence[int] | np.ndarray | None = None,
    output_lens: Sequence[int] | np.ndarray | None = None,
    order: str = DEFAULT_ORDER,
    num_replicas: int = 1,
    min_prefix_len: int = 1,
    model: ModelShape | dict | str | None = None,
    hardware: str | HardwareProfile = "h100",
    stealing: bool = False,
    homes: PrefixHomes | None = None,
) -> Plan:
    """Plan a whole job: group prompts that share prefixes, order them, split across replicas.

    prompts: token-id sequences (lists, numpy arrays, a pyarrow list array, or RaggedTokens),
        or HashedPrompts: lengths and block hashes only (block_hash.py), shared prefixes then
        count in whole KV blocks and the token ids are fetched per replica by `groups`.
    row_ids: one unique id per prompt (default 0..n-1).
    output_lens: expected output length per prompt (used by ordering and the cost model); -1
        marks an unknown one, estimated from the known ones in its subtree (BlendServe Sec. 5.1).
    order: "fcfs" | "dfs" | "batchllm" | "blendserve". num_replicas: data-parallel engine replicas.
    min_prefix_len: shortest prefix worth a group (engines pass their KV block size).
    model: the model's shape for the cost model (a ModelShape, a Hugging Face config dict, or
        a config.json / model directory path); None: Llama-3.1-8B's shape.
    hardware: "h100" | "h200" | "a100" | "cpu" (measured) or a HardwareProfile. Replicas are
        balanced on the predicted time (cost_model.py; unknown output lengths use a default).
    stealing: the engines steal units (work_queue.py), evening out a unit's time: a small piece
        of a group may join the rest on its replica (partition.py `_join_small_pieces`).
    homes: the blocks each replica computed in the job's earlier windows (homes.py; prompts given
        as HashedPrompts, order batchllm): a unit goes where its prefix is, within the replica's
        share, and what the rows find there is not counted as computed (`home_hit_tokens`).
    """
    started = time.perf_counter()
    source = prompts if isinstance(prompts, HashedPrompts) else RaggedTokens.from_sequences(prompts)
    hashed, tokens = (source, None) if isinstance(source, HashedPrompts) else (None, source)
    lengths = source.lengths
    ids, outs = _checked_args(len(lengths), row_ids, output_lens, order, num_replicas)
    tree = _prefix_tree(source)
    single = order != "batchllm" or tree.num_nodes <= SINGLE_LEVEL_METRIC_MAX_NODES
    grouping = maximize_reuse(tree, min_prefix_len) if single else None
    # Unknown output lengths (-1) are estimated from sampled ones in their subtree (BlendServe 5.1).
    est = None if outs is None else estimate_output_lens(tree, outs)
    cost_model = CostModel.create(model, hardware)
    hits = None if homes is None or hashed is None else homes.find(hashed)
    planned, ref, plan_kind = _plan_runs(
        tree, grouping, lengths, est, cost_model, order, num_replicas, min_prefix_len, hashed, stealing, hits
    )
    table = _plan_table(ids, planned, lengths, outs)
    summary = _summary(tree, grouping, lengths, planned, num_replicas, order)
    _add_predictions(summary, planned.partition, cost_model, ref, outs is None)
    if plan_kind is not None:
        summary["batchllm_plan"] = plan_kind
    if homes is not None:
        summary["home_hit_tokens"] = planned.home_hit_tokens
    unit_starts, unit_s = _units(cost_model, lengths, est, planned, num_replicas)
    summary["num_units"] = int(len(unit_starts) - 1)
    summary["planning_seconds"] = time.perf_counter() - started
    return Plan(
        table,
        summary,
        tokens,
        planned.seq_index,
        planned.run_starts,
        planned.replica_runs,
        unit_starts,
        unit_s,
        _unit_shared(planned, unit_starts),
        hashed,
    )


def _checked_args(
    n: int,
    row_ids: Sequence[int] | np.ndarray | None,
    output_lens: Sequence[int] | np.ndarray | None,
    order: str,
    num_replicas: int,
) -> tuple[np.ndarray, np.ndarray | None]:
    """build_plan's row ids and output lengths as arrays, after checking every argument."""
    ids = _check_row_ids(row_ids, n)
    outs = _check_output_lens(output_lens, n)
    require(order in ORDER_POLICIES, "build_plan", "order", order, one_of(ORDER_POLICIES))
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas} is invalid: use at least 1")
    return ids, outs


def _prefix_tree(source: HashedPrompts | RaggedTokens) -> PrefixTree:
    """The prompts' prefix tree: from block hashes (then in whole blocks), or from the token ids."""
    if isinstance(source, HashedPrompts):
        return PrefixTree.from_sorted(*source.sort_with_lcp(), source.lengths)
    return PrefixTree.build(source)


def _plan_runs(
    tree: PrefixTree,
    grouping: Grouping | None,
    lengths: np.ndarray,
    est: np.ndarray | None,
    cost_model: CostModel,
    order: str,
    num_replicas: int,
    min_prefix_len: int,
    hashed: HashedPrompts | None,
    stealing: bool,
    hits: HomeHits | None = None,
) -> tuple[ReplicaRuns, Grouping, str | None]:
    """The order's plan: (its runs split across replicas, the grouping whose saving it keeps
    a share of, which batchllm plan it is: "nested" or "single_level", None for other orders)."""
    if order == "batchllm":
        block = hashed.block_size if hashed is not None else max(min_prefix_len, 1)
        return _batchllm(tree, grouping, lengths, est, cost_model, num_replicas, min_prefix_len, block, stealing, hits)
    assert grouping is not None, "every order but batchllm makes the single-level grouping"
    planned = _single_level(tree, grouping, lengths, est, cost_model, order, num_replicas)
    return planned, grouping, None


def _units(
    cm: CostModel, lengths: np.ndarray, est: np.ndarray | None, planned: ReplicaRuns, num_replicas: int
) -> tuple[np.ndarray, np.ndarray]:
    """(unit starts in plan order, predicted seconds of each unit). A unit is one or more
    parts of the partition (subtrees, groups, or pieces of one) next to each other on one
    replica, of about a replica's share / UNITS_PER_REPLICA: a part predicted to take more is
    cut, so that a replica that runs dry finds work of that grain to take (a single-level group
    asked a million questions is one part), and small parts join the parts before them, since
    each unit costs its engine a round trip to the work queue (in a windowed plan, documents
    whose prefixes earlier windows left on different replicas are parts of their own: 20,000
    rows in 7 windows were 5,470 units, one plan's 94, and the engines took twice the steps;
    bench/stream_job_bench.py). The cuts change neither the plan's order nor its runs. A row's
    time: its compute (members attend to their run's prefix; each run's prefix once, on its
    first row) and memory time; a unit's: BlendServe's T = max(T_comp, T_mem) (cost_model.py)."""
    n = len(planned.seq_index)
    parts = np.r_[0, np.cumsum(planned.partition.part_hi - planned.partition.part_lo)].astype(np.int64)
    if n == 0:
        return parts, np.zeros(0)
    run_len = np.diff(planned.run_starts)
    prefix = np.repeat(planned.run_prefix, run_len)
    prompt = lengths[planned.seq_index]
    out = np.full(n, DEFAULT_OUTPUT_LEN) if est is None else est[planned.seq_index]
    comp = cm.compute_seconds(prompt, out, prefix).astype(np.float64)
    comp[planned.run_starts[:-1]] += cm.prefix_seconds(planned.run_prefix)
    mem = cm.memory_seconds(prompt, out).astype(np.float64)
    cum = np.r_[0.0, np.cumsum(comp + mem)]
    cap = max(cum[-1] / (num_replicas * UNITS_PER_REPLICA), 1e-30)
    part_of = np.repeat(np.arange(len(parts) - 1), np.diff(parts))
    # Within a part, a new unit every `cap` of time from the part's start; a part starts a unit
    # where it starts a replica or passes a multiple of `cap` of the replica's time, or where it
    # would take the unit it joins past `cap` (so a unit of several parts stays within cap).
    chunk = np.floor((cum[:-1] - cum[parts[part_of]]) / cap).astype(np.int64)
    new = np.r_[False, (chunk[1:] != chunk[:-1]) & (part_of[1:] == part_of[:-1])]
    new[_unit_parts(parts, planned.partition.part_replica, cum, cap)] = True
    starts = np.r_[np.flatnonzero(new), n].astype(np.int64)
    return starts, np.maximum(np.add.reduceat(comp, starts[:-1]), np.add.reduceat(mem, starts[:-1]))


def _unit_shared(planned: ReplicaRuns, unit_starts: np.ndarray) -> np.ndarray:
    """[num_units] Plan.unit_shared: the order's prev_lcp at each unit's first row; where the
    order gives none, a row continuing its run shares the run's prefix, any other row nothing."""
    first = unit_starts[:-1]
    if planned.prev_lcp is not None:
        found: np.ndarray = planned.prev_lcp[first].astype(np.int64)
        return found
    run = np.searchsorted(planned.run_starts, first, side="right") - 1
    shared: np.ndarray = np.where(first > planned.run_starts[run], planned.run_prefix[run], 0).astype(np.int64)
    return shared


def _unit_parts(parts: np.ndarray, part_replica: np.ndarray, cum: np.ndarray, cap: float) -> np.ndarray:
    """The first rows of the parts that start a unit (_units): parts[k] .. parts[k+1] are part
    k's rows, cum the plan's cumulative predicted seconds by row."""
    lo, hi = parts[:-1], parts[1:]
    keep = hi > lo  # an empty part starts nothing
    lo, hi, replica = lo[keep], hi[keep], part_replica[keep]
    first = np.r_[True, replica[1:] != replica[:-1]]
    replica_start = np.maximum.accumulate(np.where(first, lo, 0))
    bucket = np.floor((cum[lo] - cum[replica_start]) / cap).astype(np.int64)
    joins = first | np.r_[True, bucket[1:] != bucket[:-1]]
    joined_start = np.maximum.accumulate(np.where(joins, lo, 0))
    starts: np.ndarray = lo[joins | (cum[hi] - cum[joined_start] > cap)]
    return starts


def _single_level(
    tree: PrefixTree,
    grouping: Grouping,
    lengths: np.ndarray,
    est: np.ndarray | None,
    cost_model: CostModel,
    order: str,
    num_replicas: int,
) -> ReplicaRuns:
    """fcfs, dfs, blendserve: one level of groups (BatchLLM Alg. 1), the policy's order cut into
    runs of one group, runs split across replicas (partition.py)."""
    seq_order = order_prompts(order, tree, grouping, lengths, est, cost_model=cost_model)
    starts = runs(seq_order, grouping)
    run_len = np.diff(starts)
    # A run of one shares nothing: it is planned as a group of one with an empty prefix.
    run_prefix = np.where(run_len > 1, grouping.prefix_len[seq_order[starts[:-1]]], 0)
    part = _partition(cost_model, seq_order, starts, run_prefix, lengths, est, num_replicas)
    seq_index, new_starts, part_len, part_prefix = _parts_in_plan_order(seq_order, starts, grouping, part)
    part_prompt = np.add.reduceat(lengths[seq_index], new_starts[:-1]) if len(lengths) else np.zeros(0, np.int64)
    part_computed = part_prompt - (part_len - 1) * part_prefix
    return ReplicaRuns(seq_index, new_starts, part_prefix, part_computed, part.part_replica, part.replica_parts, part)


def _batchllm(
    tree: PrefixTree,
    grouping: Grouping | None,
    lengths: np.ndarray,
    est: np.ndarray | None,
    cost_model: CostModel,
    num_replicas: int,
    min_prefix_len: int,
    block: int,
    stealing: bool = False,
    hits: HomeHits | None = None,
) -> tuple[ReplicaRuns, Grouping, str]:
    """The batchllm plan: nested groups (multilevel.py), unless the single-level plan (BatchLLM
    Alg. 1, groups in Eq. 3 order) is predicted to compute fewer prompt tokens. The nested
    prediction is what the engines compute; the single-level one counts no hit across groups,
    an upper bound, so the swap never computes more. Returns (the plan's runs, their grouping,
    "nested" or "single_level"). Only where the single-level grouping was made (its uncut
    saving bounds the single-level plan: at or below that the nested plan is kept without
    building it)."""
    ng = nested_groups(tree, lengths, est, min_prefix_len, block)
    outs = np.full(len(lengths), DEFAULT_OUTPUT_LEN) if est is None else est
    nested = plan_multi_level(tree, ng, lengths, outs, cost_model, num_replicas, block, stealing, hits)
    computed = int(nested.run_computed.sum())
    if grouping is None or computed <= int(lengths.sum()) - grouping.saved_tokens:
        return nested, ng.grouping, "nested"
    single = _single_level(tree, grouping, lengths, est, cost_model, "batchllm", num_replicas)
    if int(single.run_computed.sum()) < computed:
        return single, grouping, "single_level"
    return nested, ng.grouping, "nested"


def _parts_in_plan_order(
    seq_order: np.ndarray, starts: np.ndarray, grouping: Grouping, part: Partition
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Plan order: replica by replica, each keeping the policy's order of its parts (a part is a
    run, or a piece of a run cut between replicas; each piece keeps the run's prefix).
    Returns (prompt index per plan row, part starts, part lengths, part prefix lengths)."""
    n = len(seq_order)
    part_len = part.part_hi - part.part_lo
    new_starts = np.r_[0, np.cumsum(part_len)].astype(np.int64)
    shift = np.repeat(part.part_lo - new_starts[:-1], part_len)
    seq_index = seq_order[np.arange(n, dtype=np.int64) + shift]
    group_prefix = grouping.prefix_len[seq_order[starts[:-1]]] if n else np.zeros(0, np.int64)
    part_prefix = np.where(part_len > 1, group_prefix[part.part_run], 0)
    return seq_index, new_starts, part_len, part_prefix


def _partition(
    cm: CostModel,
    seq_order: np.ndarray,
    starts: np.ndarray,
    run_prefix: np.ndarray,
    lengths: np.ndarray,
    outs: np.ndarray | None,
    num_replicas: int,
) -> Partition:
    """Predicted cost of every row and run prefix, then the balanced split (partition.py)."""
    row_prefix = np.repeat(run_prefix, np.diff(starts))
    prompt = lengths[seq_order]
    out = np.full(len(seq_order), DEFAULT_OUTPUT_LEN) if outs is None else outs[seq_order]
    row_c = cm.compute_seconds(prompt, out, row_prefix)
    row_m = cm.memory_seconds(prompt, out)
    return partition_runs(starts, row_c, row_m, cm.prefix_seconds(run_prefix), run_prefix, num_replicas)


def _add_predictions(
    summary: dict[str, Any], part: Partition, cm: CostModel, grouping: Grouping, assumed_outputs: bool
) -> None:
    """Per replica: predicted time (cost_model.py) and the saved tokens the cut gave up."""
    predicted = part.predicted_s
    for r, rep in enumerate(summary["replicas"]):
        rep["predicted_seconds"] = float(predicted[r])
        rep["predicted_compute_seconds"] = float(part.compute_s[r])
        rep["predicted_memory_seconds"] = float(part.memory_s[r])
        rep["lost_saving_tokens"] = int(part.lost_saving_tokens[r])
    mean = float(predicted.mean()) if len(predicted) else 0.0
    summary["predicted_seconds_max_over_mean"] = float(predicted.max() / mean) if mean > 0 else 1.0
    summary["lost_saving_tokens"] = int(part.lost_saving_tokens.sum())
    saved = summary["prompt_tokens"] - summary["computed_prompt_tokens"]
    summary["sharing_kept"] = float(saved / grouping.saved_tokens) if grouping.saved_tokens else 1.0
    summary["cost_model"] = {
        "hardware": cm.hardware.name,
        "kv_bytes_per_token": cm.model.kv_bytes_per_token,
        "output_len_assumed": DEFAULT_OUTPUT_LEN if assumed_outputs else None,
    }


def _plan_table(ids: np.ndarray, planned: ReplicaRuns, lengths: np.ndarray, outs: np.ndarray | None) -> pa.Table:
    seq_index, run_starts, run_prefix = planned.seq_index, planned.run_starts, planned.run_prefix
    run_replica, replica_runs = planned.run_replica, planned.replica_runs
    run_len = np.diff(run_starts)
    prefix = np.repeat(run_prefix, run_len).astype(np.int32)
    prompt_len = lengths[seq_index].astype(np.int32)
    replica = np.repeat(run_replica, run_len).astype(np.int32)
    first_row_of_replica = run_starts[replica_runs[:-1]]
    rank = (
        np.arange(len(seq_index), dtype=np.int64) - first_row_of_replica[replica]
        if len(seq_index)
        else np.zeros(0, np.int64)
    )
    output_len = (
        pa.nulls(len(seq_index), pa.int32())
        if outs is None
        else pa.array(outs[seq_index].astype(np.int32), mask=outs[seq_index] < 0)
    )
    return pa.table(
        {
            "row_id": pa.array(ids[seq_index]),
            "replica": pa.array(replica),
            "rank": pa.array(rank),
            "group_id": pa.array(np.repeat(np.arange(len(run_len), dtype=np.int64), run_len)),
            "prefix_len": pa.array(prefix),
            "distinct_len": pa.array(prompt_len - prefix),
            "prompt_len": pa.array(prompt_len),
            "output_len": output_len,
        }
    )


def _summary(
    tree: PrefixTree,
    grouping: Grouping | None,
    lengths: np.ndarray,
    planned: ReplicaRuns,
    num_replicas: int,
    order: str,
) -> dict[str, Any]:
    run_len, run_computed, run_replica = np.diff(planned.run_starts), planned.run_computed, planned.run_replica
    total = int(lengths.sum())

    def ratio(saved: float) -> float:
        return float(saved) / total if total else 0.0

    computed = int(run_computed.sum())
    replicas = []
    for r in range(num_replicas):
        mine = run_replica == r
        replicas.append(
            {
                "replica": r,
                "num_rows": int(run_len[mine].sum()),
                "num_groups": int(mine.sum()),
                "computed_prompt_tokens": int(run_computed[mine].sum()),
            }
        )
    return {
        "num_rows": int(len(lengths)),
        "num_groups": int(len(run_len)),
        "num_shared_groups": int((run_len > 1).sum()),
        "order": order,
        "num_replicas": num_replicas,
        "prompt_tokens": total,
        "computed_prompt_tokens": computed,
        "token_saving_ratio": ratio(total - computed),
        "single_level_token_saving_ratio": ratio(grouping.saved_tokens) if grouping else float("nan"),
        "first_level_token_saving_ratio": ratio(first_level_saved_tokens(tree)),
        "optimal_token_saving_ratio": ratio(total - tree.tree_tokens()),
        "tree_nodes": int(tree.num_nodes),
        "replicas": replicas,
    }


def _check_row_ids(row_ids: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray:
    if row_ids is None:
        return np.arange(n, dtype=np.int64)
    ids = np.asarray(row_ids, dtype=np.int64)
    if ids.shape != (n,):
        raise ValueError(f"row_ids has {ids.size} entries for {n} prompts: give one id per prompt")
    if len(np.unique(ids)) != n:
        raise ValueError("row_ids must be unique: a duplicate id would make outputs ambiguous")
    return ids


def _check_output_lens(output_lens: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray | None:
    if output_lens is None:
        return None
    outs = np.asarray(output_lens, dtype=np.int64)
    if outs.shape != (n,):
        raise ValueError(f"output_lens has {outs.size} entries for {n} prompts: give one per prompt")
    if np.any(outs < -1):
        raise ValueError("output_lens must be non-negative, or -1 for unknown (estimated per subtree)")
    return outs
