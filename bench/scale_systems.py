"""One run of one system in scale_bench: a driver process on the test cluster (RAY_ADDRESS).

    prefixflow_native / prefixflow_vllm   a prefixflow job (engine.backend native / vllm), its
        engines taking plan units from one work queue (work stealing); *_static: the same with
        work_stealing off (each replica runs its own partition), for the ablation; *_unjoined:
        engines that steal, over the static plan's pieces (build_plan stealing=False: a group's
        small pieces stay where the balance put them), against the plan a stealing job gets;
    ray_llm_sorted_default / ray_llm_sorted_ours   ray.data.llm as a careful user sets it up:
        the rows tokenized the same way inside its pipeline (a map_batches stage, as many
        actors as prefixflow's tokenizer), sorted on the prompt text, repartitioned into enough
        blocks (at least 4 x engines x tasks in flight, so no engine takes a large share at
        once), a fixed pool of engines (concurrency (N, N)), every engine argument ours (block
        size, KV cache blocks, max_num_batched_tokens, prefix caching, one CPU slot), Ray Data's
        defaults otherwise (batch_size 32, 8 concurrent batches, 16 tasks in flight, no wait
        for the pool); "default" keeps vLLM's max_num_seqs, "ours" sets prefixflow's vLLM
        backend's (no cap: max_num_batched_tokens). The bench keeps Ray's faster one per cell.

Each run returns a record: wall time; start-up parts (engine ready per engine, read + tokenize
+ plan or sort); per engine its node, rows, computed prompt tokens, busy time (first request in
to last out), preemptions where known; threads; the load average; every row's output tokens.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixflow.bench.record import covered_length
from prefixflow.bench.scale_workload import BLOCK, KV_CACHE_BYTES, SYSTEM, USER, chat_tokens

if TYPE_CHECKING:
    from prefixflow.jobs.spec import JobSpec

RAY_SYSTEMS = ("ray_llm_sorted_default", "ray_llm_sorted_ours")
PREFIXFLOW_SYSTEMS = (
    "prefixflow_native",
    "prefixflow_vllm",
    "prefixflow_native_static",
    "prefixflow_vllm_static",
    "prefixflow_native_unjoined",
    "prefixflow_vllm_unjoined",
)
MAX_NUM_BATCHED_TOKENS = 2048  # prefixflow's EngineConfig default, given to every engine
RAY_TASKS_IN_FLIGHT = 16  # Ray Data's default: 2 x max_concurrent_batches (8)
# vLLM's max_num_seqs where ray.data.llm starts it (AsyncLLM, engine context) and none is given:
# SchedulerConfig.DEFAULT_MAX_NUM_SEQS in vLLM 0.32 (its CPU defaults cover other contexts only).
VLLM_DEFAULT_MAX_NUM_SEQS = 128


def run_one(system: str, replicas: int, data: Path, model: Path, out: Path) -> dict[str, Any]:
    """Run `system` with `replicas` engines on the cluster at RAY_ADDRESS; returns its record."""
    t0 = time.time()
    if system.startswith("prefixflow"):
        record = _run_prefixflow(system, replicas, data, model, out, t0)
    else:
        record = _run_ray_llm(system, replicas, data, model, t0)
    record = with_idle_engines(record, replicas)
    record["wall_s"] = time.time() - t0
    # Start-up excluded: from the first engine's first request to the last row (conservative
    # for a system whose engines start one after another, as prefixflow's do today).
    record["wall_from_first_request_s"] = record["wall_s"] - min(record["first_request_s"])
    record["wall_from_last_engine_start_s"] = record["wall_s"] - max(record["first_request_s"])
    record["load_average"] = os.getloadavg()
    return record


PER_ENGINE = (
    "rows_per_engine",
    "computed_per_engine",
    "engine_busy_s",
    "engine_end_s",
    "nodes",
    "units_per_engine",
    "stolen_units_per_engine",
    "preemptions_per_engine",
)


def with_idle_engines(record: dict[str, Any], replicas: int) -> dict[str, Any]:
    """Every engine the run started, those that ran no row included (Ray Data handed them no
    task; prefixflow stopped one still loading when the work ran out): 0 rows, 0 busy seconds,
    no end. Their idle time is part of the balance."""
    missing = replicas - record["engines"]
    for key in PER_ENGINE:
        if isinstance(record.get(key), list) and missing > 0:
            idle = None if key in ("engine_end_s", "nodes", "units_per_engine") else 0
            record[key] = record[key] + [idle] * missing
    record["engines_started"] = replicas
    return record


def _run_prefixflow(system: str, replicas: int, data: Path, model: Path, out: Path, t0: float) -> dict[str, Any]:
    from prefixflow.jobs.run import run_job
    from prefixflow.operators.results.write import read_output

    spec = _prefixflow_spec(system, replicas, data, model, out)
    if system.endswith("_unjoined"):  # the ablation: this driver process plans as a static job does
        from prefixflow.operators.faces.processor import Processor

        plan = Processor.plan
        Processor.plan = (  # type: ignore[method-assign]  # a deliberate patch (its type is still checked)
            lambda self, ds, stealing=False: plan(self, ds, stealing=False)
        )
    metrics = run_job(spec, quiet=True)
    table = read_output(str(out))
    assert not isinstance(table, list), "the job writes parquet, read back as a table"
    return _prefixflow_record(system, replicas, model, metrics, table.to_pylist(), t0)


def _prefixflow_spec(system: str, replicas: int, data: Path, model: Path, out: Path) -> JobSpec:
    """The job spec of a prefixflow system: its backend, and work stealing unless *_static."""
    from prefixflow.jobs.spec import parse_spec

    backend = "vllm" if "vllm" in system else "native"
    return parse_spec(
        {
            "name": f"scale-{system}-{replicas}",
            "model": str(model),
            "input": {"path": str(data)},
            "prompt": {"system": SYSTEM, "user": USER},
            "sampling": {"temperature": 0},
            "engine": {
                "backend": backend,
                "device": "cpu",
                "dtype": "float32",
                "block_size": BLOCK,
                "kv_cache_bytes": KV_CACHE_BYTES,
                "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            },
            "replicas": replicas,
            "order": "batchllm",
            "work_stealing": not system.endswith("_static"),
            "output": {"path": str(out), "format": "parquet", "rows_per_part": 256, "overwrite": True},
        }
    )


def _prefixflow_record(
    system: str, replicas: int, model: Path, metrics: dict[str, Any], rows: list[dict[str, Any]], t0: float
) -> dict[str, Any]:
    """The run's record from the job's metrics (per replica, stages, steals) and its output rows."""
    from prefixflow.engine.models.model_args import read_model_args

    per = sorted(metrics["per_replica"], key=lambda r: r["replica"])
    totals = [r["engine_totals"] or {} for r in per]
    stages = metrics["stage_seconds"]
    steals = metrics["fault_tolerance"].get("work_queue", {}).get("steals", [])
    return {
        "system": system,
        "replicas": replicas,
        "engines": len(per),
        "computed_prompt_tokens": sum(t.get("num_computed_prompt_tokens", 0) for t in totals),
        "prompt_tokens": sum(r["num_input_tokens"] for r in rows),
        "kv_bytes_per_token": read_model_args(str(model)).kv_bytes_per_token_per_elem * 4,
        "rows_per_engine": [r["num_rows"] for r in per],
        "units_per_engine": [r.get("num_units") for r in per],
        "stolen_units_per_engine": [len(r.get("stolen_units") or []) for r in per],
        "steals": len(steals),
        "computed_per_engine": [t.get("num_computed_prompt_tokens", 0) for t in totals],
        # What the plan expected each replica to compute before stealing moved units: the
        # difference from computed_per_engine is what stealing and the engine's cache cost.
        "planned_computed_per_replica": [r["computed_prompt_tokens"] for r in metrics["plan"]["replicas"]],
        "steal_log": [
            {k: s[k] for k in ("unit", "from", "to", "seconds", "at_s", "shared_tokens_again")} for s in steals
        ],
        "preemptions_per_engine": [t.get("num_preemptions", 0) for t in totals],
        "engine_busy_s": [r["run_seconds"] for r in per],
        "engine_end_s": [r["end_s"] - t0 for r in per],
        "nodes": [r.get("node_id") for r in per],
        "first_request_s": [r["engine_ready_s"] - t0 for r in per],
        "startup": {
            "engine_ready_s": [r["engine_ready_s"] - t0 for r in per],
            "read_tokenize_s": stages["read_tokenize_s"],
            "plan_s": stages["gather_s"] + stages["build_plan_s"],
        },
        "threads": {"num_cpus_per_replica": 1, "torch_threads": "1 (Ray's OMP_NUM_THREADS for 1 CPU)"},
        "outputs": {int(r["id"]): [int(t) for t in r["generated_tokens"]] for r in rows},
    }


class ChatTokenize:
    """The careful ray.data.llm user's tokenize stage: the model's chat template, tokenized as
    prefixflow tokenizes chat prompts (scale_workload.chat_tokens), inside the pipeline."""

    def __init__(self, model: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        texts, ids = [], []
        for document, question in zip(batch["document"], batch["question"]):
            text, tokens = chat_tokens(self.tokenizer, {"document": document, "question": question})
            texts.append(text)
            ids.append(tokens)
        return {
            "id": batch["id"],
            "sampling_params": batch["sampling_params"],
            "prompt_text": texts,
            "tokenized_prompt": ids,
        }


def ray_num_blocks(num_rows: int, replicas: int, batch_size: int) -> int:
    """Blocks after the sort: at least 4 x engines x tasks in flight, and a batch's rows each."""
    return max(4 * replicas * RAY_TASKS_IN_FLIGHT, -(-num_rows // batch_size))


def _run_ray_llm(system: str, replicas: int, data: Path, model: Path, t0: float) -> dict[str, Any]:
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from prefixflow.engine.models.model_args import read_model_args

    margs = read_model_args(str(model))
    blocks = KV_CACHE_BYTES // (BLOCK * margs.kv_bytes_per_token_per_elem * 4)
    engine_kwargs = dict(
        dtype="float32",
        block_size=BLOCK,
        num_gpu_blocks_override=blocks,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        enable_prefix_caching=True,
        max_model_len=margs.max_position_embeddings,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )
    if system.endswith("_ours"):
        engine_kwargs["max_num_seqs"] = MAX_NUM_BATCHED_TOKENS  # prefixflow's vLLM backend: no cap
    config = vLLMEngineProcessorConfig(
        model_source=str(model),
        concurrency=(replicas, replicas),
        chat_template_stage=False,
        tokenize_stage=False,
        engine_kwargs=engine_kwargs,
        placement_group_config={"bundles": [{"CPU": 1}]},
        log_engine_metrics=False,
        runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}},
    )
    processor = build_processor(
        config,
        preprocess=lambda r: dict(
            id=r["id"], tokenized_prompt=r["tokenized_prompt"], sampling_params=r["sampling_params"]
        ),
        postprocess=lambda r: dict(
            id=r["id"],
            generated_tokens=[int(t) for t in r["generated_tokens"]],
            num_input_tokens=r["num_input_tokens"],
            batch_uuid=r.get("batch_uuid"),
            **_engine_fields(r),
        ),
    )
    num_rows = sum(1 for _ in open(data))
    num_blocks = ray_num_blocks(num_rows, replicas, config.batch_size)
    ds = ray.data.read_json(str(data)).map_batches(
        ChatTokenize, fn_constructor_kwargs={"model": str(model)}, concurrency=1, batch_size=256
    )
    ds = ds.sort("prompt_text").repartition(num_blocks)
    with record_dispatch() as logged:
        rows = processor(ds).take_all()
    record = _ray_record(system, replicas, rows, config, engine_kwargs, num_blocks, blocks, t0)
    handed_out = [e for e in logged if "event" not in e]
    return {
        **record,
        **task_handouts(rows, record["row_batch"], record["batch_rows"], handed_out, t0),
        **pool_view(rows, record, [e for e in logged if "event" in e], t0),
    }


def _ray_record(
    system: str,
    replicas: int,
    rows: list[dict[str, Any]],
    config: Any,
    engine_kwargs: dict,
    num_blocks: int,
    gpu_blocks: int,
    t0: float,
) -> dict[str, Any]:
    """The run's record from its output rows (the setup hook's per-request engine fields)."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_pid.setdefault(r["pid"], []).append(r)
    pids = sorted(by_pid, key=lambda p: min(r["arrival_time"] for r in by_pid[p]))
    engines = [by_pid[p] for p in pids]
    # Ray's sort and repartition (no shuffle) cut the sorted rows into equal blocks, in order.
    order = sorted(rows, key=lambda r: r["prompt_text"]) if rows and "prompt_text" in rows[0] else None
    batches: dict[str, int] = {}  # each task (one engine call, its batch_uuid), by its first request
    # ... and its first request: when it began on its engine, not when Ray handed it out. An
    # engine holds up to 16 tasks but runs max_concurrent_batches (8) at once, and Ray's stage
    # lets ceil(1.1 x max_num_seqs) requests into vLLM (max_pending_requests: at vLLM's default
    # 128, about 4 tasks); a task held back begins as earlier rows finish.
    began: list[float] = []
    for r in sorted(rows, key=lambda r: r["arrival_time"]):
        if r["batch_uuid"] not in batches:
            batches[r["batch_uuid"]] = len(batches)
            began.append(r["arrival_time"] - t0)
    # ... and when its last row finished: the task's end as its engine ran it (Ray frees the
    # actor's slot once the stage has returned the rows), what the dispatch model predicts
    finished = [0.0] * len(batches)
    for r in rows:
        b = batches[r["batch_uuid"]]
        finished[b] = max(finished[b], r["finished_at"] - t0)
    startup = _ray_startup(engines, t0)
    return {
        "system": system,
        "replicas": replicas,
        "engines": len(engines),
        "num_blocks": num_blocks,
        "batch_size": config.batch_size,
        "max_concurrent_batches": config.max_concurrent_batches,
        "max_tasks_in_flight_per_actor": RAY_TASKS_IN_FLIGHT,
        "max_num_seqs": engine_kwargs.get("max_num_seqs", VLLM_DEFAULT_MAX_NUM_SEQS),
        "num_gpu_blocks": gpu_blocks,
        "engine_kwargs": engine_kwargs,
        "computed_prompt_tokens": sum(r["num_input_tokens"] - r["num_cached_tokens"] for r in rows),
        "prompt_tokens": sum(r["num_input_tokens"] for r in rows),
        "rows_per_engine": [len(rs) for rs in engines],
        "computed_per_engine": [sum(r["num_input_tokens"] - r["num_cached_tokens"] for r in rs) for rs in engines],
        "preemptions_per_engine": None,  # ray.data.llm's rows do not carry them
        "engine_busy_s": [max(r["finished_at"] for r in rs) - min(r["arrival_time"] for r in rs) for rs in engines],
        "engine_end_s": [max(r["finished_at"] for r in rs) - t0 for rs in engines],
        # Busy with requests present (first request to last row, less the gaps with none in the
        # engine): its pace is its work over this, where engine_busy_s also counts waits for data.
        "engine_active_s": [covered_length([(r["arrival_time"], r["finished_at"]) for r in rs]) for rs in engines],
        "nodes": [rs[0]["node_id"] for rs in engines],
        "first_request_s": startup["engine_first_request_s"],
        "startup": startup,
        "threads": {"num_cpus_per_replica": 1, "omp_num_threads": sorted({r["omp_threads"] for r in rows})},
        "row_engine": {int(r["id"]): pids.index(r["pid"]) for r in rows},
        "row_batch": {int(r["id"]): batches[r["batch_uuid"]] for r in rows},
        "batch_rows": [sum(1 for r in rows if batches[r["batch_uuid"]] == b) for b in range(len(batches))],
        # When each task began on its engine (see began): the engines' first tasks show
        # how fast the sorted blocks came in, the others when the engine made room for them.
        "batch_first_request_s": began,
        "batch_finished_s": finished,
        "sorted_row_ids": [int(r["id"]) for r in order] if order else None,
        "outputs": {int(r["id"]): r["generated_tokens"] for r in rows},
    }


def task_handouts(
    rows: list[dict[str, Any]],
    row_batch: dict[int, int],
    batch_rows: list[int],
    handed_out: list[dict[str, Any]],
    t0: float,
) -> dict[str, Any]:
    """When Ray Data handed each task to its engine actor and when the task's blocks had reached
    the engine stage (the driver's log, record_dispatch), per task in row_batch's numbering
    (batch_rows: each task's rows; None where the log cannot be matched). The log does not name
    tasks: an actor's k-th hand-out is taken as the k-th task that started on it. Ray may start a threaded actor's tasks
    (max_concurrency 8 here) out of order, so two tasks handed to one actor milliseconds apart can
    be swapped; a match that puts a hand-out after the start of its task is refused (the bench's
    nodes share one clock)."""
    unmatched = {
        "dispatch_log_matched": False,
        "batch_handout_s": None,
        "batch_arrive_s": None,
        "batch_data_node": None,
        "batch_data_nodes": None,
    }
    if any(r.get("actor_id") is None or r.get("task_started_at") is None for r in rows):
        return unmatched  # a run recorded before these fields
    started: dict[int, tuple[str, float]] = {}  # task -> (its actor, when it started there)
    for r in rows:
        started.setdefault(row_batch[int(r["id"])], (r["actor_id"], r["task_started_at"]))
    by_actor: dict[str, list[tuple[float, int]]] = {}
    for task, (actor, at) in started.items():
        by_actor.setdefault(actor, []).append((at, task))
    handout: list[float | None] = [None] * len(started)
    arrive: list[float | None] = [None] * len(started)
    data_node: list[str | None] = [None] * len(started)  # the node holding most of its blocks' bytes
    data_nodes: list[list[str] | None] = [None] * len(started)  # every node holding some, by bytes
    matched = sum(len(v) for v in by_actor.values()) == len(handed_out)
    for actor, tasks in by_actor.items():
        given = sorted((e for e in handed_out if e["actor"] == actor), key=lambda e: e["at"])
        pairs = list(zip(sorted(tasks), given))
        matched = matched and len(given) == len(tasks) and all(batch_rows[t] == e["rows"] for (_, t), e in pairs)
        matched = matched and all(e["at"] <= at for (at, _), e in pairs)
        for (_, task), e in pairs:
            handout[task] = e["at"] - t0
            arrive[task] = None if e["arrived_at"] is None else e["arrived_at"] - t0
            nodes = e.get("data_nodes")
            data_node[task], data_nodes[task] = (nodes[0] if nodes else None), nodes
    return (
        {
            "dispatch_log_matched": True,
            "batch_handout_s": handout,
            "batch_arrive_s": arrive,
            "batch_data_node": data_node,
            "batch_data_nodes": data_nodes,
        }
        if matched
        else unmatched
    )


def pool_view(rows: list[dict[str, Any]], record: dict[str, Any], events: list[dict[str, Any]], t0: float) -> dict:
    """What Ray Data's actor pool saw, from the driver's log (record_dispatch's pool events):
    when it made each engine's actor pickable (`engine_running_s`, engine order; it learns that an
    actor is up only between scheduling steps, after its engine was built), and when it freed each
    task's slot (`batch_freed_s`, task order; once the stage has returned the task's rows, after
    its last row finished in vLLM: batch_finished_s). The log names actors, not tasks: an actor's
    k-th slot freed is taken as its task whose last row finished k-th. None where the log does
    not fit the run's tasks."""
    engine_actor: dict[int, str] = {}  # engine number -> its actor
    for r in rows:
        engine_actor.setdefault(record["row_engine"][int(r["id"])], r["actor_id"])
    running = {e["actor"]: e["at"] - t0 for e in events if e["event"] == "running"}
    freed: dict[str, list[float]] = {}
    for e in sorted((e for e in events if e["event"] == "freed"), key=lambda e: e["at"]):
        freed.setdefault(e["actor"], []).append(e["at"] - t0)
    tasks: dict[str, set[int]] = {}
    for r in rows:
        tasks.setdefault(r["actor_id"], set()).add(record["row_batch"][int(r["id"])])
    batch_freed: list[float | None] = [None] * len(record["batch_finished_s"])
    for actor, mine in tasks.items():
        if len(freed.get(actor, [])) != len(mine):
            return {"engine_running_s": None, "batch_freed_s": None}
        for task, at in zip(sorted(mine, key=lambda t: record["batch_finished_s"][t]), freed[actor]):
            batch_freed[task] = at
    return {
        "engine_running_s": [running.get(engine_actor[e]) for e in sorted(engine_actor)],
        "batch_freed_s": batch_freed,
    }


def locality_order(where: dict[str, int]) -> list[str]:
    """The nodes holding a task's blocks (node -> bytes) in the order Ray Data 2.60's actor
    locality visits them for an actor with room (`_ActorPool._find_actor_with_locality`): most
    bytes first, ties by node id."""
    return sorted(where, key=lambda node: (-where[node], node))


@contextmanager
def record_dispatch(stage: str = "vLLMEngineStage") -> Iterator[list[dict[str, Any]]]:
    """Records, in this driver (where Ray Data's executor runs), each task Ray Data hands to an
    actor of the operator named `stage` inside the block: when, to which actor, its rows, and when
    the last of its blocks had reached that operator's input (an upstream operator's output
    queue). Yields the list it fills. Patches Ray Data 2.60's executor (OpState.add_output,
    MapOperator._submit_data_task) to read the time only, and puts both back when the block ends
    (so a second use in one process logs each task once)."""
    from ray.data._internal.execution.operators.actor_pool_map_operator import _ActorPool
    from ray.data._internal.execution.operators.map_operator import MapOperator
    from ray.data._internal.execution.streaming_executor_state import OpState

    arrived: dict[str, float] = {}  # block ref -> when an operator's output queue got it
    log: list[dict[str, Any]] = []
    add_output, submit = OpState.add_output, MapOperator._submit_data_task
    to_running, completed = _ActorPool.pending_to_running, _ActorPool.on_task_completed

    def logged_running(self: Any, ready_ref: Any) -> Any:
        actor = to_running(self, ready_ref)
        if actor is not None:
            log.append({"event": "running", "at": time.time(), "actor": actor._actor_id.hex()})
        return actor

    def logged_completed(self: Any, actor: Any) -> None:
        log.append({"event": "freed", "at": time.time(), "actor": actor._actor_id.hex()})
        completed(self, actor)

    def stamped_add_output(self: Any, ref: Any) -> None:
        now = time.time()
        for entry in ref.blocks:
            arrived[entry.ref.hex()] = now
        add_output(self, ref)

    def logged_submit(self: Any, gen: Any, inputs: Any, task_done_callback: Any = None) -> None:
        actor = getattr(task_done_callback, "keywords", {}).get("actor_to_return")
        if stage in self.name and actor is not None:
            stamps = [arrived[entry.ref.hex()] for entry in inputs.blocks if entry.ref.hex() in arrived]
            where = inputs.get_preferred_object_locations()  # node -> bytes, what Ray's locality reads
            log.append(
                {
                    "at": time.time(),
                    "actor": actor._actor_id.hex(),
                    "rows": inputs.num_rows(),
                    # None: a block that no operator's output queue stamped
                    "arrived_at": max(stamps) if len(stamps) == len(inputs.blocks) else None,
                    "data_nodes": locality_order(where),
                }
            )
        submit(self, gen, inputs, task_done_callback)

    OpState.add_output = stamped_add_output
    MapOperator._submit_data_task = logged_submit
    _ActorPool.pending_to_running, _ActorPool.on_task_completed = logged_running, logged_completed
    try:
        yield log
    finally:
        OpState.add_output, MapOperator._submit_data_task = add_output, submit
        _ActorPool.pending_to_running, _ActorPool.on_task_completed = to_running, completed


def _ray_startup(engines: list[list[dict[str, Any]]], t0: float) -> dict[str, Any]:
    """Each engine's start-up: its vLLM engine built, and its first request; between them it
    waited for its first block (read, tokenize and sort, which Ray runs while engines start)."""
    first = [min(r["arrival_time"] for r in rs) - t0 for rs in engines]
    ready = [rs[0].get("engine_ready_at") for rs in engines]
    return {
        "engine_ready_s": [None if at is None else at - t0 for at in ready],
        "engine_first_request_s": first,
        "waited_for_data_s": [None if at is None else f - (at - t0) for at, f in zip(ready, first)],
    }


def _engine_fields(row: dict[str, Any]) -> dict[str, Any]:
    m = row.get("metrics") or {}
    keys = (
        "num_cached_tokens",
        "finished_at",
        "pid",
        "arrival_time",
        "node_id",
        "omp_threads",
        "engine_ready_at",
        "actor_id",
        "task_started_at",
    )
    return {k: m.get(k) for k in keys}


def record_engine_fields() -> None:
    """A Ray worker setup hook for the ray.data.llm runs: each vLLM output row's `metrics` also
    gets the request's num_cached_tokens (prefix-cache hits), when it finished, which engine
    process, actor and node ran it, its OMP threads, when that process's engine was built (the stage
    builds its vLLM engine in its constructor: the start-up's "engine ready") and when its task
    started on the actor (the stage's `udf` called). Changes nothing else."""
    from ray.llm._internal.batch.stages import vllm_engine_stage as stage

    original = stage.vLLMOutputData.from_vllm_engine_output.__func__
    build_engine, run_task = stage.vLLMEngineStageUDF.__init__, stage.vLLMEngineStageUDF.udf
    ready: dict[str, float] = {}

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        build_engine(self, *args, **kwargs)
        ready["at"] = time.time()

    async def udf(self: Any, batch: list[dict[str, Any]]) -> Any:
        started = time.time()
        async for row in run_task(self, batch):
            if isinstance(row.get("metrics"), dict):
                row["metrics"] = {**row["metrics"], "task_started_at": started}
            yield row

    stage.vLLMEngineStageUDF.__init__ = init
    stage.vLLMEngineStageUDF.udf = udf

    def from_vllm_engine_output(cls: Any, output: Any) -> Any:
        import ray

        data = original(cls, output)
        data.metrics = {
            **(data.metrics or {}),
            "num_cached_tokens": output.num_cached_tokens or 0,
            "finished_at": time.time(),
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "engine_ready_at": ready.get("at"),
            "actor_id": ray.get_runtime_context().get_actor_id(),
        }
        return data

    stage.vLLMOutputData.from_vllm_engine_output = classmethod(from_vllm_engine_output)
