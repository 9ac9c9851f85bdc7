"""One OpenAI-compatible server, as a replica's engine talks to it: JSON POSTs paced to `qps`,
retried with exponential backoff on what a busy or restarting server answers (429, 408, any 5xx,
a refused, reset or timed-out connection; a Retry-After header is honoured), and a clear error
for everything else (the row's error record: the server's own message, the status, the URL).

Standard library only (urllib): the engine actor needs nothing the job does not install.
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

RETRIED_STATUSES = frozenset({408, 429})  # and every 5xx
CONNECTION_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException)


class RequestFailed(Exception):
    """A request the server refused, or that failed every retry: the row's error record."""


class Endpoint:
    """One server (`base`: its URL ending in /v1). Thread-safe: the engine's request threads
    share it. `retries` counts the retried attempts (429/408/5xx/connection). Raises
    ValueError when api_key_env names a variable that is not set here."""

    def __init__(self, base: str, config: HttpConfig, sleep: Callable[[float], None] = time.sleep):
        self.base, self.config, self.sleep = base, config, sleep
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if config.api_key_env is not None:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ValueError(
                    f"engine.http.api_key_env={config.api_key_env!r}: the variable is not set where the engine "
                    "runs; set it there (ProcessorConfig.runtime_env={'env_vars': {...}}) or leave api_key_env out"
                )
            self.headers["Authorization"] = f"Bearer {key}"
        self.retries = 0
        self._lock = threading.Lock()
        self._next_start = 0.0  # time.monotonic() before which no request starts (qps)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to base + path; the answer's JSON. RequestFailed when the server refuses
        it (a 4xx other than 408/429, or an answer that is not JSON) or after max_retries."""
        return self._request(path, json.dumps(body).encode())

    def served_models(self) -> list[str]:
        """The model names the server serves (GET /models), retried as a POST is."""
        answer = self._request("/models", None)
        data = answer.get("data")
        return [str(m.get("id")) for m in data if isinstance(m, dict)] if isinstance(data, list) else []

    def _request(self, path: str, data: bytes | None) -> dict[str, Any]:
        """POST `data` (GET when None) with the retries; the answer's JSON."""
        for attempt in range(self.config.max_retries + 1):
            self._wait_turn()
            status, text, retry_after = self._send(path, data)
            if status == 200:
                try:
                    answer: dict[str, Any] = json.loads(text)
                    return answer
                except ValueError:
                    raise RequestFailed(f"{self.base}{path} answered 200 with a body that is not JSON: {text[:200]!r}")
            if status is not None and status not in RETRIED_STATUSES and status < 500:
                raise RequestFailed(f"{self.base}{path} refused the request: HTTP {status}: {_message(text)}")
            if attempt == self.config.max_retries:
                break
            with self._lock:
                self.retries += 1
            wait = min(self.config.backoff_s * 2**attempt, MAX_BACKOFF_S)
            self.sleep(min(max(wait, retry_after or 0.0), MAX_BACKOFF_S))
        what = f"HTTP {status}: {_message(text)}" if status is not None else text
        attempts = self.config.max_retries + 1
        raise RequestFailed(f"{self.base}{path} failed ({what}) after {attempts} attempt{'s' if attempts > 1 else ''}")

    def _send(self, path: str, data: bytes | None) -> tuple[int | None, str, float | None]:
        """(status, body text, Retry-After seconds) of one attempt (GET when data is None);
        status None: no answer (the text says why)."""
        method = "GET" if data is None else "POST"
        request = urllib.request.Request(f"{self.base}{path}", data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as answer:
                return answer.status, answer.read().decode("utf-8", "replace"), None
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace"), _seconds(e.headers.get("Retry-After"))
        except CONNECTION_ERRORS as e:
            return None, f"no answer: {e}", None

    def _wait_turn(self) -> None:
        """Start requests at most `qps` a second (evenly spaced)."""
        if self.config.qps is None:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_start)
            self._next_start = start + 1.0 / self.config.qps
        if start > now:
            self.sleep(start - now)


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
