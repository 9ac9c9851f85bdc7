"""What a job prints and records: the plan summary, a live progress line (tqdm), metrics.json."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from prefixflow.operators.results.outputs import plain
from prefixflow.operators.results.progress import RunProgress
from prefixflow.storage import masked

if TYPE_CHECKING:  # annotations only: this module stays importable without the plan's modules loaded
    from prefixflow.jobs.job import Job
    from prefixflow.operators.config import ProcessorConfig
    from prefixflow.operators.stages.plan import PlannedJob


def plan_text(planned: PlannedJob, sample: dict[str, Any] | None = None) -> str:
    """The plan's summary for the console; sample: a dry run's (dry_run_result), which planned
    only the input's first windows."""
    s = planned.plan.summary
    if planned.window is not None:  # the first window of a job planned in windows
        what = f"plan of window {planned.window} (the next windows are planned as they are read)"
    elif sample is not None:
        what = f"plan of the first {s['num_windows']} windows (a dry run's sample)"
    else:
        what = "plan" if "num_windows" not in s else f"plan in {s['num_windows']} windows"
    lines = [
        f"{what}: {s['num_rows']} rows -> {s['num_groups']} groups ({s['num_shared_groups']} sharing a "
        f"prefix), order {s['order']}, {s['num_replicas']} replica(s)",
        f"  prompt tokens {s['prompt_tokens']}, computed {s['computed_prompt_tokens']}: token saving "
        f"ratio {s['token_saving_ratio']:.1%} (single-level {s['single_level_token_saving_ratio']:.1%}, "
        f"optimal {s['optimal_token_saving_ratio']:.1%})",
    ]
    for r in s["replicas"]:
        lines.append(
            f"  replica {r['replica']}: {r['num_rows']} rows, {r['num_groups']} groups, "
            f"predicted cost {r['computed_prompt_tokens']} prompt tokens"
        )
    t = planned.timings
    lines.append(
        f"  error rows {len(planned.error_row_ids)}; read+tokenize {t['read_tokenize_s']:.2f} s, "
        f"gather {t['gather_s']:.3f} s, build_plan {t['build_plan_s']:.3f} s"
    )
    if sample is not None:
        lines.append(
            f"  the whole input, scaled from that sample by rows ({sample['rows']} of {sample['input_rows']}): "
            f"prompt tokens ~{sample['prompt_tokens']}, computed ~{sample['computed_prompt_tokens']}, "
            f"slowest replica ~{sample['predicted_seconds_max']:.0f} s predicted"
        )
    return "\n".join(lines)


def dry_run_result(planned: PlannedJob, wall_s: float, input_rows: int | None = None) -> dict[str, Any]:
    """What a dry run prints as JSON. input_rows: the input's rows, where the plan holds fewer
    (a windowed job's first windows): `sample` then scales its tokens and the slowest replica's
    predicted seconds by input_rows / rows planned, and says so."""
    s = planned.plan.summary
    result = {
        "dry_run": True,
        "plan": plain(s),
        "timings": planned.timings,
        "num_rows": planned.rows.num_rows,
        "num_error_rows": int(len(planned.error_row_ids)),
        "wall_seconds": wall_s,
    }
    rows = planned.rows.num_rows
    if input_rows is not None and input_rows > rows > 0:
        scale = input_rows / rows
        predicted = max((r.get("predicted_seconds", 0.0) for r in s["replicas"]), default=0.0)
        result["sample"] = {
            "windows": s.get("num_windows", 1),
            "rows": rows,
            "input_rows": input_rows,
            "prompt_tokens": round(s["prompt_tokens"] * scale),
            "computed_prompt_tokens": round(s["computed_prompt_tokens"] * scale),
            "predicted_seconds_max": predicted * scale,
            "note": "planned from the input's first windows; the rest scaled by rows, not planned",
        }
    return result


class Progress:
    """The CLI's live line: a RunProgress (operators/results/progress.py: the numbers the Python API's
    bar shows too) drawn with tqdm: rows generated of rows to generate, generated tokens/s, ETA
    (from generated rows only), token saving, elapsed time, error records (never progress),
    each replica's rate. Fed by the driver's poll of the job's MetricsSink (operators/stages/supervise.py,
    twice a second): committed parts (`update`) and the engines' live counters (`live`), which
    move between commits. On a terminal tqdm redraws the line in place; otherwise a plain line
    every `every_s` (tqdm's carriage-return redraws would make a log one endless line).
    """

    def __init__(
        self, total_rows: int, error_rows: int = 0, quiet: bool = False, every_s: float = 10.0, redraw_s: float = 0.5
    ):
        self.source = RunProgress(total_rows, error_rows)
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.every_s = redraw_s if self.tty else every_s
        self.started = time.time()
        self.last = 0.0
        self.windows = 0  # of a job planned in windows: those queued so far
        self.bar = _Line(self) if self.tty and not quiet else None  # draws fields() at once

    def add_rows(self, rows: int, error_rows: int = 0, window: bool = False) -> None:
        """More rows to run: `rows` in all, `error_rows` of them error records; window: they are
        a window of a job planned in windows, queued (the line counts the windows planned)."""
        self.source.add_rows(rows, error_rows)
        self.windows += window

    def update(self, manifest: dict[str, Any]) -> None:
        self.source.committed(manifest)
        s = self.source.snapshot()
        self._draw(force=s.rows >= s.rows_to_generate)

    def live(self, replicas: dict[int, dict[str, Any]]) -> None:
        self.source.live(replicas)
        self._draw()

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.quiet or not (force or now - self.last >= self.every_s):
            return
        self.last = now
        if self.bar is not None:
            self.bar.refresh()
        else:
            print(self.line(), file=sys.stderr, flush=True)

    def fields(self) -> dict[str, Any]:
        """tqdm.format_meter's arguments for the line (LINE names the extra ones)."""
        s = self.source.snapshot()
        more = [f"{s.error_rows} error rows"] if s.error_rows else []
        if self.windows:  # the total grows as windows are read and planned
            more.append(f"{self.windows} window{'s' if self.windows > 1 else ''} planned")
        if s.engine_s is None and s.rows < s.rows_to_generate:
            more.append("loading engines")
        more += _replica_rates(self.source.replicas)
        # rate 0: tqdm shows the ETA as "?" (None would make it count from the line's start)
        return {
            "n": s.rows,
            "total": s.rows_to_generate,
            "elapsed": time.time() - self.started,
            "rate": s.rows_per_s or 0.0,
            "bar_format": LINE,
            "ncols": None,
            "tok_s": s.tokens_per_s or 0.0,
            "saving": _pct(s.saving),
            "more": "".join(" | " + m for m in more),
        }

    def line(self) -> str:
        return tqdm.format_meter(**self.fields())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


LINE = (
    "[prefixflow] rows {n}/{total} ({percentage:.0f}%) | {tok_s:.1f} generated tok/s | "
    "ETA {remaining} | saving {saving} | {elapsed}{more}"
)


class _Line(tqdm):
    """tqdm as the terminal's redraw of a Progress's line: its numbers are the Progress's (tqdm's
    own count and rate would start with the line, model loading included)."""

    nrows: int | None  # tqdm's, set by its __init__ (which its annotations do not say)

    def __init__(self, progress: Progress):
        self.progress = progress
        super().__init__(
            total=progress.source.total_rows,
            file=sys.stderr,
            leave=True,
            dynamic_ncols=True,
            mininterval=0,
            bar_format=LINE,
        )
        self._sized()
        self.refresh()

    def _sized(self) -> None:
        """A terminal that gives no size (a bare pty) reads as 0 or -1 rows: then none (tqdm's
        display() would find no row to draw on and draw nothing)."""
        if self.nrows is not None and self.nrows < 1:
            self.nrows = None

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict  # reads the terminal's size again
        self._sized()
        width = d["ncols"] if d["ncols"] and d["ncols"] > 0 else None  # None: no trimming
        return {**d, **self.progress.fields(), "ncols": width}


def _replica_rates(replicas: dict[int, dict[str, Any]], most: int = 4) -> list[str]:
    """Each replica's rows and rate; with more than `most` replicas, the range (one line must
    fit a terminal, or the in-place redraw wraps)."""
    if not replicas:
        return []
    if len(replicas) > most:
        rates = [_rate(c) for c in replicas.values()]
        return [f"{len(replicas)} replicas {min(rates):.1f}-{max(rates):.1f} tok/s each"]
    return [", ".join(f"r{r} {c['rows']} rows {_rate(c):.1f} tok/s" for r, c in sorted(replicas.items()))]


def _rate(counts: dict[str, Any]) -> float:
    """A replica's generated tokens per second since its engine loaded."""
    return counts["generated_tokens"] / max(counts["time"] - counts["run_started"], 1e-9)


def metrics(
    job: Job,
    planned: PlannedJob,
    manifests: list[dict[str, Any]],
    replica_records: list[dict],
    wall_s: float,
    generate_s: float,
) -> dict[str, Any]:
    """metrics.json: counts, throughput, saving, stage times, per-replica times and steps."""
    rows = sum(m["num_rows"] for m in manifests)
    errors = sum(m["num_errors"] for m in manifests)
    prompt = sum(m["prompt_tokens"] for m in manifests)
    computed = sum(m["computed_prompt_tokens"] for m in manifests)
    generated = sum(m["generated_tokens"] for m in manifests)
    t = planned.timings
    plan_s = t["gather_s"] + t["build_plan_s"]
    config = job.config
    return {
        "job": job.name,
        "model": masked(config.model),
        "order": config.order,
        "replicas": config.replicas,
        "rows": rows,
        "rows_ok": rows - errors,
        "rows_error": errors,
        "prompt_tokens": prompt,
        "computed_prompt_tokens": round(computed),
        "generated_tokens": generated,
        "token_saving_ratio": planned.plan.summary["token_saving_ratio"],
        "token_saving_ratio_measured": 1 - computed / prompt if prompt else 0.0,
        "token_saving_ratio_engine": _engine_saving(replica_records),
        "optimal_token_saving_ratio": planned.plan.summary["optimal_token_saving_ratio"],
        "wall_seconds": wall_s,
        "stage_seconds": {**t, "generate_write_s": generate_s},
        "plan_share_of_wall": plan_s / wall_s if wall_s else 0.0,
        "throughput": {
            "rows_per_s": rows / generate_s if generate_s else 0.0,
            "generated_tokens_per_s": generated / generate_s if generate_s else 0.0,
            "total_tokens_per_s": (prompt + generated) / generate_s if generate_s else 0.0,
        },
        "sampling": sampling_used(config),
        "per_replica": [_replica(r) for r in replica_records],
        "plan": plain(planned.plan.summary),
        # Planning moves metadata, not prompts: compare with prompt_tokens * 4 (int32 token ids).
        "plan_driver_bytes": planned.driver_bytes,
        "parts": sorted(m["part"] for m in manifests),
    }


def sampling_used(config: ProcessorConfig) -> dict[str, Any]:
    """The job's default sampling parameters, and which of them came from the model."""
    from dataclasses import asdict

    return {
        "params": plain(asdict(config.sampling_params)),
        "from_generation_config": plain(config.sampling_from_model),
    }


def _engine_saving(records: list[dict]) -> float | None:
    """BatchLLM Eq. 1 from what the engines actually computed (None if they did not say)."""
    found = [r.get("engine_totals") for r in records]
    totals = [t for t in found if t is not None]
    if not totals or len(totals) < len(found):
        return None
    prompt = sum(t["num_prompt_tokens"] for t in totals)
    computed = sum(t["num_computed_prompt_tokens"] for t in totals)
    return 1 - computed / prompt if prompt else 0.0


def _replica(record: dict[str, Any]) -> dict[str, Any]:
    steps = record.get("steps", [])
    out = {k: v for k, v in record.items() if k != "steps"}
    out["num_steps"] = len(steps)
    out["step_tokens"] = [_step_tokens(s) for s in steps]
    out["steps"] = steps
    return out


def _step_tokens(step: Any) -> Any:
    if isinstance(step, dict):
        for key in ("num_tokens", "num_batched_tokens", "tokens"):
            if key in step:
                return step[key]
    return step


def metrics_text(m: dict[str, Any], path: str) -> str:
    th = m["throughput"]
    lines = [
        f"done: {m['rows']} rows ({m['rows_error']} error records) in {m['wall_seconds']:.1f} s -> {masked(path)}",
        f"  {th['generated_tokens_per_s']:.1f} generated tok/s, {th['total_tokens_per_s']:.1f} total tok/s, "
        f"{th['rows_per_s']:.2f} rows/s",
        f"  token saving ratio: plan {m['token_saving_ratio']:.1%}, engine {_pct(m['token_saving_ratio_engine'])}, "
        f"optimal {m['optimal_token_saving_ratio']:.1%}; plan stage {m['plan_share_of_wall']:.2%} of wall time",
    ]
    for r in m["per_replica"]:
        stolen = len(r.get("stolen_units") or [])
        lines.append(
            f"  replica {r['replica']}: {r['num_rows']} rows in {r['seconds']:.2f} s, "
            f"{r['num_steps']} engine steps" + (f", {stolen} unit(s) taken from others" if stolen else "")
        )
    table = m.get("table")
    if table and table["already_committed"]:
        lines.append(
            f"  table {table['table']}: already held this job's rows (version {table['version']}): nothing appended"
        )
    elif table and table["version"] is None:
        lines.append(f"  table {table['table']}: no rows, no commit")
    elif table:
        done = f"{table['rows_appended']} rows appended in one commit (version {table['version']})"
        lines.append(f"  table {table['table']}: {done}")
    if "plot" in m:
        lines.append(f"  {m['plot']}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"
