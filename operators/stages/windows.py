"""The later windows of a job planned in windows, planned on a thread while the engines run.

The job driver (operators/stages/supervise.py) queues a window's units once the engines have
nearly run out of the last one's; meanwhile this thread takes the next window from
operators/stages/window_plans.plan_windows (Ray Data streams the blocks; window_planners
windows are planned at once, each by a Ray task), builds its units' payloads, hands it over,
and waits until the driver has taken it before it asks for another: one window is ready ahead
of those queued (window_planners - 1 more being planned), whatever the job's size, and Ray Data
reads at most two bundles further (its streaming executor stops when nobody takes its output).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from prefixflow.operators.stages.plan import PlannedJob, unit_payload_refs

END = "end"  # the end of a stream handed over: poll() after the last window, window_plans' reader after the last bundle
POLL_S = 0.05  # how often a thread waiting to hand over (or for a planned window) looks again, or to stop


class WindowFeed:
    """windows: the job's windows after the first (plan_windows). poll() returns (window, its
    payload refs per replica) when one is ready, END after the last, or None; check() raises at
    once what reading or planning a window raised. stop() ends the thread at its next wait."""

    def __init__(self, windows: Iterator[PlannedJob], num_replicas: int):
        self.windows, self.num_replicas = windows, num_replicas
        self.ready: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.stopping = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._plan, name="prefixflow-windows", daemon=True)
        self.ended = False

    def start(self) -> None:
        self.thread.start()

    def _plan(self) -> None:
        import ray

        try:
            for window in self.windows:
                payloads = unit_payload_refs(window, self.num_replicas)
                # Built on the driver's node before the window is queued: a lost worker node
                # (and the blocks it held) loses no unit another replica must take.
                refs = [ref for refs in payloads for ref in refs]
                ray.wait(refs, num_returns=len(refs), fetch_local=False)
                if not self._hand_over((window, payloads)):
                    return
            self._hand_over(END)
        except BaseException as e:  # noqa: BLE001 - the driver fails the job with it (check)
            self.failure = e
        finally:  # stopped or failed early: the windows' reader and planning tasks stop now
            close = getattr(self.windows, "close", None)
            if close is not None:
                close()

    def _hand_over(self, item: Any) -> bool:
        """Put `item` for the driver and wait until it took it (False: stopped first)."""
        self.ready.put(item)  # never blocks: the window before was taken
        while not self.stopping.wait(POLL_S):
            if self.ready.empty():
                return True
        return False

    def check(self) -> None:
        if self.failure is not None:
            self.ended = True
            raise self.failure

    def poll(self) -> Any:
        self.check()
        try:
            item = self.ready.get_nowait()
        except queue.Empty:
            return None
        if item is END:
            self.ended = True
        return item

    def stop(self) -> None:
        self.stopping.set()
