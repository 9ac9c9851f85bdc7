"""The later windows of a job planned in windows, planned on a thread while the engines run.

The job driver (operators/stages/supervise.py) queues a window's units once the engines have
nearly run out of the last one's; until then this thread reads, tokenizes and plans the next
window (operators/stages/plan.plan_windows: Ray Data streams the blocks) and builds its units'
payloads, and then waits with it: it plans at most one window ahead, so the driver holds about
two windows of the job whatever its size, and Ray Data reads no further than that (its
streaming executor stops when nobody takes its output).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prefixflow.operators.stages.plan import PlannedJob, unit_payload_refs

END = "end"  # poll(): the last window was handed out
POLL_S = 0.2  # how often a thread waiting to hand its window over checks whether to stop


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class WindowFeed:
    """windows: the job's windows after the first (plan_windows). poll() returns (window, its
    payload refs per replica) when one is ready, END after the last, or None; it raises what
    reading or planning a window raised. stop() ends the thread at its next hand-over."""

    def __init__(self, windows: Iterator[PlannedJob], num_replicas: int):
        self.windows, self.num_replicas = windows, num_replicas
        self.ready: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.stopping = threading.Event()
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
        except BaseException as e:  # noqa: BLE001 - handed to the driver, which fails the job with it
            self._hand_over(_Failed(e))

    def _hand_over(self, item: Any) -> bool:
        while not self.stopping.is_set():
            try:
                self.ready.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def poll(self) -> Any:
        try:
            item = self.ready.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, _Failed):
            self.ended = True
            raise item.error
        if item is END:
            self.ended = True
        return item

    def stop(self) -> None:
        self.stopping.set()
