"""Plan stage: the job's one global barrier, shuffle-free.

1. The tokenized dataset is materialized; its blocks stay in the object store (one ref each).
2. One small task per block returns only per-row metadata: token ids, lengths, the error flag
   (and custom_id for OpenAI input). Row ids are positions: block offset + index in block.
3. The driver builds the Plan (pipeline/, pure numpy) from that metadata.
4. Each replica later pulls the blocks holding its rows straight from the object store
   (operators/generate.py). No groupby, sort or shuffle ever moves full rows.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prefixflow.operators.read import ERROR
from prefixflow.operators.tokenize import TOKENS

MAX_TOKENS = "_pf_max_tokens"  # per-row max_tokens (OpenAI body), used as the output-length hint


@dataclass(frozen=True)
class RowIndex:
    """Where rows live: block refs in the object store and each block's first row id."""

    block_refs: tuple[Any, ...]
    block_offsets: np.ndarray  # [num_blocks + 1] int64; block b holds rows offsets[b]..offsets[b+1]

    @property
    def num_rows(self) -> int:
        return int(self.block_offsets[-1])

    def locate(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block index, index within block) of each row id."""
        blocks = np.searchsorted(self.block_offsets, row_ids, side="right") - 1
        return blocks, row_ids - self.block_offsets[blocks]


@dataclass(frozen=True)
class PlannedJob:
    """The Plan plus where the rows are, and which rows are error records."""

    plan: Any                   # prefixflow.pipeline.Plan over the good rows
    rows: RowIndex
    error_row_ids: np.ndarray   # rows that become error records without running
    extra_errors: dict[int, str] = field(default_factory=dict)  # row id -> error found here
    timings: dict[str, float] = field(default_factory=dict)
    content_digest: str = ""    # sha256 over every row's columns but the tokens, in row order


def _block_meta(block: pa.Table, custom_ids: bool) -> dict[str, Any]:
    """Only the metadata the planner needs, and a digest of the block; runs next to the block."""
    if TOKENS not in block.column_names:
        # An empty input leaves blocks without rows (and without our columns): nothing to plan.
        if block.num_rows:
            raise RuntimeError(f"a tokenized block of {block.num_rows} rows has no {TOKENS} column")
        return {"num_rows": 0, "good": np.zeros(0, np.int64), "lengths": np.zeros(0, np.int64),
                "flat": np.zeros(0, np.int32), "digest": _block_digest(block)}
    errors = block.column(ERROR).is_valid().to_numpy(zero_copy_only=False)
    good = np.flatnonzero(~errors)
    tokens = block.column(TOKENS).take(pa.array(good)).combine_chunks() if len(good) else None
    meta = {
        "num_rows": block.num_rows,
        "good": good,
        "lengths": np.zeros(0, np.int64) if tokens is None else
        pc.list_value_length(tokens).to_numpy(zero_copy_only=False).astype(np.int64),
        "flat": np.zeros(0, np.int32) if tokens is None else
        tokens.flatten().to_numpy(zero_copy_only=False).astype(np.int32),
        "digest": _block_digest(block),
    }
    if MAX_TOKENS in block.column_names:
        # Most OpenAI bodies omit max_tokens: null -> -1, "unknown" to the planner (plan_dataset).
        col = block.column(MAX_TOKENS).cast(pa.int64()).take(pa.array(good))
        meta["max_tokens"] = pc.fill_null(col, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    if custom_ids and "custom_id" in block.column_names:
        meta["custom_id"] = block.column("custom_id").take(pa.array(good)).to_pylist()
    return meta


def _block_digest(block: pa.Table) -> np.ndarray:
    """sha256 of every column the output carries (the token column derives from them), so that
    a resume notices an input whose prompts are the same but another column changed."""
    table = block.drop_columns([c for c in (TOKENS,) if c in block.column_names]).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return np.frombuffer(hashlib.sha256(sink.getvalue()).digest(), np.uint8)


def _gather_meta(refs: list[Any], custom_ids: bool) -> list[dict[str, Any]]:
    """Block metadata: read in place for blocks on this node (shared memory, zero-copy), by a
    small task on the block's own node otherwise. Only the metadata crosses the network."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    try:
        where = ray.experimental.get_object_locations(refs)
    except Exception:  # locations are an optimisation only
        where = {}
    task = ray.remote(_block_meta).options(num_cpus=0.25)
    pending: dict[int, Any] = {}
    metas: list[Any] = [None] * len(refs)
    for i, ref in enumerate(refs):
        nodes = (where.get(ref) or {}).get("node_ids") or []
        if here in nodes or not nodes:
            metas[i] = _block_meta(ray.get(ref), custom_ids)
        else:
            strategy = NodeAffinitySchedulingStrategy(node_id=nodes[0], soft=True)
            pending[i] = task.options(scheduling_strategy=strategy).remote(ref, custom_ids)
    for i, meta in zip(pending, ray.get(list(pending.values()))):
        metas[i] = meta
    return metas


def plan_dataset(ds: Any, *, order: str, num_replicas: int, custom_ids: bool = False,
                 default_max_tokens: int | None = None) -> PlannedJob:
    """Materialize the tokenized dataset `ds` and plan its good rows (see the module doc).

    default_max_tokens: the output-length hint of rows whose own max_tokens is null (the job's
    sampling default, which they run with); None leaves them unknown (estimated per subtree).
    """
    import ray

    from prefixflow.pipeline import RaggedTokens, build_plan

    t0 = time.perf_counter()
    refs = ds.to_arrow_refs()  # executes read + tokenize; blocks stay in the object store
    t1 = time.perf_counter()
    metas = _gather_meta(refs, custom_ids)
    offsets = np.r_[0, np.cumsum([m["num_rows"] for m in metas])].astype(np.int64)
    good_ids = np.concatenate([offsets[b] + m["good"] for b, m in enumerate(metas)] or
                              [np.zeros(0, np.int64)]).astype(np.int64)
    lengths = np.concatenate([m["lengths"] for m in metas] or [np.zeros(0, np.int64)])
    flat = np.concatenate([m["flat"] for m in metas] or [np.zeros(0, np.int32)])
    extra: dict[int, str] = {}
    keep = np.ones(len(good_ids), bool)
    if custom_ids:
        keep, extra = _duplicate_custom_ids(good_ids, [c for m in metas for c in m.get("custom_id", [])])
    out_lens = None
    with_rows = [m for m in metas if len(m["good"])]
    if with_rows and all("max_tokens" in m for m in with_rows):
        out_lens = np.concatenate([m["max_tokens"] for m in with_rows]).astype(np.int64)
        if default_max_tokens is not None:
            out_lens[out_lens < 0] = default_max_tokens
    tokens = RaggedTokens(flat, np.r_[0, np.cumsum(lengths)].astype(np.int64))
    if not keep.all():
        sel = np.flatnonzero(keep)
        tokens = RaggedTokens.from_sequences([tokens[i] for i in sel])
        good_ids = good_ids[sel]
        out_lens = None if out_lens is None else out_lens[sel]
    t2 = time.perf_counter()
    plan = build_plan(tokens, row_ids=good_ids, output_lens=out_lens, order=order,
                      num_replicas=num_replicas)
    t3 = time.perf_counter()
    all_ids = np.arange(offsets[-1], dtype=np.int64)
    error_ids = np.setdiff1d(all_ids, good_ids, assume_unique=True)
    timings = {"read_tokenize_s": t1 - t0, "gather_s": t2 - t1, "build_plan_s": t3 - t2}
    digest = hashlib.sha256(b"".join(m["digest"].tobytes() for m in metas)).hexdigest()  # block order
    return PlannedJob(plan, RowIndex(tuple(refs), offsets), error_ids, extra, timings, digest)


def _duplicate_custom_ids(row_ids: np.ndarray, custom_ids: list[Any]) -> tuple[np.ndarray, dict[int, str]]:
    """OpenAI batch custom_ids must be unique: later duplicates become error records."""
    keep = np.ones(len(row_ids), bool)
    extra: dict[int, str] = {}
    first: dict[Any, int] = {}
    for i, cid in enumerate(custom_ids):
        if cid in first:
            keep[i] = False
            extra[int(row_ids[i])] = (f"duplicate custom_id {cid!r} (first used by row "
                                      f"{first[cid]}): give every request a unique custom_id")
        else:
            first[cid] = int(row_ids[i])
    return keep, extra


def fetch_rows(rows: RowIndex, row_ids: np.ndarray, drop: tuple[str, ...] = (TOKENS,)) -> pa.Table:
    """Pull the given rows, in the given order, from the blocks in the object store.

    Only blocks that hold at least one of the rows are fetched; the token column is dropped
    (the plan's groups carry the tokens the engine needs).
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
        block = block.drop_columns([c for c in drop if c in block.column_names])
        parts.append(block.take(pa.array(local[mine])))
        order.append(mine)
    table = pa.concat_tables(parts, promote_options="permissive")
    # Rows came grouped by block: put them back in the requested order.
    return table.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))
