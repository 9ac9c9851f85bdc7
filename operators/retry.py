"""Retries with exponential backoff for transient storage errors.

Two layers: botocore retries each S3 request itself (standard mode: 5xx, throttling, dropped
connections; set up in operators/storage.py), and `with_retries` repeats a whole operation
(a part's PUT, a rename) that still failed. Errors that retrying cannot fix (no such bucket or
key, access denied) fail at once. A persistent failure raises an OSError that says what failed
and that committed parts are kept, so `output.resume: true` finishes the job later.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 5      # tries of one operation, the first included
    base_delay_s: float = 0.2  # backoff: base * 2**k with full jitter, capped
    max_delay_s: float = 5.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** attempt))


def is_transient(error: BaseException) -> bool:
    return isinstance(error, (OSError, TimeoutError)) and not isinstance(error, PERMANENT)


def with_retries(fn: Callable[[], T], what: str, policy: RetryPolicy = RetryPolicy()) -> T:
    """Call fn until it succeeds, a permanent error occurs, or the attempts run out."""
    for attempt in range(policy.max_attempts):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified right below
            if not is_transient(e):
                raise
            if attempt + 1 == policy.max_attempts:
                raise OSError(f"storage: {what} failed {policy.max_attempts} times, last error: "
                              f"{type(e).__name__}: {e}. Parts committed so far are kept: fix "
                              "storage and rerun with output.resume: true") from e
            time.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")
