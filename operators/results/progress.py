"""Live progress of a run, counted from the rows the engines generate.

One source of numbers, drawn in two places:

- `RunProgress` counts rows the engines finished, rows left for them, error records, generated
  tokens and the seconds since the first engine was ready. It is fed by the engines' live
  counters (operators/generate.Heartbeat, twice a second per replica) and by committed parts'
  manifest rows. Error records (rows that failed before the engines: bad templates, bad sampling
  parameters, rows given up) take no engine time: they are counted apart and never as progress,
  so the rate and the ETA are those of generated rows (counted as progress, 24 error records
  made a half-done job look nearly finished and its ETA wrong).
- `LiveBar` draws a RunProgress as a Ray progress bar (`ray.experimental.tqdm_ray`) from inside
  an actor; Ray shows it on the driver, in a terminal or a notebook. The Python API's processor
  has one in its MetricsSink (every replica, one bar); a `map_batches` Generator actor has one
  for the batches it got so far. The CLI's line (jobs/report.Progress) draws the same
  RunProgress with tqdm on the driver.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    rows: int  # rows the engines finished (a row the engine failed included)
    rows_to_generate: int  # the run's rows minus its error records
    error_rows: int  # error records: never run, never counted in `rows`
    generated_tokens: int
    engine_s: float | None  # seconds since the first engine was ready; None: none is yet
    saving: float | None  # token saving measured on the committed parts; None: none yet

    @property
    def rows_per_s(self) -> float | None:
        return self.rows / self.engine_s if self.engine_s else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.generated_tokens / self.engine_s if self.engine_s else None

    @property
    def eta_s(self) -> float | None:
        """Rows left over the generated rows' rate (None until a row is done)."""
        if self.rows >= self.rows_to_generate:
            return 0.0
        rate = self.rows_per_s
        return (self.rows_to_generate - self.rows) / rate if rate else None


class RunProgress:
    """A run's progress from engine counters and committed parts (see the module docstring).

    Each replica's live counters are its running engine's: they run ahead of the commits, and
    start again at 0 when a dead replica is restarted (the commits lead then). `run_done` folds
    a finished run into the totals, for callers that run one replica many times (a Generator
    actor, one run per batch).
    """

    def __init__(self, total_rows: int = 0, error_rows: int = 0):
        self.total_rows = total_rows
        self.error_rows = error_rows  # known before the engines start
        self.committed_rows = self.committed_tokens = 0  # generated rows in committed parts
        self.committed_errors = 0  # rows of committed error-record parts
        self.prompt = self.computed = 0.0
        self.replicas: dict[int, dict[str, Any]] = {}  # replica -> its running engine's counters
        self.done_rows = self.done_tokens = 0  # runs folded by run_done
        self.first_started: float | None = None

    def add_rows(self, rows: int, error_rows: int = 0) -> None:
        """More rows for this run (a Generator's next batch): `rows` in all, `error_rows` of them
        error records."""
        self.total_rows += rows
        self.error_rows += error_rows

    def committed(self, manifest: dict[str, Any]) -> None:
        """A committed part's manifest row; replica -1: error records."""
        if int(manifest.get("replica", 0)) < 0:
            self.committed_errors += manifest["num_rows"]
            return
        self.committed_rows += manifest["num_rows"]
        self.committed_tokens += manifest["generated_tokens"]
        self.prompt += manifest["prompt_tokens"]
        self.computed += manifest["computed_prompt_tokens"]

    def live(self, replicas: dict[int, dict[str, Any]]) -> None:
        """The latest counters of running replicas: replica -> {rows, generated_tokens, run_started, ...}."""
        for r, counts in replicas.items():
            self.replicas[int(r)] = counts
            started = float(counts["run_started"])
            self.first_started = started if self.first_started is None else min(self.first_started, started)

    def run_done(self, replica: int) -> None:
        """The replica's run finished and reported its last counters: add them to the totals."""
        counts = self.replicas.pop(int(replica), None)
        if counts is not None:
            self.done_rows += int(counts["rows"])
            self.done_tokens += int(counts["generated_tokens"])

    def snapshot(self, now: float | None = None) -> Snapshot:
        now = time.time() if now is None else now
        errors = max(self.error_rows, self.committed_errors)  # rows given up add error records
        to_generate = max(self.total_rows - errors, 0)
        live = self.replicas.values()
        rows = max(self.committed_rows, self.done_rows + sum(int(c["rows"]) for c in live))
        tokens = max(self.committed_tokens, self.done_tokens + sum(int(c["generated_tokens"]) for c in live))
        since = self.first_started
        return Snapshot(
            rows=min(rows, to_generate),
            rows_to_generate=to_generate,
            error_rows=errors,
            generated_tokens=tokens,
            engine_s=max(now - since, 1e-9) if since is not None else None,
            saving=1 - self.computed / self.prompt if self.prompt else None,
        )


class LiveBar:
    """A RunProgress as a Ray progress bar drawn from inside an actor (tqdm_ray: the driver shows
    it): generated rows of the rows to generate; the bar's rate and ETA are the driver's tqdm's,
    from those rows (the bar appears with the first engine report, so model loading is not in
    its rate); the description gives generated tokens/s and the error records.

    report: an engine's live counters (a ReplicaRunner's report callback; any thread).
    close_when_done: close the bar when every row is generated (False: more rows may come).
    """

    def __init__(
        self, name: str, total_rows: int = 0, error_rows: int = 0, every_s: float = 1.0, close_when_done: bool = True
    ):
        self.name = name
        self.source = RunProgress(total_rows, error_rows)
        self.every_s = every_s
        self.close_when_done = close_when_done
        self.bar: Any = None  # the tqdm_ray bar, made at the first draw after an engine report
        self.closed = False
        self.last = 0.0
        self.lock = threading.Lock()

    def add_rows(self, rows: int, error_rows: int = 0) -> None:
        self.source.add_rows(rows, error_rows)
        self.draw(force=True)

    def report(self, counts: dict[str, Any]) -> None:
        self.source.live({int(counts["replica"]): counts})
        rows, total, _ = self.fields()
        # The last counts are always drawn: reports come faster than every_s, and a throttled
        # last one left the bar short of 100% for good (nothing draws it after).
        self.draw(force=rows >= total)

    def run_done(self, replica: int = 0) -> None:
        self.source.run_done(replica)
        self.draw(force=True)

    def fields(self, now: float | None = None) -> tuple[int, int, str]:
        """(generated rows, rows to generate, description) as the bar shows them."""
        s = self.source.snapshot(now)
        rate = s.tokens_per_s
        parts = ["loading engines" if rate is None else f"{rate:.1f} generated tok/s"]
        if s.error_rows:
            parts.append(f"{s.error_rows} error row{'s' if s.error_rows != 1 else ''}")
        return s.rows, s.rows_to_generate, f"{self.name} ({', '.join(parts)})"

    def draw(self, force: bool = False) -> None:
        """Send the bar's state to the driver (at most every `every_s` unless forced); a
        progress report never fails the caller."""
        with self.lock:  # the engine's heartbeat thread and the caller's both draw
            now = time.time()
            if self.closed or not (force or now - self.last >= self.every_s):
                return
            self.last = now
            self._send(now)

    def _send(self, now: float) -> None:
        if self.bar is None and self.source.first_started is None:
            return  # drawn from the first engine report: the driver's tqdm times the bar's rate
        try:
            n, total, desc = self.fields(now)
            if self.bar is None:
                from ray.experimental import tqdm_ray

                try:  # flush_interval_s=0: draw() decides when (tqdm_ray's own 1 s throttle
                    # would drop a batch's last counts)
                    self.bar = tqdm_ray.tqdm(desc=desc, total=total, unit="row", flush_interval_s=0)
                except TypeError:  # a Ray whose tqdm_ray sends every update itself
                    self.bar = tqdm_ray.tqdm(desc=desc, total=total, unit="row")
            self.bar.total, self.bar.n = total, n
            self.bar.set_description(desc)  # sends the state
            if self.close_when_done and n >= total:
                self.close()
        except Exception as e:  # noqa: BLE001 - drawing must never fail a replica or the sink
            _log.debug("progress bar %r: drawing failed (%s: %s); the counts go on", self.name, type(e).__name__, e)

    def close(self) -> None:
        if self.bar is not None and not self.closed:
            self.closed = True
            self.bar.close()
