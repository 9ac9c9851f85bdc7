"""One OpenAI-compatible server, as a replica's engine talks to it: JSON requests retried with
exponential backoff on what a busy or restarting server answers (429, 408, any 5xx, a refused,
reset or timed-out connection; a Retry-After header is honoured up to MAX_BACKOFF_S), started
at most `qps` a second.

Who is to blame decides what a failure becomes. A refusal of the request itself (400, 413,
422, ...: a prompt longer than the server's context) is the row's: RequestFailed, its error
record, with the server's own message. A server that refuses the key or the model (401, 403,
404), or that still fails when the retries are spent and no longer answers GET /models, is no
row's: EndpointDown (an EngineUnavailable), which stops the run with the committed rows kept for
resume, instead of committing every row left as an error. Retries spent on a server that does
answer /models blame the row (a request that makes it fail, every time).

Standard library only (urllib), and no redirects followed: a redirect would carry the key to
another host, and turn a POST into a GET.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from prefixflow.engine.http_backend.config import MAX_BACKOFF_S, HttpConfig
from prefixflow.engine.outputs import EngineUnavailable

RETRIED_STATUSES = frozenset({408, 429})  # and every 5xx
ENDPOINT_STATUSES = frozenset({401, 403, 404})  # the key, the model or the URL: no row's fault
NO_ANSWER = (OSError, http.client.HTTPException)  # URLError, timeouts, resets, TLS errors


class RequestFailed(Exception):
    """A request the server refused, or that failed every retry while the server answers
    otherwise: the row's error record. status: the last HTTP status (None: no answer)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class EndpointDown(EngineUnavailable):
    """The server refuses every request (the key, the model) or no longer answers. status:
    the last HTTP status (None: no answer)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the 3xx answer is then the answer: a refusal naming it


_OPENER = urllib.request.build_opener(_NoRedirects)


class Endpoint:
    """One server (`base`: its URL ending in /v1). Thread-safe: the engine's request threads
    share it. `retries` counts the retried attempts. `stop()` ends the waits of requests in
    flight (they fail at once). Raises ValueError when api_key_env names a variable that is not
    set here."""

    def __init__(self, base: str, config: HttpConfig, sleep: Callable[[float], Any] | None = None):
        self.base, self.config = base, config
        self._stopped = threading.Event()
        self.sleep = sleep or self._stopped.wait
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if config.api_key_env is not None:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ValueError(
                    f"engine.http.api_key_env={config.api_key_env}: the variable is not set where the engine runs; "
                    "set it in the environment of every node (ray start) or, with the Python API, in "
                    "ProcessorConfig.runtime_env={'env_vars': {...}}; or leave api_key_env out"
                )
            self.headers["Authorization"] = f"Bearer {key}"
        self.retries = 0
        self._lock = threading.Lock()
        self._next_start = 0.0  # time.monotonic() before which no request starts (qps)

    def post(self, path: str, body: dict[str, Any], turn_taken: bool = False) -> dict[str, Any]:
        """POST `body` to base + path; the answer's JSON (see the module docstring for what a
        failure raises: RequestFailed or EndpointDown). turn_taken: the caller took the first
        attempt's start slot (take_turn)."""
        return self._request(path, json.dumps(body).encode(), turn_taken)

    def served_models(self) -> list[str]:
        """The model names the server serves (GET /models), retried as a POST is."""
        answer = self._request("/models", None)
        data = answer.get("data")
        return [str(m.get("id")) for m in data if isinstance(m, dict)] if isinstance(data, list) else []

    def take_turn(self) -> float:
        """0.0, taking a start slot, when a request may start now under `qps`; else the seconds
        until one may (nothing taken)."""
        if self.config.qps is None:
            return 0.0
        with self._lock:
            now = time.monotonic()
            if self._next_start > now:
                return self._next_start - now
            self._next_start = now + 1.0 / self.config.qps
            return 0.0

    def stop(self) -> None:
        self._stopped.set()

    def _request(self, path: str, data: bytes | None, turn_taken: bool = False) -> dict[str, Any]:
        """POST `data` (GET when None) with the retries; the answer's JSON."""
        status: int | None = None
        text = ""
        for attempt in range(self.config.max_retries + 1):
            if attempt > 0 or not turn_taken:
                self._wait_turn()
            status, text, retry_after = self._send(path, data)
            if status == 200:
                try:
                    answer: dict[str, Any] = json.loads(text)
                    return answer
                except ValueError:
                    raise RequestFailed(f"{self.base}{path} answered 200 with a body that is not JSON: {text[:200]!r}")
            if status in ENDPOINT_STATUSES:
                raise EndpointDown(
                    f"{self.base}{path} refused it: HTTP {status}: {_message(text)}{_hint(status)}", status
                )
            if status is not None and status not in RETRIED_STATUSES and status < 500:
                raise RequestFailed(f"{self.base}{path} refused the request: HTTP {status}: {_message(text)}", status)
            if attempt == self.config.max_retries or self._stopped.is_set():
                break
            with self._lock:
                self.retries += 1
            wait = min(self.config.backoff_s * 2**attempt, MAX_BACKOFF_S)
            self.sleep(min(max(wait, retry_after or 0.0), MAX_BACKOFF_S))
        attempts = self.config.max_retries + 1
        what = f"HTTP {status}: {_message(text)}" if status is not None else text
        failed = f"{self.base}{path} failed ({what}) after {attempts} attempt{'s' if attempts > 1 else ''}"
        if data is not None and not self._stopped.is_set() and self._answers():
            raise RequestFailed(f"{failed}; the server answers otherwise: this request fails there", status)
        raise EndpointDown(failed, status)

    def _answers(self) -> bool:
        """Whether the server answers GET /models now (one try)."""
        return self._send("/models", None)[0] == 200

    def _send(self, path: str, data: bytes | None) -> tuple[int | None, str, float | None]:
        """(status, body text, Retry-After seconds) of one attempt (GET when data is None);
        status None: no answer (the text says why)."""
        method = "GET" if data is None else "POST"
        request = urllib.request.Request(f"{self.base}{path}", data=data, headers=self.headers, method=method)
        try:
            with _OPENER.open(request, timeout=self.config.timeout_s) as answer:
                return answer.status, answer.read().decode("utf-8", "replace"), None
        except urllib.error.HTTPError as e:
            try:
                body = e.read().decode("utf-8", "replace")
            except NO_ANSWER:
                body = ""
            return e.code, body, _seconds(e.headers.get("Retry-After") if e.headers else None)
        except NO_ANSWER as e:
            return None, f"no answer: {type(e).__name__}: {e}", None

    def _wait_turn(self) -> None:
        """Take the next start slot under `qps` and wait for it."""
        if self.config.qps is None:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_start)
            self._next_start = start + 1.0 / self.config.qps
        if start > now:
            self.sleep(start - now)


def _hint(status: int) -> str:
    if status in (401, 403):
        return " (check the key: engine.http.api_key_env)"
    return " (check engine.http.model and the endpoint's URL)"


def _message(text: str) -> str:
    """The server's error message from an OpenAI-style error body, else the body's start."""
    try:
        body = json.loads(text)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message") if isinstance(error, dict) else None
        if message:
            return str(message)[:500]
    except ValueError:
        pass
    return text[:500]


def _seconds(value: str | None) -> float | None:
    """A Retry-After header given in seconds (an HTTP date is ignored: the backoff applies)."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
