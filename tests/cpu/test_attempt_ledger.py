"""The rules for engine actors that keep dying (operators/stages/attempts.py), decided without Ray."""

from __future__ import annotations

import pytest

from prefixflow.operators.stages.attempts import ERRORS_ITEM, AttemptLedger, EnginesKeepDying


def test_a_replica_dying_without_progress_is_given_up_after_its_retries():
    ledger = AttemptLedger(max_retries=1)
    assert ledger.record_failure([0], {}, 0, "killed") == []  # streak 1
    assert ledger.record_failure([0], {}, 0, "killed") == [0]  # streak 2 > 1: give up
    assert ledger.streaks == {}


def test_progress_ends_a_streak():
    ledger = AttemptLedger(max_retries=1)
    assert ledger.record_failure([0], {}, 0, "x") == []
    assert ledger.record_failure([0], {0: 4}, 4, "x") == []  # it committed rows: streak 0
    assert ledger.record_failure([0], {}, 4, "x") == []  # streak 1 again
    assert ledger.record_failure([0], {}, 4, "x") == [0]


def test_only_the_failing_replica_is_given_up_while_others_progress():
    ledger = AttemptLedger(max_retries=2)
    given = []
    for _ in range(3):  # replica 1 dies each time; replica 0 commits a little every attempt
        given += ledger.record_failure([1], {0: 2}, 10, "x")
    assert given == [1]


def test_a_success_elsewhere_does_not_end_the_streak_of_the_dying_replica():
    ledger = AttemptLedger(max_retries=0)
    assert ledger.record_failure([1], {0: 5, ERRORS_ITEM: 3}, 8, "x") == [1]


def test_deaths_before_any_work_fail_the_job_after_the_retries():
    ledger = AttemptLedger(max_retries=1)
    assert ledger.record_failure([], {}, 6, "ActorDiedError: init") == []
    with pytest.raises(EnginesKeepDying, match="before loading the model.*6 committed rows are kept"):
        ledger.record_failure([], {}, 6, "ActorDiedError: init")


def test_deaths_before_work_are_forgiven_when_anything_commits():
    ledger = AttemptLedger(max_retries=1)
    for _ in range(5):
        assert ledger.record_failure([], {1: 2}, 6, "x") == []


def test_error_records_that_cannot_be_written_fail_the_job():
    ledger = AttemptLedger(max_retries=0)
    with pytest.raises(EnginesKeepDying, match="while writing error records.*output.resume: true"):
        ledger.record_failure([ERRORS_ITEM], {}, 3, "x")


def test_two_replicas_dying_together_are_given_up_together():
    ledger = AttemptLedger(max_retries=0)
    assert ledger.record_failure([1, 0], {}, 0, "node lost") == [0, 1]
