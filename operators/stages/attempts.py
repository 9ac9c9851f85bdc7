"""When engine actors keep dying: whose rows to give up, and when to stop.

The job driver (operators/stages/supervise.py) starts a new engine actor for a replica whose actor died.
This ledger decides what a repeated death means, pure Python so that its rules are tested
directly:

  - a death is blamed on the work item its actor was running: a replica index, or
    ERRORS_ITEM (the item that writes error records); a death before the actor's model was
    loaded is blamed on no row (None: a node lost, OOM while loading);
  - an item's streak counts its deaths in a row without committing a row in between;
    committing anything ends the streak;
  - a replica whose streak passes `max_retries` is given up: its uncommitted rows become error
    records and the other replicas go on, so one bad node or one poison row cannot sink the
    healthy replicas' rows;
  - a streak of ERRORS_ITEM or None passing `max_retries` has no row to blame: the job fails
    with a clear message (committed rows stay for `output.resume`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixflow.operators.stages.generate import ERRORS_ITEM  # the work item writing error records


class EnginesKeepDying(RuntimeError):
    """Engine actors died again and again with no replica's rows to blame."""


@dataclass
class AttemptLedger:
    max_retries: int
    streaks: dict[int | None, int] = field(default_factory=dict)

    def record_failure(self, died: list[int | None], gained: dict[int, int], committed: int, why: str) -> list[int]:
        """Record a death; returns the replicas to give up now.

        died: the work items blamed for the death (empty when no row is to blame).
        gained: rows committed since the previous failure, per item (replica, or ERRORS_ITEM).
        committed: rows committed in all (for the message when the job must stop).
        """
        for replica, rows in gained.items():
            if rows > 0:
                self.streaks.pop(replica, None)
        if any(gained.values()):
            self.streaks.pop(None, None)
        for item in set(died) or {None}:
            progressed = gained.get(item, 0) > 0 if item is not None else any(gained.values())
            self.streaks[item] = 0 if progressed else self.streaks.get(item, 0) + 1
        give_up = []
        for item, streak in sorted(self.streaks.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            if streak <= self.max_retries:
                continue
            if item is None or item == ERRORS_ITEM:
                what = "before loading the model" if item is None else "while writing error records"
                raise EnginesKeepDying(
                    f"engine actors died {streak} times in a row {what}, committing nothing "
                    f"(last: {why}); no row is to blame, so the job stops. The {committed} "
                    "committed rows are kept: fix the cluster and rerun with output.resume: true"
                )
            give_up.append(item)
        for item in give_up:
            del self.streaks[item]
        return give_up
