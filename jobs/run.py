"""Run a job spec: read -> tokenize -> plan -> generate -> write, on the Ray cluster at hand.

    prefixflow run job.yaml [--dry-run]      (or: python -m prefixflow.jobs.run job.yaml)

This and the CLI are the only places that call ray.init: with RAY_ADDRESS set (as under
`ray job submit`) it joins that cluster, otherwise it starts a local one.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from prefixflow.jobs import report
from prefixflow.jobs.spec import JobSpec, SpecError
from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.read import ReadOptions
from prefixflow.operators.storage import StorageOptions, absolute, is_s3, join, list_input_files
from prefixflow.operators.template import PromptTemplate
from prefixflow.operators.write import WriteOptions

def storage_options(spec: JobSpec) -> StorageOptions:
    return StorageOptions(**spec.storage.model_dump())


def processor_config(spec: JobSpec) -> ProcessorConfig:
    engine = {k: v for k, v in spec.engine.model_dump().items()}
    return ProcessorConfig(
        model=absolute(spec.model),
        prompt=PromptTemplate(**spec.prompt.model_dump()) if spec.prompt is not None else None,
        sampling=spec.sampling.model_dump(),
        engine=engine, order=spec.order, replicas=spec.replicas,
        num_gpus_per_replica=spec.resources.num_gpus_per_replica,
        num_cpus_per_replica=spec.resources.num_cpus_per_replica,
        tokenize_concurrency=spec.tokenize.concurrency, tokenize_batch_size=spec.tokenize.batch_size,
        rows_per_chunk=spec.output.rows_per_part, include_prompt=spec.output.include_prompt,
        openai_batch=spec.input_format() == "openai")


def read_options(spec: JobSpec) -> ReadOptions:
    path = spec.input.path
    return ReadOptions(path=path if isinstance(path, str) else tuple(path),
                       format=spec.input_format(), storage=storage_options(spec),  # type: ignore[arg-type]
                       limit=spec.input.limit, min_tasks=2 * spec.tokenize.concurrency)


def write_options(spec: JobSpec) -> WriteOptions:
    return WriteOptions(path=absolute(spec.output.path), format=spec.output_format(),
                        storage=storage_options(spec), model_name=Path(spec.model).name,
                        created=int(time.time()))


def preflight(spec: JobSpec, source: str = "<spec>") -> None:
    """Checks that touch the outside world (model folder, input files), before any work."""
    problems = []
    model = Path(spec.model).expanduser()
    if is_s3(spec.model):
        problems.append(("model", f"{spec.model!r} is on S3: copy the model to a local or shared "
                         "path on the workers first (e.g. /mnt/models/NAME) and give that path"))
    elif not (model / "config.json").is_file():
        why = "does not exist" if not model.exists() else "has no config.json"
        problems.append(("model", f"{spec.model!r} {why}: give a Hugging Face model directory "
                         "(config.json, *.safetensors, tokenizer files)"))
    try:
        list_input_files(spec.input.path, storage_options(spec))
    except (ValueError, OSError) as e:
        problems.append(("input.path", str(e).removeprefix("input.path=")))
    if spec.output_format() == "openai" and spec.input_format() != "openai":
        problems.append(("output.format", "openai output needs input.format: openai (the lines "
                         "are keyed by the requests' custom_id): use parquet or jsonl"))
    if problems:
        raise SpecError(source, problems)


def ensure_ray(address: str | None = None) -> None:
    import os

    import ray

    if ray.is_initialized():
        return
    # A local start without the dashboard is quicker; with RAY_ADDRESS set we join that cluster.
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(include_dashboard=False, log_to_driver=True)


def run_job(spec: JobSpec, dry_run: bool = False, source: str = "<spec>", quiet: bool = False,
            address: str | None = None) -> dict[str, Any]:
    """Run (or only plan, with dry_run) a validated job; returns the metrics dict."""
    import ray

    from prefixflow.operators.processor import Processor
    from prefixflow.operators.read import read_dataset
    from prefixflow.operators.write import (MetricsSink, prepare_output, write_json, write_part)

    started = time.perf_counter()
    preflight(spec, source)
    config = processor_config(spec)
    wopts = write_options(spec)
    if not dry_run:
        prepare_output(wopts, spec.output.overwrite)
    ensure_ray(address)
    processor = Processor(config)
    planned = processor.plan(read_dataset(read_options(spec)))
    if not quiet:
        print(report.plan_text(planned), flush=True)
    if dry_run:
        return report.dry_run_result(planned, time.perf_counter() - started)
    sink = ray.remote(MetricsSink).options(num_cpus=0).remote()
    outputs = processor.generate(planned, sink).map_batches(
        write_part, fn_kwargs={"opts": wopts}, batch_size=None, batch_format="pyarrow", num_cpus=0)
    gen_started = time.perf_counter()
    progress = report.Progress(total_rows=planned.rows.num_rows, quiet=quiet)
    manifests = []
    for m in outputs.iter_rows():
        manifests.append(m)
        progress.update(m)
    progress.close()
    metrics = report.metrics(spec, planned, manifests, ray.get(sink.get.remote()),
                             wall_s=time.perf_counter() - started,
                             generate_s=time.perf_counter() - gen_started)
    write_json(join(wopts.path, "metrics.json"), metrics, wopts.storage)
    write_json(join(wopts.path, "_SUCCESS"), {}, wopts.storage)
    if not quiet:
        print(report.metrics_text(metrics, wopts.path), flush=True)
    return metrics


def main(argv: list[str] | None = None) -> int:
    from prefixflow.cli import main as cli_main

    return cli_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
