"""What a job prints and records: the plan summary, a live progress line, metrics.json."""

from __future__ import annotations

import sys
import time
from typing import Any

from prefixflow.operators.outputs import plain


def plan_text(planned: Any) -> str:
    s = planned.plan.summary
    lines = [
        f"plan: {s['num_rows']} rows -> {s['num_groups']} groups ({s['num_shared_groups']} sharing a "
        f"prefix), order {s['order']}, {s['num_replicas']} replica(s)",
        f"  prompt tokens {s['prompt_tokens']}, computed {s['computed_prompt_tokens']}: token saving "
        f"ratio {s['token_saving_ratio']:.1%} (single-level {s['single_level_token_saving_ratio']:.1%}, "
        f"optimal {s['optimal_token_saving_ratio']:.1%})",
    ]
    for r in s["replicas"]:
        lines.append(f"  replica {r['replica']}: {r['num_rows']} rows, {r['num_groups']} groups, "
                     f"predicted cost {r['computed_prompt_tokens']} prompt tokens")
    t = planned.timings
    lines.append(f"  error rows {len(planned.error_row_ids)}; read+tokenize {t['read_tokenize_s']:.2f} s, "
                 f"gather {t['gather_s']:.3f} s, build_plan {t['build_plan_s']:.3f} s")
    return "\n".join(lines)


def dry_run_result(planned: Any, wall_s: float) -> dict[str, Any]:
    return {"dry_run": True, "plan": plain(planned.plan.summary), "timings": planned.timings,
            "num_rows": planned.rows.num_rows, "num_error_rows": int(len(planned.error_row_ids)),
            "wall_seconds": wall_s}


class Progress:
    """One live line: rows done of total, generated tokens/s, ETA, token saving, each replica's
    rate. Fed by the driver's poll of the job's MetricsSink (jobs/supervise.py, twice a second):
    committed parts (`update`) and the engines' live counters (`live`), which move between
    commits. On a terminal the line is redrawn in place; otherwise a plain line every `every_s`.
    """

    def __init__(self, total_rows: int, quiet: bool = False, every_s: float = 10.0,
                 redraw_s: float = 0.5):
        self.total = total_rows
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.every_s = redraw_s if self.tty else every_s
        self.started = time.perf_counter()
        self.last = 0.0
        self.rows = self.generated = 0  # committed
        self.prompt = self.computed = 0.0
        self.replicas: dict[int, dict[str, Any]] = {}  # replica -> its last live counters

    def update(self, manifest: dict[str, Any]) -> None:
        self.rows += manifest["num_rows"]
        self.generated += manifest["generated_tokens"]
        self.prompt += manifest["prompt_tokens"]
        self.computed += manifest["computed_prompt_tokens"]
        self._draw(force=self.rows >= self.total)

    def live(self, replicas: dict[int, dict[str, Any]]) -> None:
        self.replicas.update({int(r): c for r, c in replicas.items()})
        self._draw()

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.quiet or not (force or now - self.last >= self.every_s):
            return
        self.last = now
        if self.tty:  # \r and erase to the end: the line is redrawn in place
            print("\r" + self.line() + "\x1b[K", end="", file=sys.stderr, flush=True)
        else:
            print(self.line(), file=sys.stderr, flush=True)

    def counts(self) -> tuple[int, int]:
        """(rows, generated tokens) so far: the engines' live counts run ahead of the commits
        (a restarted replica's count starts again at 0: the commits then lead)."""
        live = self.replicas.values()
        rows = max(self.rows, sum(int(c["rows"]) for c in live))
        tokens = max(self.generated, sum(int(c["generated_tokens"]) for c in live))
        return min(rows, self.total), tokens

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rows, tokens = self.counts()
        saving = 1 - self.computed / self.prompt if self.prompt else None
        # Rates since the first engine was ready: model loading would drag the ETA down.
        since = min((c["run_started"] for c in self.replicas.values()), default=None)
        gen_s = max(time.time() - since, 1e-9) if since is not None else None
        if rows >= self.total:
            eta = "0 s"
        else:
            eta = f"{(self.total - rows) * gen_s / rows:.0f} s" if gen_s and rows else "--"
        pct = rows / self.total if self.total else 1.0
        parts = [f"[prefixflow] rows {rows}/{self.total} ({pct:.0%})",
                 f"{tokens / gen_s if gen_s else 0.0:.1f} generated tok/s", f"ETA {eta}",
                 f"saving {_pct(saving)}", f"{elapsed:.0f} s"]
        if since is None and rows < self.total:
            parts.append("loading engines")
        return " | ".join(parts + _replica_rates(self.replicas))

    def close(self) -> None:
        if not self.quiet and self.tty:
            print(file=sys.stderr)


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


def metrics(spec: Any, planned: Any, manifests: list[dict[str, Any]], replica_records: list[dict],
            wall_s: float, generate_s: float) -> dict[str, Any]:
    """metrics.json: counts, throughput, saving, stage times, per-replica times and steps."""
    rows = sum(m["num_rows"] for m in manifests)
    errors = sum(m["num_errors"] for m in manifests)
    prompt = sum(m["prompt_tokens"] for m in manifests)
    computed = sum(m["computed_prompt_tokens"] for m in manifests)
    generated = sum(m["generated_tokens"] for m in manifests)
    t = planned.timings
    plan_s = t["gather_s"] + t["build_plan_s"]
    return {
        "job": spec.name, "model": spec.model, "order": spec.order, "replicas": spec.replicas,
        "rows": rows, "rows_ok": rows - errors, "rows_error": errors,
        "prompt_tokens": prompt, "computed_prompt_tokens": round(computed),
        "generated_tokens": generated,
        "token_saving_ratio": planned.plan.summary["token_saving_ratio"],
        "token_saving_ratio_measured": 1 - computed / prompt if prompt else 0.0,
        "token_saving_ratio_engine": _engine_saving(replica_records),
        "optimal_token_saving_ratio": planned.plan.summary["optimal_token_saving_ratio"],
        "wall_seconds": wall_s,
        "stage_seconds": {**t, "generate_write_s": generate_s},
        "plan_share_of_wall": plan_s / wall_s if wall_s else 0.0,
        "throughput": {"rows_per_s": rows / generate_s if generate_s else 0.0,
                       "generated_tokens_per_s": generated / generate_s if generate_s else 0.0,
                       "total_tokens_per_s": (prompt + generated) / generate_s if generate_s else 0.0},
        "sampling": sampling_used(spec),
        "per_replica": [_replica(r) for r in replica_records],
        "plan": plain(planned.plan.summary),
        # Planning moves metadata, not prompts: compare with prompt_tokens * 4 (int32 token ids).
        "plan_driver_bytes": planned.driver_bytes,
        "parts": sorted(m["part"] for m in manifests),
    }


def sampling_set(spec: Any) -> dict[str, Any]:
    """The sampling fields the spec sets itself (the model's generation_config.json fills the
    others, see operators.config.sampling_with_defaults)."""
    return spec.sampling.model_dump(include=spec.sampling.model_fields_set)


def sampling_used(spec: Any) -> dict[str, Any]:
    """The job's default sampling parameters, and which of them came from the model."""
    from dataclasses import asdict

    from prefixflow.operators.config import sampling_with_defaults

    params, taken = sampling_with_defaults(spec.model, sampling_set(spec))
    return {"params": plain(asdict(params)), "from_generation_config": plain(taken)}


def _engine_saving(records: list[dict]) -> float | None:
    """BatchLLM Eq. 1 from what the engines actually computed (None if they did not say)."""
    totals = [r.get("engine_totals") for r in records]
    if not totals or any(t is None for t in totals):
        return None
    prompt = sum(t["num_prompt_tokens"] for t in totals)
    # The generating engine says num_computed_prompt_tokens; the Scorer num_computed_tokens.
    computed = sum(t.get("num_computed_prompt_tokens", t.get("num_computed_tokens", 0)) for t in totals)
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
        f"done: {m['rows']} rows ({m['rows_error']} error records) in {m['wall_seconds']:.1f} s -> {path}",
        f"  {th['generated_tokens_per_s']:.1f} generated tok/s, {th['total_tokens_per_s']:.1f} total tok/s, "
        f"{th['rows_per_s']:.2f} rows/s",
        f"  token saving ratio: plan {m['token_saving_ratio']:.1%}, engine {_pct(m['token_saving_ratio_engine'])}, "
        f"optimal {m['optimal_token_saving_ratio']:.1%}; plan stage {m['plan_share_of_wall']:.2%} of wall time",
    ]
    for r in m["per_replica"]:
        lines.append(f"  replica {r['replica']}: {r['num_rows']} rows in {r['seconds']:.2f} s, "
                     f"{r['num_steps']} engine steps")
    if "plot" in m:
        lines.append(f"  {m['plot']}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"

