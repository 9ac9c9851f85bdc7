"""Retries with exponential backoff for transient storage errors (tenacity does the retrying).

Two layers: botocore retries each S3 request itself (standard mode: 5xx, throttling, dropped
connections; set up in prefixflow/storage.py), and `with_retries` repeats a whole operation
(a part's PUT, a rename) that still failed. Errors that retrying cannot fix (no such bucket or
key, access denied) fail at once. A persistent failure raises an OSError that says what failed
and that committed parts are kept, so `output.resume: true` finishes the job later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    import tenacity

T = TypeVar("T")
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 5  # tries of one operation, the first included
    base_delay_s: float = 0.2  # backoff: base * 2**k with full jitter, capped
    max_delay_s: float = 5.0

    def retrying(self, sleep: Callable[[float], None] = time.sleep) -> tenacity.Retrying:
        """tenacity's loop for this policy: transient errors only, full-jitter backoff
        (AWS's "Full Jitter": uniform in [0, min(max, base * 2**k)] before try k + 2).
        tenacity is imported here, not with the module: the engine reaches this module through
        model_source, and the GPU machine runs the engine without tenacity installed."""
        import tenacity

        return tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts),
            wait=tenacity.wait_random_exponential(multiplier=self.base_delay_s, max=self.max_delay_s),
            retry=tenacity.retry_if_exception(is_transient),
            sleep=sleep,
        )


def is_transient(error: BaseException) -> bool:
    return isinstance(error, (OSError, TimeoutError)) and not isinstance(error, PERMANENT)


def with_retries(
    fn: Callable[[], T], what: str, policy: RetryPolicy = RetryPolicy(), sleep: Callable[[float], None] = time.sleep
) -> T:
    """Call fn until it succeeds, a permanent error occurs (raised as it is), or the attempts
    run out (an OSError naming `what`, the attempts and the last error)."""
    import tenacity

    try:
        return policy.retrying(sleep)(fn)
    except tenacity.RetryError as e:
        last = e.last_attempt.exception()
        raise OSError(
            f"storage: {what} failed {policy.max_attempts} times, last error: "
            f"{type(last).__name__}: {last}. Parts committed so far are kept: fix "
            "storage and rerun with output.resume: true"
        ) from last
