"""`engine.http`: the OpenAI-compatible servers a job's plan is sent to (torch-free, checked in
the driver before anything starts).

    engine:
      backend: http
      http:
        endpoints: [http://10.0.0.1:8000, http://10.0.0.2:8000]   # one replica each
        model: my-served-name        # the name the servers serve (default: the job's model)
        api_key_env: OPENAI_API_KEY  # the NAME of an environment variable holding the key
        max_concurrency: 64          # requests in flight per endpoint
        qps: 20                      # requests started per second per endpoint (none: no limit)
        max_retries: 5               # for 429, 408, 5xx and refused or dropped connections
        backoff_s: 1.0               # the first wait; doubled each retry, at most 60 s
        timeout_s: 600               # one request's limit
        token_ids: true              # ask for vLLM's `return_token_ids`

One replica per endpoint: the plan's partition r goes to endpoints[r], in plan order, so the
requests that share a prefix reach the server whose prefix cache holds it. The job's `model` is
still read where the job runs: its tokenizer tokenizes the rows for the plan (the servers get
token ids), so it must be the served model's tokenizer. The key is never written in a spec: the
engine actors read the variable (ProcessorConfig.runtime_env can set it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from prefixflow.errors import did_you_mean, invalid

Problem = tuple[str, Any, str]  # (field path from the top, value, fix)
MAX_BACKOFF_S = 60.0  # the longest wait before a retry (a Retry-After above it waits this long)
MAX_CONCURRENCY = 1024  # requests in flight per endpoint: one thread each
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
OWNER = "engine.http"


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """engine.http, checked (see the module docstring for each field)."""

    endpoints: tuple[str, ...]
    model: str | None = None
    api_key_env: str | None = None
    max_concurrency: int = 64
    qps: float | None = None
    max_retries: int = 5
    backoff_s: float = 1.0
    timeout_s: float = 600.0
    token_ids: bool = True

    def __post_init__(self) -> None:
        problems = http_problems({f.name: getattr(self, f.name) for f in fields(self)})
        if problems:
            name, value, fix = problems[0]
            raise invalid(OWNER, name.removeprefix(f"{OWNER}."), value, fix)
        object.__setattr__(self, "endpoints", tuple(base_url(e) for e in self.endpoints))

    @classmethod
    def of(cls, settings: dict[str, Any]) -> HttpConfig:
        """The HttpConfig of a job's engine.http mapping (checked by http_problems first)."""
        given = dict(settings)
        given["endpoints"] = tuple(given.get("endpoints") or ())
        return cls(**given)


def base_url(endpoint: str) -> str:
    """An endpoint as the base its paths hang from: no trailing slash, ending in /v1."""
    url = endpoint.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def http_problems(settings: Any) -> list[Problem]:
    """(field, value, fix) for each engine.http setting that cannot run, every one."""
    if not isinstance(settings, dict):
        return [(OWNER, settings, "give a mapping with endpoints: [http://host:port, ...]")]
    known = {f.name for f in fields(HttpConfig)}
    problems: list[Problem] = [
        (f"{OWNER}.{k}", v, did_you_mean(k, known) or f"not a setting: use {', '.join(sorted(known))}")
        for k, v in settings.items()
        if k not in known
    ]
    problems += _endpoint_problems(settings.get("endpoints"))
    for name, value, fix in _number_problems(settings):
        problems.append((f"{OWNER}.{name}", value, fix))
    for name in ("model", "api_key_env"):
        value = settings.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            problems.append((f"{OWNER}.{name}", value, "give a non-empty string, or leave it out"))
    key = settings.get("api_key_env")
    if isinstance(key, str) and key and not ENV_NAME.fullmatch(key):  # a pasted key is never echoed
        problems.append(
            (f"{OWNER}.api_key_env", "<hidden>", "give the NAME of the environment variable that holds the key")
        )
    if not isinstance(settings.get("token_ids", True), bool):
        problems.append((f"{OWNER}.token_ids", settings["token_ids"], "use true or false"))
    return problems


def _endpoint_problems(endpoints: Any) -> list[Problem]:
    """Each endpoint an http(s) URL with a host, a valid port and no path but /v1; one that
    carries credentials or a query is never echoed (either may hold a key)."""
    name = f"{OWNER}.endpoints"
    if not isinstance(endpoints, (list, tuple)) or not endpoints:
        return [(name, endpoints, "give a list of server URLs, one replica each: [http://host:8000, ...]")]
    problems: list[Problem] = []
    for i, e in enumerate(endpoints):
        fix = _url_fix(e)
        if fix is not None:
            secret = isinstance(e, str) and ("@" in e or "?" in e)
            problems.append((f"{name}[{i}]", "<hidden>" if secret else e, fix))
    if not problems and len({base_url(e) for e in endpoints}) < len(endpoints):
        problems.append((name, f"{len(endpoints)} URLs", "list each server once (one replica each)"))
    return problems


def _url_fix(endpoint: Any) -> str | None:
    """What is wrong with one endpoint URL (None: nothing)."""
    try:
        parts = urlsplit(endpoint) if isinstance(endpoint, str) else None
        port = parts.port if parts is not None else None  # raises for a port that is not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        return "give an http:// or https:// URL with a host, e.g. http://10.0.0.1:8000"
    if parts.username or parts.password:
        return "give the URL without credentials (a key goes in api_key_env)"
    if parts.query or parts.fragment:
        return "give the server's base URL, without a query"
    if parts.path.rstrip("/") not in ("", "/v1"):
        return f"give the server's base URL (http://host:{port or 8000} or .../v1), not a path under it"
    return None


def _number_problems(settings: dict[str, Any]) -> list[Problem]:
    """max_concurrency >= 1 and max_retries >= 0 (integers); qps and timeout_s above 0,
    backoff_s at least 0 (numbers); qps may be null (no limit)."""
    problems: list[Problem] = []
    for name, integer, positive in (
        ("max_concurrency", True, True),  # at most MAX_CONCURRENCY (threads)
        ("max_retries", True, False),
        ("qps", False, True),
        ("backoff_s", False, False),
        ("timeout_s", False, True),
    ):
        if name not in settings or (name == "qps" and settings[name] is None):
            continue
        value = settings[name]
        number = isinstance(value, int) if integer else isinstance(value, (int, float))
        if name == "max_concurrency" and number and not isinstance(value, bool) and value > MAX_CONCURRENCY:
            problems.append((name, value, f"give at most {MAX_CONCURRENCY} (one thread each)"))
        elif (
            not number or isinstance(value, bool) or not math.isfinite(value) or value < 0 or (positive and value <= 0)
        ):
            problems.append(
                (
                    name,
                    value,
                    f"give {'an integer' if integer else 'a number'} {'above 0' if positive else 'of at least 0'}",
                )
            )
    return problems
