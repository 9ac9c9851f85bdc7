"""A file's sha256, read once per machine while the file stays the same (torch-free).

prefixflow/model_source.py fingerprints a model folder with it, so that a resumed job can tell
that the weights behind a path changed (operators/results/commit.py). A digest is remembered under
$PREFIXFLOW_CACHE/sha256 (prefixflow/paths.py), and nothing a user can cheaply do makes a
remembered digest stand for other bytes (issue 43):
  - the entry's key is what the file's owner cannot set back: path, device, inode, size, mtime
    *and ctime*. Rewriting weights in place and restoring their mtime (`touch -r`, os.utime)
    moves the ctime, which only the kernel sets, so the file is read again;
  - the entry proves itself: it holds its key and digest with an HMAC of both under a secret of
    this machine's cache (`sha256/.key`, readable by its owner only), so an entry edited by
    hand, or copied under another file's key, fails the check and the file is read again;
  - a file changed within the last RACY_SECONDS is read but not remembered: on a file system
    with coarse timestamps a second change within the same tick would keep its ctime (git's
    "racy" entries), and a file that changes while it is read is not remembered either.

Why remember at all rather than hash on every run: sha256 reads about 1.0 GB/s from the page
cache and 0.6 GB/s from disk on this project's machines (a 2 GiB file: 2.1 s hot, 3.5 s cold, on
one core), so hashing a 16 GB model on every start and resume would cost 15-26 s (a 140 GB one
2-4 minutes) before any row runs. With the cache that is paid once per change of the weights,
and a stale digest needs someone who reads the cache's secret and forges an entry with it, not
a copy, a touch or an edit.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefixflow.paths import cache_root

RACY_SECONDS = 2.0  # the coarsest timestamp granularity of common file systems (FAT, some NFS)
_BAR_BYTES = 1 << 30  # a progress bar only where hashing takes a while


@dataclass(frozen=True)
class _Key:
    """What must stay the same for a remembered digest to hold."""

    path: str
    dev: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @staticmethod
    def of(path: Path) -> _Key:
        st = path.stat()
        return _Key(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def file_sha256(path: Path) -> str:
    """The sha256 of the file at `path` (symlinks followed), remembered as the module says."""
    real = path.resolve()
    key = _Key.of(real)
    if time.time_ns() - key.ctime_ns < RACY_SECONDS * 1e9:
        return _read(real, key.size)
    folder = cache_root() / "sha256"
    entry = folder / hashlib.sha256(key.text().encode()).hexdigest()
    secret = _secret(folder)
    digest = _recall(entry, key, secret) if secret else None
    if digest is None:
        digest = _read(real, key.size)
        if secret and _Key.of(real) == key:  # unchanged while it was read
            _remember(entry, key, digest, secret)
    return digest


def _mac(secret: bytes, key: _Key, digest: str) -> str:
    return hmac.new(secret, f"{key.text()}\0{digest}".encode(), hashlib.sha256).hexdigest()


def _recall(entry: Path, key: _Key, secret: bytes) -> str | None:
    """The entry's digest when the entry is for `key` and its HMAC holds; else None."""
    try:
        record = json.loads(entry.read_text(encoding="utf-8"))
        digest, mac = record["sha256"], record["hmac"]
        if record["key"] != json.loads(key.text()) or not isinstance(digest, str):
            return None
    except (OSError, ValueError, KeyError, TypeError):  # missing, damaged or of another format
        return None
    return digest if isinstance(mac, str) and hmac.compare_digest(mac, _mac(secret, key, digest)) else None


def _remember(entry: Path, key: _Key, digest: str, secret: bytes) -> None:
    record = {"key": json.loads(key.text()), "sha256": digest, "hmac": _mac(secret, key, digest)}
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}")
    try:  # a cache that cannot be written (a read-only home) only costs a second read later
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, entry)
    except OSError:
        tmp.unlink(missing_ok=True)


def _secret(folder: Path) -> bytes | None:
    """This cache's HMAC secret, made once (None where the cache cannot be written: then
    nothing is remembered). Created under a temporary name and linked into place, so that
    processes starting together agree on one secret and never read half of one."""
    path = folder / ".key"
    try:
        if not path.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".key.{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(tmp, path)  # fails if another process linked its secret first
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        secret = path.read_bytes()
    except OSError:
        return None
    return secret if len(secret) == 32 else None


def _read(path: Path, size: int) -> str:
    from tqdm import tqdm  # the bar's package, only when a file is read

    h = hashlib.sha256()
    with (
        open(path, "rb") as f,
        tqdm(
            total=size, unit="B", unit_scale=True, leave=False, desc=f"sha256 {path.name}", disable=size < _BAR_BYTES
        ) as bar,
    ):
        while chunk := f.read(1 << 24):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()
