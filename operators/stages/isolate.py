"""Run a replica's groups so that an exception on one row fails that row, not the replica.

An ordinary exception raised inside the engine (a bug or a limitation that one request hits)
would otherwise end the work item and, through the supervisor, the whole job. Here it is
contained: the outputs already yielded are kept, the engine is reset, and the rows not yet
finished run again in isolation: each remaining group alone; a group that fails again is split
into its members, each run alone; a member that still fails becomes an error output naming the
exception. Only a death of the process (not an exception) is the supervisor's business.

An engine that fails on every request is broken, not fed bad rows (a lost GPU, a broken
kernel): once MAX_FAILURES_IN_A_ROW rows run alone have failed with none running in between,
EngineBroken is raised instead of turning the rest of the replica into error records.
The job then stops with its committed rows kept for `output.resume`. An engine that knows it
cannot run anything now raises EngineUnavailable (engine/outputs.py), which stops the run at
once, the same way.

`without_rows` (a group less the rows already done) is shared with the replica runner
(operators/stages/generate.py), which skips the rows an earlier attempt committed.

Torch-free: the engine is reached only through the callables given.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Protocol, TypeVar

import numpy as np

from prefixflow.engine.outputs import EngineUnavailable  # torch-free
from prefixflow.requests import PrefixGroup

_log = logging.getLogger(__name__)


class HasRowId(Protocol):
    @property
    def row_id(self) -> int: ...


Out = TypeVar("Out", bound=HasRowId)  # RequestOutput, ScoreOutput
MAX_FAILURES_IN_A_ROW = 8


class EngineBroken(RuntimeError):
    """The engine failed on every request it was given alone: no row is to blame."""


def run_isolated(
    run: Callable[[Iterable[PrefixGroup | None]], Iterable[Out]],
    groups: Iterable[PrefixGroup | None],
    reset: Callable[[], None],
    failed: Callable[[int, str], Out],
) -> Iterator[Out]:
    """The outputs of `run(groups)`, one per row, even when `run` raises.

    run: runs groups through the engine, yielding one output per row as it finishes.
    groups: taken lazily by the engine (NOT_READY passes through, engine/intake.py); after a
        failure the groups it had taken run again in isolation, then the rest as before.
    reset: brings the engine back to an empty state after a failed run.
    failed: the error output of a row, given its row id and the message.
    """
    done: set[int] = set()
    source = iter(groups)
    while True:
        taken: list[PrefixGroup] = []
        error = yield from _attempt(run, _recording(source, taken), done)
        if error is None:
            return
        _log.warning(
            "the engine failed (%s: %s); running the rows left group by group, then row by row",
            type(error).__name__,
            error,
        )
        reset()
        yield from _isolate(run, taken, done, reset, failed)


def _recording(source: Iterator[PrefixGroup | None], taken: list[PrefixGroup]) -> Iterator[PrefixGroup | None]:
    """The source's groups, noting in `taken` those the engine took."""
    for group in source:
        if group is not None:
            taken.append(group)
        yield group


def _isolate(
    run: Callable[[Iterable[PrefixGroup | None]], Iterable[Out]],
    groups: list[PrefixGroup],
    done: set[int],
    reset: Callable[[], None],
    failed: Callable[[int, str], Out],
) -> Iterator[Out]:
    """Each group's rows not yet done alone; a group that fails again row by row."""
    failures: list[str] = []  # rows that failed alone since the last row that ran
    for group in groups:
        left = _without(group, done)
        if left is None:
            continue
        if left.num_members > 1:
            if (yield from _attempt(run, [left], done)) is None:
                failures.clear()  # the engine works: the failures were the rows'
                continue
            reset()
        yield from _one_by_one(run, left, done, reset, failed, failures)


def _one_by_one(
    run: Callable[[Iterable[PrefixGroup | None]], Iterable[Out]],
    group: PrefixGroup,
    done: set[int],
    reset: Callable[[], None],
    failed: Callable[[int, str], Out],
    failures: list[str],
) -> Iterator[Out]:
    """Each member of `group` not yet done, run alone; one that still fails gets `failed`.
    `failures` collects the failures since the last success (EngineBroken past the limit)."""
    for member in _members(group, done):
        error = yield from _attempt(run, [member], done)
        if error is None:
            failures.clear()
            continue
        reset()
        row_id = int(member.row_ids[0])
        if row_id not in done:  # it may have finished before the failure
            why = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
            failures.append(why)
            if len(failures) >= MAX_FAILURES_IN_A_ROW:
                raise EngineBroken(
                    f"the engine failed on each of the last {len(failures)} rows "
                    f"run alone and ran none in between (last: {why}): the engine "
                    "is broken, not the rows"
                )
            yield failed(row_id, f"the engine failed on this row: {why}")


def _attempt(
    run: Callable[[Iterable[PrefixGroup | None]], Iterable[Out]], groups: Iterable[PrefixGroup | None], done: set[int]
) -> Generator[Out, None, Exception | None]:
    """Yield run(groups)'s outputs, noting their rows in `done`; return the exception, if any."""
    try:
        for out in run(groups):
            done.add(int(out.row_id))
            yield out
    except EngineUnavailable:
        raise  # no row is to blame (a server that stopped answering): the run stops, rows kept for resume
    except Exception as e:  # noqa: BLE001 - any engine failure is contained; GeneratorExit is not an Exception
        return e
    return None


def _without(group: PrefixGroup, done: set[int]) -> PrefixGroup | None:
    return without_rows(group, np.fromiter(done, np.int64, len(done)))


def without_rows(group: PrefixGroup, done: np.ndarray) -> PrefixGroup | None:
    """The group minus its members in `done`; None when none is left."""
    if not len(done):
        return group
    keep = ~np.isin(group.row_ids, done)
    if keep.all():
        return group
    if not keep.any():
        return None
    idx = np.flatnonzero(keep)
    distinct = tuple(group.distinct[i] for i in idx)
    prefix = group.prefix
    if len(idx) == 1 and len(prefix):  # a group of one has an empty prefix (PrefixGroup)
        distinct, prefix = (np.concatenate([prefix, distinct[0]]),), prefix[:0]
    lens = None if group.output_lens is None else group.output_lens[idx]
    return dataclasses.replace(group, prefix=prefix, row_ids=group.row_ids[idx], distinct=distinct, output_lens=lens)


def _members(group: PrefixGroup, done: set[int]) -> Iterator[PrefixGroup]:
    """Each member not yet done, as a group of one (full prompt, no shared prefix)."""
    for i, row_id in enumerate(group.row_ids.tolist()):
        if row_id in done:
            continue
        yield PrefixGroup(
            group_id=group.group_id,
            prefix=group.prefix[:0],
            row_ids=group.row_ids[i : i + 1],
            distinct=(group.prompt(i),),
            output_lens=None if group.output_lens is None else group.output_lens[i : i + 1],
            replica=group.replica,
        )
