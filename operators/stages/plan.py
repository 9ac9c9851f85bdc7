"""Plan stage: the job's one global barrier, shuffle-free; or, with window_rows, one window of
the job (plan_blocks in a task of operators/stages/window_plans.py, its rows numbered from where
the window before ends).

1. The tokenized dataset is materialized; its blocks stay in the object store (one ref each).
2. One small task per block returns only per-row metadata: lengths, the error flag (and
   custom_id for OpenAI input), and leaves the block's KV-block hashes (pipeline/block_hash.py,
   8 bytes per `block_size` tokens) in the object store beside it. Row ids are positions: block
   offset + index in block. Token ids never reach the driver during planning.
3. The driver builds the Plan (pipeline/, pure numpy) from lengths; the sort asks the blocks, in
   small tasks, for a few hashes of the rows it has not yet told apart (sort_by_gather), so the
   driver holds per-row columns of a few int64s plus one bounded window of hashes.
4. Plan.units(r) pulls replica r's token ids (and checks every group's prefix against them);
   a task per replica on the driver's node builds each unit's payload (its groups and input
   rows), which any replica's engine may take (operators/stages/work_queue.py). No groupby, sort or
   shuffle ever moves full rows.

Driver memory while planning: ~250 bytes per good row (2.4 GB for 10M), the sort's bounded window and ~100 bytes
per dataset block (the model and its measurements: pipeline/block_hash.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prefixflow.lora import adapter_key
from prefixflow.operators.columns import ADAPTER, ERROR, IMAGE_AT, IMAGE_KEYS
from prefixflow.operators.stages.tokenize import MAX_TOKENS, TOKENS
from prefixflow.pipeline import RaggedTokens, build_plan
from prefixflow.pipeline.block_hash import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_CELLS,
    HashedPrompts,
    block_hashes,
    leading_found,
)
from prefixflow.pipeline.homes import HomeEntries, PrefixHomes, home_entries
from prefixflow.pipeline.plan import PlanUnit
from prefixflow.pipeline.prefix_tree import ragged_gather


@dataclass(frozen=True)
class RowIndex:
    """Where rows live: block refs in the object store and each block's first row id."""

    block_refs: tuple[Any, ...]
    block_offsets: np.ndarray  # [num_blocks + 1] int64; block b holds rows offsets[b]..offsets[b+1]

    @property
    def first_row(self) -> int:
        """The id of its first row (0, or where a window of the job starts)."""
        return int(self.block_offsets[0])

    @property
    def num_rows(self) -> int:
        return int(self.block_offsets[-1]) - self.first_row

    def joined(self, more: "RowIndex") -> "RowIndex":
        """This index and the next window's (whose rows start where these end)."""
        if more.first_row != int(self.block_offsets[-1]):
            raise ValueError(f"rows from {more.first_row} do not follow rows that end at {int(self.block_offsets[-1])}")
        return RowIndex(self.block_refs + more.block_refs, np.r_[self.block_offsets, more.block_offsets[1:]])

    def locate(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block index, index within block) of each row id."""
        blocks = np.searchsorted(self.block_offsets, row_ids, side="right") - 1
        return blocks, row_ids - self.block_offsets[blocks]


@dataclass(frozen=True)
class PlannedJob:
    """The Plan plus where the rows are, and which rows are error records."""

    plan: Any  # prefixflow.pipeline.Plan over the good rows
    rows: RowIndex
    error_row_ids: np.ndarray  # rows that become error records without running
    extra_errors: dict[int, str] = field(default_factory=dict)  # row id -> error found here
    timings: dict[str, float] = field(default_factory=dict)
    content_digest: str = ""  # sha256 over every row's columns but the tokens, in row order
    driver_bytes: int = 0  # what planning brought to its process (the driver, a window's task): metadata, hashes
    # A window of a job planned in windows (window_plans.py; None: the whole job): its number, and
    # where its units, groups and ranks start in the job's numbering (every window's continue
    # the windows' before it: unit ids in the work queue, group ids in the engines, part names).
    window: int | None = None
    first_unit: int = 0
    first_group: int = 0
    first_ranks: tuple[int, ...] = ()  # per replica; () = zeros
    # What this window's rows add to the prefix homes once they ran (pipeline/homes.py), for the
    # windows after it; None for a whole-job plan, and once the window is queued (window_summary).
    home_entries: HomeEntries | None = None
    planned_on: str = ""  # the node whose task planned it (a window: operators/stages/window_plans.py)

    @property
    def num_units(self) -> int:
        return int(self.plan.num_units)

    def next_offsets(self) -> dict[str, Any]:
        """first_unit, first_group and first_ranks of the window after this one."""
        ranks = self.first_ranks or (0,) * self.plan.num_replicas
        return {
            "first_unit": self.first_unit + self.plan.num_units,
            "first_group": self.first_group + len(self.plan.run_starts) - 1,
            "first_ranks": tuple(
                r + int(s["num_rows"]) for r, s in zip(ranks, self.plan.summary["replicas"], strict=True)
            ),
        }


def _block_meta(block: pa.Table, custom_ids: bool) -> dict[str, Any]:
    """Only the metadata the planner needs, and a digest of the block; runs next to the block."""
    if TOKENS not in block.column_names:
        # An empty input leaves blocks without rows (and without our columns): nothing to plan.
        if block.num_rows:
            raise RuntimeError(f"a tokenized block of {block.num_rows} rows has no {TOKENS} column")
        return {
            "num_rows": 0,
            "good": np.zeros(0, np.int64),
            "lengths": np.zeros(0, np.int64),
            "digest": _block_digest(block),
        }
    errors = block.column(ERROR).is_valid().to_numpy(zero_copy_only=False)
    good = np.flatnonzero(~errors)
    tokens = block.column(TOKENS).take(pa.array(good)).combine_chunks() if len(good) else None
    meta = {
        "num_rows": block.num_rows,
        "good": good,
        "lengths": np.zeros(0, np.int64)
        if tokens is None
        else pc.list_value_length(tokens).to_numpy(zero_copy_only=False).astype(np.int64),
        "digest": _block_digest(block),
    }
    if MAX_TOKENS in block.column_names:
        # Rows without their own max_tokens: null -> -1, the job's default (plan_dataset).
        col = block.column(MAX_TOKENS).cast(pa.int64()).take(pa.array(good))
        meta["max_tokens"] = pc.fill_null(col, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    if custom_ids and "custom_id" in block.column_names:  # every row's: error rows claim theirs too
        meta["custom_id"] = block.column("custom_id").to_pylist()
    return meta


def _block_digest(block: pa.Table) -> np.ndarray:
    """sha256 of every column the output carries (the token column derives from them), so that
    a resume notices an input whose prompts are the same but another column changed."""
    table = block.drop_columns([c for c in (TOKENS,) if c in block.column_names]).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return np.frombuffer(hashlib.sha256(sink.getvalue()).digest(), np.uint8)


def _meta_and_hashes(block: pa.Table, custom_ids: bool, block_size: int) -> tuple[dict[str, Any], tuple]:
    """The block's metadata, and the KV-block hashes of all its rows (none for error rows) as
    (flat, offsets): a task's second return, so the hashes stay in the object store."""
    meta = _block_meta(block, custom_ids)
    if TOKENS not in block.column_names:
        return meta, (np.zeros(0, np.int64), np.zeros(1, np.int64))
    hashes = block_hashes(plan_tokens(block), block_size, seeds=adapter_seeds(block))
    return meta, (hashes.flat, hashes.offsets)


def plan_tokens(block: pa.Table) -> RaggedTokens:
    """The block's prompts as the planner keys them: their token ids, each image's placeholder
    token replaced by the image's key (prefixflow/images.image_key), so that rows share a plan
    prefix through an image only when it is the same image. The engines get the real ids."""
    tokens = RaggedTokens.from_sequences(block.column(TOKENS))
    if IMAGE_AT not in block.column_names:
        return tokens
    at = block.column(IMAGE_AT).combine_chunks()
    rows = pc.list_parent_indices(at).to_numpy(zero_copy_only=False).astype(np.int64)
    if len(rows) == 0:
        return tokens
    flat = tokens.flat.astype(np.int64)
    positions = tokens.offsets[rows] + pc.list_flatten(at).to_numpy(zero_copy_only=False).astype(np.int64)
    flat[positions] = pc.list_flatten(block.column(IMAGE_KEYS).combine_chunks()).to_numpy(zero_copy_only=False)
    return RaggedTokens(flat, tokens.offsets)


def adapter_seeds(block: pa.Table) -> np.ndarray | None:
    """Each row's LoRA adapter as its hash chain's seed (None: a job without adapters), so that
    rows of two adapters never share a plan group (pipeline/block_hash.py)."""
    if ADAPTER not in block.column_names:
        return None
    return np.array([adapter_key(a) for a in block.column(ADAPTER).to_pylist()], np.uint64)


def _gather_meta(refs: list[Any], custom_ids: bool, block_size: int) -> tuple[list[dict[str, Any]], list[Any]]:
    """Block metadata and references to the blocks' hashes, computed by a small task on each
    block's own node. Only the metadata crosses to the driver."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        where = ray.experimental.get_object_locations(refs)
    except Exception:  # noqa: BLE001 - locations are an optimisation only
        where = {}
    task = ray.remote(_meta_and_hashes)
    meta_refs, hash_refs = [], []
    for ref in refs:
        nodes = (where.get(ref) or {}).get("node_ids") or []
        options = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=nodes[0], soft=True)} if nodes else {}
        meta_ref, hash_ref = task.options(num_cpus=0.25, num_returns=2, **options).remote(ref, custom_ids, block_size)
        meta_refs.append(meta_ref)
        hash_refs.append(hash_ref)
    return ray.get(meta_refs), hash_refs


def _hash_window(hashes: tuple, local: np.ndarray, depth: int, width: int) -> np.ndarray:
    """Hashes depth .. depth+width-1 of the given rows of one block (-1 past a row's end)."""
    return ragged_gather(RaggedTokens(*hashes))(local, depth, width)


@dataclass
class ReceivedBytes:
    """Bytes the driver received while planning (counted, to show that token ids stay put)."""

    total: int = 0


def gather_hashes(
    rows: RowIndex,
    hash_refs: list[Any],
    row_ids: np.ndarray,
    received: ReceivedBytes,
    seqs: np.ndarray,
    depth: int,
    width: int,
) -> np.ndarray:
    """The plan sort's `gather` (pipeline/prefix_tree.sort_by_gather) over the blocks: one small
    task per block that holds any of the prompts `seqs` (positions in `row_ids`)."""
    import ray

    blocks, local = rows.locate(row_ids[seqs])
    out = np.empty((len(seqs), width), dtype=np.int64)
    by_block = np.argsort(blocks, kind="stable")
    cuts = np.flatnonzero(np.diff(blocks[by_block])) + 1
    parts = np.split(by_block, cuts) if len(seqs) else []
    task = ray.remote(_hash_window).options(num_cpus=0.25)
    windows = [task.remote(hash_refs[int(blocks[idx[0]])], local[idx], depth, width) for idx in parts]
    for idx, vals in zip(parts, ray.get(windows)):
        out[idx] = vals
    received.total += out.nbytes
    return out


def _block_leading(hashes: tuple, keys: np.ndarray, local: np.ndarray, usable: np.ndarray) -> tuple:
    """leading_found over the given rows of one block (a task beside the block's hashes)."""
    return leading_found(RaggedTokens(*hashes).take(local), keys, usable)


def leading_in_blocks(
    rows: RowIndex,
    hash_refs: list[Any],
    row_ids: np.ndarray,
    received: ReceivedBytes,
    keys: np.ndarray,
    usable: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """HashedPrompts.find_leading over the blocks: the index's keys sent once, one small task
    per block looks its rows' prefixes up, two int64 a row come back (pipeline/homes.py)."""
    import ray

    n = len(row_ids)
    lead, deepest = np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    blocks, local = rows.locate(row_ids)
    by_block = np.argsort(blocks, kind="stable")
    parts = np.split(by_block, np.flatnonzero(np.diff(blocks[by_block])) + 1) if n else []
    keys_ref = ray.put(keys)
    task = ray.remote(_block_leading).options(num_cpus=0.25)
    found = [task.remote(hash_refs[int(blocks[i[0]])], keys_ref, local[i], usable[i]) for i in parts]
    for idx, (got, last) in zip(parts, ray.get(found)):
        lead[idx], deepest[idx] = got, last
    received.total += lead.nbytes + deepest.nbytes
    return lead, deepest


def fetch_tokens(rows: RowIndex, row_ids: np.ndarray, seqs: np.ndarray) -> Any:
    """Token ids of the prompts `seqs` (positions in `row_ids`), in that order (Plan.groups)."""
    if len(seqs) == 0:
        return RaggedTokens(np.zeros(0, np.int32), np.zeros(1, np.int64))
    table = fetch_rows(rows, row_ids[np.asarray(seqs, dtype=np.int64)], columns=(TOKENS,))
    return RaggedTokens.from_sequences(table.column(TOKENS))


@dataclass(frozen=True)
class UnitPayload:
    """What an engine needs to run one plan unit: its groups (token ids), its input rows in the
    unit's order (the output carries their columns; the token column dropped) and each row's
    rank in its plan replica's order (part names come from it, operators/results/write.py)."""

    unit: PlanUnit
    rows: pa.Table
    ranks: np.ndarray  # [unit rows] int64


def unit_payload_refs(planned: PlannedJob, num_replicas: int) -> list[list[Any]]:
    """Per replica, object refs of its units' payloads in plan order, built by one task per
    replica on the driver's node: the node whose loss ends the job anyway, so a lost worker
    node (and the input blocks it held) loses no unit that another replica must take over
    (work stealing, operators/stages/work_queue.py). The driver never holds the token ids."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    plan_ref = ray.put(planned.plan)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    unit_replica = planned.plan.table.column("replica").to_numpy()[planned.plan.unit_starts[:-1]]
    ranks = planned.first_ranks or (0,) * num_replicas
    refs: list[list[Any]] = []
    for r in range(num_replicas):
        count = int(np.count_nonzero(unit_replica == r))
        if count == 0:
            refs.append([])
            continue
        # No CPU: the engine actors may hold every CPU slot while they wait for these.
        task = ray.remote(_unit_payloads).options(num_cpus=0, num_returns=count, scheduling_strategy=here)
        out = task.remote(plan_ref, planned.rows, r, (planned.first_unit, planned.first_group, ranks[r]))
        refs.append([out] if count == 1 else list(out))
    return refs


def _unit_payloads(plan: Any, rows: RowIndex, replica: int, first: tuple[int, int, int] = (0, 0, 0)) -> Any:
    """Replica `replica`'s unit payloads; first: the window's first unit id, group id and rank
    (of this replica) in the job's numbering (PlannedJob)."""
    first_unit, first_group, first_rank = first
    units = plan.units(replica)
    table = plan.replica_table(replica)
    ranks = table.column("rank").to_numpy().astype(np.int64) + first_rank
    payloads, at = [], 0
    for unit in units:
        if first_unit or first_group:
            groups = [dataclasses.replace(g, group_id=g.group_id + first_group) for g in unit.groups]
            unit = PlanUnit(unit.unit_id + first_unit, unit.replica, groups, unit.predicted_seconds)
        ids = unit.row_ids
        payloads.append(UnitPayload(unit, fetch_rows(rows, ids), ranks[at : at + len(ids)]))
        at += len(ids)
    return payloads[0] if len(payloads) == 1 else tuple(payloads)


def replica_row_ids(planned: PlannedJob, replica: int) -> np.ndarray:
    """Replica `replica`'s row ids in its run order (from the plan table: no token ids)."""
    return planned.plan.replica_table(replica).column("row_id").to_numpy().astype(np.int64)


@dataclass(frozen=True)
class PlanOptions:
    """How a job's rows are planned (plan_dataset, window_plans.plan_windows).

    default_max_tokens: the output-length hint of rows whose own max_tokens is null (the job's
    sampling default, which they run with); None leaves them unknown (estimated per subtree).
    block_size: the engine's KV block size; shared prefixes are planned in whole blocks.
    stealing: the engines will steal units (a job with work_stealing): see build_plan.
    custom_ids: the rows carry OpenAI batch custom_ids, which must be unique.
    cache_blocks: KV blocks one replica's engine caches: in windows, what a later window's plan
    expects an engine still to hold of the earlier ones (pipeline/homes.py); None: the cost
    model's estimate (Llama-3.1-8B's KV on an H100)."""

    order: str
    num_replicas: int
    custom_ids: bool = False
    default_max_tokens: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    stealing: bool = False
    cache_blocks: int | None = None


def plan_dataset(ds: Any, **options: Any) -> PlannedJob:
    """Materialize the tokenized dataset `ds` and plan its good rows (see the module doc);
    options: PlanOptions' fields."""
    t0 = time.perf_counter()
    refs = ds.to_arrow_refs()  # executes read + tokenize; blocks stay in the object store
    return plan_blocks(refs, PlanOptions(**options), read_s=time.perf_counter() - t0)


def plan_blocks(
    refs: list[Any],
    opts: PlanOptions,
    first_row: int = 0,
    read_s: float = 0.0,
    seen: dict[Any, int] | None = None,
    homes: PrefixHomes | None = None,
) -> PlannedJob:
    """Plan the good rows of the tokenized blocks `refs`, whose rows are numbered from
    `first_row` (see the module doc). seen: custom_id -> first row id of the windows before.
    homes: what the replicas hold of the windows before (a window of window_plans.plan_windows)."""
    t1 = time.perf_counter()
    metas, hash_refs = _gather_meta(refs, opts.custom_ids, opts.block_size)
    offsets = first_row + np.r_[0, np.cumsum([m["num_rows"] for m in metas])].astype(np.int64)
    rows = RowIndex(tuple(refs), offsets)
    good_ids = np.concatenate([offsets[b] + m["good"] for b, m in enumerate(metas)] or [np.zeros(0, np.int64)]).astype(
        np.int64
    )
    lengths = np.concatenate([m["lengths"] for m in metas] or [np.zeros(0, np.int64)])
    extra: dict[int, str] = {}
    keep = np.ones(len(good_ids), bool)
    if opts.custom_ids:
        cids = [c for m in metas for c in m.get("custom_id", [None] * m["num_rows"])]
        keep, extra = _duplicate_custom_ids(good_ids, cids, first_row, {} if seen is None else seen)
    out_lens = _output_lens(metas, opts.default_max_tokens)
    if not keep.all():
        sel = np.flatnonzero(keep)
        good_ids, lengths = good_ids[sel], lengths[sel]
        out_lens = None if out_lens is None else out_lens[sel]
    received = ReceivedBytes(sum(v.nbytes for m in metas for v in m.values() if isinstance(v, np.ndarray)))
    prompts = HashedPrompts(
        lengths,
        partial(gather_hashes, rows, hash_refs, good_ids, received),
        opts.block_size,
        partial(fetch_tokens, rows, good_ids),
        max_cells=DEFAULT_MAX_CELLS,
        find_leading=partial(leading_in_blocks, rows, hash_refs, good_ids, received),
    )
    t2 = time.perf_counter()
    plan = build_plan(
        prompts,
        row_ids=good_ids,
        output_lens=out_lens,
        order=opts.order,
        num_replicas=opts.num_replicas,
        stealing=opts.stealing,
        homes=homes,
    )
    entries = None if homes is None else home_entries(plan, homes)  # reads hashes: before they go
    hash_refs.clear()  # planned: the hashes may leave the object store (the gather is spent)
    t3 = time.perf_counter()
    error_ids = np.setdiff1d(np.arange(offsets[0], offsets[-1], dtype=np.int64), good_ids, assume_unique=True)
    timings = {"read_tokenize_s": read_s, "gather_s": t2 - t1, "build_plan_s": t3 - t2}
    digest = hashlib.sha256(b"".join(m["digest"].tobytes() for m in metas)).hexdigest()  # block order
    return PlannedJob(plan, rows, error_ids, extra, timings, digest, received.total, home_entries=entries)


def _output_lens(metas: list[dict[str, Any]], default_max_tokens: int | None) -> np.ndarray | None:
    """Per good row: its max_tokens (the output-length hint), when every block has them."""
    with_rows = [m for m in metas if len(m["good"])]
    if not with_rows or not all("max_tokens" in m for m in with_rows):
        return None
    out_lens = np.concatenate([m["max_tokens"] for m in with_rows]).astype(np.int64)
    if default_max_tokens is not None:
        out_lens[out_lens < 0] = default_max_tokens
    return out_lens


def _duplicate_custom_ids(
    good_ids: np.ndarray, custom_ids: list[Any], first_row: int, seen: dict[Any, int]
) -> tuple[np.ndarray, dict[int, str]]:
    """OpenAI batch custom_ids must be unique: a good row whose custom_id an earlier row used
    becomes an error record, also where that earlier row is itself one (an invalid request or a
    broken line whose custom_id could be read: its error record answers that custom_id too).
    custom_ids: every row's from `first_row` on, in row order (None: none could be read); seen:
    custom_id -> the first row that used it, in the rows before (updated). Returns which good
    rows stay and {row id: error} for the others."""
    for row, cid in enumerate(custom_ids, start=first_row):
        if cid is not None:
            seen.setdefault(cid, row)
    keep = np.ones(len(good_ids), bool)
    extra: dict[int, str] = {}
    for i, row in enumerate(good_ids.tolist()):
        cid = custom_ids[row - first_row]
        earlier = seen.get(cid, row)
        if earlier != row:
            keep[i] = False
            extra[row] = (
                f"duplicate custom_id {cid!r} (first used by row {earlier}): give every request a unique custom_id"
            )
    return keep, extra


def fetch_rows(
    rows: RowIndex, row_ids: np.ndarray, drop: tuple[str, ...] = (TOKENS,), columns: tuple[str, ...] | None = None
) -> pa.Table:
    """Pull the given rows, in the given order, from the blocks in the object store.

    Only blocks that hold at least one of the rows are fetched; the token column is dropped
    (the plan's groups carry the tokens the engine needs). columns: keep only these instead.
    """
    import ray

    row_ids = np.asarray(row_ids, dtype=np.int64)
    if len(row_ids) == 0:
        return pa.table({})
    blocks, local = rows.locate(row_ids)
    parts, order = [], []
    for b in np.unique(blocks):
        mine = np.flatnonzero(blocks == b)
        block = ray.get(rows.block_refs[int(b)])
        block = (
            block.select(list(columns))
            if columns is not None
            else block.drop_columns([c for c in drop if c in block.column_names])
        )
        parts.append(block.take(pa.array(local[mine])))
        order.append(mine)
    table = pa.concat_tables(parts, promote_options="permissive")
    # Rows came grouped by block: put them back in the requested order.
    return table.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))
