"""The plan stage is shuffle-free: the executed datasets contain no all-to-all operator
(shuffle, sort, repartition, aggregate, join), only per-row metadata reaches the planner, and
the engines' input is the plan's units, each fetching its own rows."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import ray

from prefixflow.jobs.demo import demo_rows
from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.faces.processor import Processor
from prefixflow.operators.stages.plan import _block_meta, fetch_rows, plan_dataset, unit_payload_refs
from prefixflow.operators.stages.read import ReadOptions, read_dataset

ALL_TO_ALL_WORDS = ("Shuffle", "Sort", "Repartition", "Aggregate", "GroupBy", "Join", "Zip")


def _operators(ds) -> list:
    return list(ds._logical_plan.dag.post_order_iter())


def _assert_no_all_to_all(ds) -> None:
    from ray.data._internal.logical.operators.all_to_all_operator import AbstractAllToAll
    from ray.data._internal.logical.operators.n_ary_operator import NAry

    ops = _operators(ds)
    assert ops, "no operators found"
    bad = [op.name for op in ops if isinstance(op, (AbstractAllToAll, NAry))]
    assert not bad, bad
    assert not [w for w in ALL_TO_ALL_WORDS if any(w in op.name for op in ops)]


def test_plan_stage_moves_no_full_rows(ray_local, tiny_model, tmp_path):
    rows = demo_rows(num_docs=3, questions_per_doc=4, seed=3)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = Processor(
        ProcessorConfig(
            model=str(tiny_model),
            prompt={"template": "{{ document }} Q: {{ question }}"},
            replicas=2,
            engine={"device": "cpu"},
        )
    )
    tokenized = processor.tokenize(read_dataset(ReadOptions(path=str(path), format="jsonl")))
    planned = plan_dataset(tokenized, order="batchllm", num_replicas=2)  # executes `tokenized`
    _assert_no_all_to_all(tokenized)
    executed = tokenized.stats()
    assert "tokenize_batch" in executed and not [w for w in ALL_TO_ALL_WORDS if w in executed]

    # What the planner received per block: ints only (ids, lengths), no row text, no token ids
    # (those stay in the blocks, with their KV-block hashes beside them).
    block = ray.get(planned.rows.block_refs[0])
    meta = _block_meta(block, custom_ids=False)
    assert set(meta) == {"num_rows", "good", "lengths", "max_tokens", "digest"}  # digest: 32 bytes
    assert all(isinstance(v, int) or np.issubdtype(v.dtype, np.integer) for v in meta.values())
    text_bytes = sum(len(r["document"]) + len(r["question"]) for r in rows)
    meta_bytes = sum(v.nbytes for v in meta.values() if isinstance(v, np.ndarray))
    assert block.column("document").nbytes > 0 and meta_bytes < 4 * text_bytes

    # The engines take plan units, each one's rows fetched from the blocks where they lie.
    payloads = unit_payload_refs(planned, 2)
    units = [ray.get(ref) for refs in payloads for ref in refs]
    assert sorted(r for u in units for r in u.unit.row_ids.tolist()) == list(range(len(rows)))
    assert all(u.rows.num_rows == len(u.unit.row_ids) for u in units)
    assert planned.plan.summary["num_rows"] == len(rows) and len(planned.error_row_ids) == 0

    # A replica's rows, pulled from the object store in plan order.
    for r in range(2):
        ids = planned.plan.replica_table(r).column("row_id").to_numpy()
        pulled = fetch_rows(planned.rows, ids)
        assert pulled.num_rows == len(ids) and "_pf_tokens" not in pulled.column_names
        expected = [rows[i]["id"] for i in ids]  # row ids are input positions (order kept)
        assert pulled.column("id").to_pylist() == expected


def test_fetch_rows_across_blocks(ray_local):
    refs = [ray.put(pa.table({"x": [0, 1, 2]})), ray.put(pa.table({"x": [3, 4]}))]
    from prefixflow.operators.stages.plan import RowIndex

    index = RowIndex(tuple(refs), np.array([0, 3, 5]))
    assert fetch_rows(index, np.array([4, 0, 3, 2])).column("x").to_pylist() == [4, 0, 3, 2]


def test_read_csv_parquet_and_limit(ray_local, tmp_path):
    import pyarrow.parquet as pq

    from prefixflow.operators.stages.read import ReadOptions, read_dataset

    (tmp_path / "a.csv").write_text("q,n\nhello,1\nbad,row,extra\nbye,2\n")
    rows = read_dataset(ReadOptions(path=str(tmp_path / "a.csv"), format="csv")).take_all()
    assert sorted(str(r["q"]) for r in rows if r["_pf_error"] is None) == ["bye", "hello"]
    assert sum(r["_pf_error"] is not None for r in rows) == 1
    pq.write_table(pa.table({"q": ["x", "y", "z"]}), tmp_path / "b.parquet")
    got = read_dataset(ReadOptions(path=str(tmp_path / "b.parquet"), format="parquet", limit=2)).take_all()
    assert len(got) == 2 and all(r["_pf_error"] is None for r in got)


def test_each_rows_own_max_tokens_is_the_plans_output_length(ray_local, tiny_model, tmp_path):
    """Rows that set their own max_tokens are planned (balanced across replicas) for that
    output; the others for the job's default."""
    rows = [{"q": f"question {i}", "sampling_params": {"max_tokens": 8 + 30 * i}} for i in range(4)]
    rows.append({"q": "no override"})
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = Processor(
        ProcessorConfig(
            model=str(tiny_model),
            prompt={"template": "Q: {{ q }}"},
            sampling={"max_tokens": 50},
            replicas=2,
            engine={"device": "cpu"},
        )
    )
    planned = processor.plan(read_dataset(ReadOptions(path=str(path), format="jsonl")))
    table = planned.plan.table
    lens = dict(zip(table.column("row_id").to_pylist(), table.column("output_len").to_pylist()))
    assert lens == {0: 8, 1: 38, 2: 68, 3: 98, 4: 50}
