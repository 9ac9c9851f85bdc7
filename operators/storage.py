"""Where job files live: local paths or s3:// URIs, behind one fsspec filesystem.

S3 settings come from the job spec when given, otherwise from the usual AWS environment
variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION,
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL), which botocore reads itself. The options object is
small and plain so that it travels to Ray workers, which build their own filesystem.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixflow.operators.retry import RetryPolicy


def is_s3(path: str) -> bool:
    return str(path).startswith(("s3://", "s3a://"))


@dataclass(frozen=True)
class StorageOptions:
    """How to reach object storage. All None: the AWS environment decides."""

    endpoint_url: str | None = None
    region: str | None = None
    anonymous: bool = False
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    aws_session_token: str | None = None
    max_attempts: int = 5            # per S3 request (botocore) and per part write (with_retries)
    retry_base_delay_s: float = 0.2

    def __post_init__(self) -> None:
        # Checked here, so that a job spec (jobs/spec.py mirrors this class) and Python callers
        # get the same errors.
        if not 1 <= self.max_attempts <= 20:
            raise ValueError(f"StorageOptions.max_attempts={self.max_attempts!r} is invalid: "
                             "use 1 to 20 tries per storage request")
        if not 0 <= self.retry_base_delay_s <= 60:
            raise ValueError(f"StorageOptions.retry_base_delay_s={self.retry_base_delay_s!r} is "
                             "invalid: use a first backoff of 0 to 60 seconds")

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(max_attempts=self.max_attempts, base_delay_s=self.retry_base_delay_s)

    def endpoint(self) -> str | None:
        return (self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or None)

    def filesystem(self, path: str) -> Any:
        """An fsspec filesystem for `path` (s3fs for s3://, the local one otherwise)."""
        if not is_s3(path):
            import fsspec

            return fsspec.filesystem("file")
        import s3fs

        client_kwargs: dict[str, Any] = {}
        if self.endpoint():
            client_kwargs["endpoint_url"] = self.endpoint()
        region = self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            client_kwargs["region_name"] = region
        # A fresh instance: s3fs caches instances per argument set, and a cached one may carry
        # listings that are stale after another worker wrote a part.
        return s3fs.S3FileSystem(anon=self.anonymous, key=self.aws_access_key_id,
                                 secret=self.aws_secret_access_key, token=self.aws_session_token,
                                 client_kwargs=client_kwargs, skip_instance_cache=True,
                                 # botocore retries 5xx, throttling and dropped connections with
                                 # backoff on every request, reads included.
                                 config_kwargs={"retries": {"max_attempts": self.max_attempts,
                                                            "mode": "standard"}})


def absolute(path: str) -> str:
    """Local paths become absolute (Ray workers may run elsewhere); URIs stay as they are."""
    if is_s3(path):
        return str(path)
    return str(Path(path).expanduser().resolve())


def join(base: str, *parts: str) -> str:
    if is_s3(base):
        return posixpath.join(base.rstrip("/"), *parts)
    return str(Path(base, *parts))


def strip_scheme(path: str) -> str:
    """s3fs and fsspec accept both forms; listings come back without the scheme."""
    for scheme in ("s3://", "s3a://"):
        if path.startswith(scheme):
            return path[len(scheme):]
    return path


def with_scheme(original: str, listed: str) -> str:
    """Put the scheme of `original` back on a path that a listing returned."""
    if is_s3(original) and not is_s3(listed):
        return "s3://" + listed.lstrip("/")
    return listed


def list_input_files(path: str | list[str], storage: StorageOptions,
                     suffixes: tuple[str, ...] = ()) -> list[str]:
    """Expand files, directories (their files, sorted, recursively) and globs into file paths.

    Raises ValueError naming the path when nothing is found, so a typo fails before any work.
    """
    paths = [path] if isinstance(path, str) else list(path)
    found: list[str] = []
    for p in paths:
        p = absolute(p)
        fs = storage.filesystem(p)
        if any(ch in p for ch in "*?["):
            matches = sorted(fs.glob(strip_scheme(p)))
        elif fs.isdir(strip_scheme(p)):
            matches = sorted(f for f in fs.find(strip_scheme(p))
                             if not posixpath.basename(f).startswith(("_", ".")))
            if suffixes:
                matches = [f for f in matches if f.endswith(suffixes)] or matches
        elif fs.exists(strip_scheme(p)):
            matches = [strip_scheme(p)]
        else:
            matches = []
        if not matches:
            raise ValueError(f"input.path={p!r} matches no file: check the path (and, for "
                             "s3://, the bucket, endpoint and credentials)")
        found.extend(with_scheme(p, m) for m in matches)
    return found
