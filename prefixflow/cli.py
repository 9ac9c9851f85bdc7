"""The `prefixflow` command.

    prefixflow demo [DIR]             a real model (SmolLM2-135M) answers questions on 12 passages
    prefixflow run SPEC.yaml          run a job (--dry-run: plan only, no model loaded)
    prefixflow plan SPEC.yaml         print the plan (--out plan.parquet saves the plan table)
    prefixflow validate SPEC.yaml     check the spec and its paths; start nothing
    prefixflow prepare                this machine's one-time work: convert the packaged model,
                                      build the CPU kernels (`make install` runs it)

Exit codes: 0 ok (bad rows are error records in the output), 2 invalid spec, input, output
path or model, or storage that failed before generation (one line per problem; nothing
generated), 1 a job that started generating and stopped (engines that keep dying, storage that
keeps failing: one message; committed rows are kept for resume).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from prefixflow.paths import cache_root

VERBOSE_HELP = "show Ray's own log lines on the console (by default they go to a log file, named at the end)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixflow",
        description="Offline batch LLM inference that "
        "plans the whole job first (global prefix tree, grouped scheduling).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job spec")
    run.add_argument("spec")
    run.add_argument("--dry-run", action="store_true", help="print the plan; load no model")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec field, e.g. --set replicas=4 --set sampling.max_tokens=32",
    )
    run.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or local)")
    run.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    run.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    plan = sub.add_parser("plan", help="print a job's plan (no model is loaded)")
    plan.add_argument("spec")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--out", default=None, help="write the plan table (one row per prompt) as parquet")
    plan.add_argument("--address", default=None)
    plan.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    val = sub.add_parser("validate", help="check a spec and its paths without starting anything")
    val.add_argument("spec")
    val.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sub.add_parser(
        "prepare",
        help="do this machine's one-time work now: convert the packaged model, build the CPU kernels",
    )
    demo = sub.add_parser(
        "demo",
        help="run the demo job: SmolLM2-135M-Instruct answers questions about 12 passages (jobs/examples/demo.yaml)",
    )
    demo.add_argument("dir", nargs="?", default="demo_output")
    demo.add_argument("--plan-only", action="store_true", help="stop after printing the plan")
    demo.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _show_our_logs()
    # lazy: the job modules load pyarrow, pydantic and Ray's pieces; `prefixflow --help` needs none
    from prefixflow.jobs.spec import SpecError
    from prefixflow.operators.results.commit import JobFenced

    try:
        return _dispatch(args)
    except JobFenced as e:  # another job took the output path over: it finishes the rows
        print(f"error: the job stopped: {_message(e)}", file=sys.stderr)
        return 1
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # the job refused its input, output path or model: nothing was run
        print(f"error: {_message(e)}", file=sys.stderr)
        return 2
    except _job_failures() as e:
        if isinstance(e, OSError) and not _generating(e):  # nothing committed: nothing to resume
            print(f"error: {_message(e)} (before generation: no rows were committed)", file=sys.stderr)
            return 2
        # The job started generating and stopped; what it committed stays.
        print(
            f"error: the job stopped: {_message(e)}\nCommitted rows are kept: fix the cause "
            "and rerun with output.resume: true to finish the rest.",
            file=sys.stderr,
        )
        return 1


def _show_our_logs() -> None:
    """prefixflow's module loggers (one-time model copies and conversions) print on stderr at
    INFO; other libraries' loggers keep their own settings."""
    log = logging.getLogger("prefixflow")
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("prefixflow: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when a record is written, not the one it was
    made with: a process that calls main() again after replacing sys.stderr (a notebook's
    capture, a test's) would otherwise write into a closed stream."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _job_failures() -> tuple[type[BaseException], ...]:
    """Failures of a running job that deserve one message, not a traceback: engines that keep
    dying or are broken, storage that keeps failing, a lost node's data. Anything else is a bug:
    its traceback shows."""
    from ray.exceptions import ObjectLostError

    # lazy: the job modules load pyarrow, pydantic and Ray's pieces; `prefixflow --help` needs none
    from prefixflow.operators.stages.attempts import EnginesKeepDying
    from prefixflow.operators.stages.isolate import EngineBroken

    # ObjectLostError: a node lost with input blocks that no other node held (a resume reads
    # the input again).
    return (EnginesKeepDying, EngineBroken, OSError, ObjectLostError)


def _generating(e: BaseException) -> bool:
    """Whether `e`, or an error it interrupted, came out of jobs/run._generate: only a job that
    reached generation can have committed rows to resume from. (Storage can fail before, while
    taking the output's lock or clearing it, or while planning reads the input.)"""
    # lazy: the job modules load pyarrow, pydantic and Ray's pieces; `prefixflow --help` needs none
    from prefixflow.jobs import run

    code = run._generate.__code__
    seen: set[int] = set()
    error: BaseException | None = e
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is code:
                return True
            tb = tb.tb_next
        error = error.__context__
    return False


def _message(e: BaseException) -> str:
    """The error's own message, URLs without their passwords and tokens; for an error raised
    inside a Ray task, its cause's (Ray's text carries the remote traceback)."""
    from prefixflow.storage import masked  # lazy: `prefixflow --help` needs no fsspec paths

    cause = getattr(e, "cause", None)
    return masked(str(cause if isinstance(cause, BaseException) else e).strip())


def _dispatch(args: argparse.Namespace) -> int:
    """The command, its console quiet (console.py) unless --verbose: Ray's log lines go to a file
    under the prefixflow cache, named on stderr at the end."""
    if args.command == "prepare":  # no job, no Ray
        from prefixflow.prepare import prepare  # lazy: it loads torch, which `prefixflow --help` needs not

        for line in prepare():
            print(f"prefixflow: {line}")
        return 0
    if args.command == "validate" or args.verbose:
        return _command(args)
    from prefixflow.console import quiet_console  # lazy: `prefixflow --help` needs no threads or pipes

    log = _log_path(args.command)
    try:
        with quiet_console(log):
            _no_progress_bars()
            return _command(args)
    finally:
        if log.exists() and log.stat().st_size:
            print(f"prefixflow: Ray's log lines are in {log} (--verbose shows them)", file=sys.stderr)


def _log_path(command: str) -> Path:
    return cache_root() / "logs" / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def _no_progress_bars() -> None:
    """Ray Data's progress bars (redrawn lines on a terminal) off: ours shows the job's."""
    from ray.data import DataContext  # lazy: `prefixflow --help` needs no Ray

    DataContext.get_current().enable_progress_bars = False


def _command(args: argparse.Namespace) -> int:
    # lazy: the job modules load pyarrow, pydantic and Ray's pieces; `prefixflow --help` needs none
    from prefixflow.jobs.run import run_job
    from prefixflow.jobs.spec import load_spec, parse_overrides

    if args.command == "demo":
        # lazy: the job modules load pyarrow, pydantic and Ray's pieces; `prefixflow --help` needs none
        from prefixflow.jobs.demo import run_demo

        run_demo(args.dir, plan_only=args.plan_only)
        return 0
    spec = load_spec(args.spec, parse_overrides(args.set))
    if args.command == "validate":
        return _validate(spec, args.spec)
    if args.command == "plan":
        result = _plan(spec, args)
        return 0 if result else 1
    result = run_job(spec, dry_run=args.dry_run, source=args.spec, address=args.address)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return 0


def _validate(spec: Any, source: str) -> int:
    """Check the spec, its paths and a sample of its rows; report rows that would fail."""
    # lazy: the job modules load pyarrow, pydantic and Ray's pieces; `prefixflow --help` needs none
    from prefixflow.jobs.preflight import preflight, row_report

    report = row_report(spec, preflight(spec, source))
    job = spec.to_job()
    print(
        f"{source}: ok ({spec.input_format()} input -> {spec.output_format()} output, "
        f"order {job.config.order}, {job.config.replicas} replica(s))"
    )
    if report.num_bad:
        print(f"  {report.num_bad} of the first {report.num_rows} rows would become error records, e.g.:")
        for reason in report.reasons:
            print(f"    {reason}")
    return 0


def _plan(spec: Any, args: argparse.Namespace) -> dict[str, Any]:
    # lazy: the job modules load pyarrow, pydantic and Ray's pieces; `prefixflow --help` needs none
    from prefixflow.jobs.run import run_job

    if args.out is None:
        return run_job(spec, dry_run=True, source=args.spec, address=args.address)
    # Keep the Plan object to save its table: run the same steps as the dry run.
    import pyarrow.parquet as pq

    # lazy: the job modules load pyarrow, pydantic and Ray's pieces; `prefixflow --help` needs none
    from prefixflow.jobs import report
    from prefixflow.jobs.preflight import plan_out_problems, preflight
    from prefixflow.jobs.run import ensure_ray, pin_table, plan_job, sized_windows
    from prefixflow.jobs.spec import SpecError
    from prefixflow.operators.faces.processor import Processor

    preflight(spec, args.spec, args.address)
    problems = plan_out_problems(spec, args.out)  # never over the input, the output or a stranger's file
    if problems:
        raise SpecError(args.spec, problems)
    ensure_ray(args.address)
    job = sized_windows(pin_table(spec.to_job()), quiet=False)  # as `run` plans it
    planned, _ = plan_job(Processor(job.config), job, whole=True)
    print(report.plan_text(planned))
    import io

    # lazy: the job modules load pyarrow, pydantic and Ray's pieces; `prefixflow --help` needs none
    from prefixflow.operators.results.commit import commit_bytes
    from prefixflow.storage import normal_path

    sink = io.BytesIO()
    pq.write_table(planned.plan.table, sink)
    # Complete or not there (a temporary file renamed, or one PUT), local or a URL.
    commit_bytes(normal_path(args.out), sink.getvalue(), job.storage)
    print(f"plan table ({planned.plan.table.num_rows} rows) written to {args.out}")
    return report.dry_run_result(planned, 0.0)


if __name__ == "__main__":
    sys.exit(main())
