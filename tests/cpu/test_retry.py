"""prefixflow/retry.py: which storage errors are retried, how long it waits, and what a
persistent failure says (tenacity runs the loop)."""

from __future__ import annotations

import pytest

from prefixflow.retry import RetryPolicy, with_retries


def _failing(errors: list[BaseException], result: str = "ok"):
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result

    return fn, calls


def test_transient_errors_are_retried_with_full_jitter_backoff():
    sleeps: list[float] = []
    fn, calls = _failing([ConnectionResetError("reset"), TimeoutError("slow"), OSError("503")])
    policy = RetryPolicy(max_attempts=5, base_delay_s=0.2, max_delay_s=0.5)
    assert with_retries(fn, "write x", policy, sleep=sleeps.append) == "ok" and len(calls) == 4
    # before try k + 2: uniform in [0, min(max, base * 2**k)]
    assert len(sleeps) == 3 and all(0 <= d <= cap for d, cap in zip(sleeps, [0.2, 0.4, 0.5]))


@pytest.mark.parametrize(
    "error", [FileNotFoundError("no key"), PermissionError("denied"), IsADirectoryError("dir"), ValueError("a bug")]
)
def test_permanent_errors_fail_at_once_as_they_are(error):
    sleeps: list[float] = []
    fn, calls = _failing([error])
    with pytest.raises(type(error)) as raised:
        with_retries(fn, "write x", RetryPolicy(), sleep=sleeps.append)
    assert raised.value is error and len(calls) == 1 and sleeps == []


def test_a_persistent_failure_says_what_and_how_to_finish():
    sleeps: list[float] = []
    last = ConnectionError("connection dropped")
    fn, calls = _failing([OSError("first")] * 2 + [last])
    with pytest.raises(OSError) as raised:
        with_retries(fn, "write s3://b/out/part-1.jsonl", RetryPolicy(max_attempts=3), sleep=sleeps.append)
    assert str(raised.value) == (
        "storage: write s3://b/out/part-1.jsonl failed 3 times, last error: ConnectionError: "
        "connection dropped. Parts committed so far are kept: fix storage and rerun with "
        "output.resume: true"
    )
    assert raised.value.__cause__ is last and len(calls) == 3 and len(sleeps) == 2
