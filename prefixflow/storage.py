"""Where job files live: local paths, or any URL fsspec knows, behind one fsspec filesystem.

Every path a job reads or writes (input, output and its commit protocol, the model, plan
files) goes through this module. A path is
  - local: a plain path, or a `file://` URL (fsspec's local filesystem);
  - `s3://` (s3fs), `gs://` (gcsfs), `abfss://` / `az://` (adlfs) or any other scheme that
    fsspec knows, through that scheme's driver package, which must be installed on every node;
  - `dbfs:/x`: on a Databricks node the same file as `/dbfs/x` (the DBFS mount every node of a
    Databricks cluster has), so it is used as that local path.
A scheme fsspec does not know, or whose driver package is missing, is a ValueError naming the
package to install (`check_scheme`): preflight reports it before any work. So is a scheme the
job's Ray workers cannot share or write (`check_shared`): memory:// lives in one process, and
http(s)://, zip://, github:// and the like are read-only (http(s) input is read file by file).

Every path is put in one form by `normal_path` before it is checked, compared or written:
schemes case-folded (FILE:// is file://), local paths absolute with `~`, `..` and symbolic links
resolved, an empty path refused. Messages show URLs through `masked` (no passwords or tokens).

S3 settings come from the fields below when given, otherwise from the usual AWS environment
variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION,
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL), which botocore reads itself. Other schemes take
their driver's keyword arguments from `options[scheme]`, else the driver's own environment
(GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_NAME, ...). The options object is small
and plain so that it travels to Ray workers, which build their own filesystem.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from prefixflow.errors import FieldProblem, invalid, require
from prefixflow.retry import RetryPolicy

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
# "s3:/b", "file:/x", "simplecache::s3://b": a scheme without its "//" (or a chained URL)
_BARE_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!//)")
LOCAL = ("file", "local")  # fsspec's names for the local filesystem
S3 = ("s3", "s3a")
# pyiceberg reads the catalog of a name from ~/.pyiceberg.yaml and PYICEBERG_CATALOG__<NAME>__*
# too: a name of our own, so that a spec never gets the machine's credentials for its catalog.
ICEBERG_CATALOG_NAME = "prefixflow"
DBFS_MOUNT = "/dbfs"
# The package that serves a scheme, where it is not fsspec itself: named in the error when it
# is missing (adlfs registers abfss only once installed, so fsspec alone does not know it).
DRIVERS = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "az": "adlfs",
    "adl": "adlfs",
    "oci": "ocifs",
    "hf": "huggingface_hub",
}


def protocol(path: str) -> str | None:
    """The URL scheme of `path` ("s3", "gs", "abfss", "file", ...), case-folded; None for a
    plain path."""
    match = _URL.match(str(path))
    if match:
        return match.group(1).lower()
    return "dbfs" if str(path).lower().startswith("dbfs:") else None


def _fold_scheme(path: str) -> str:
    """`path` with its scheme in lower case (schemes are case-insensitive; fsspec's are not)."""
    match = _URL.match(path) or _BARE_SCHEME.match(path)
    return path if match is None else match.group(1).lower() + path[len(match.group(1)) :]


def is_s3(path: str) -> bool:
    return protocol(path) in S3


def is_local(path: str) -> bool:
    """A plain path or a file:// URL: a filesystem with folders, renames and hard links."""
    return protocol(path) in (None, *LOCAL)


def local_path(path: str) -> str:
    """The plain path of a local path or file:// URL (a plain path is returned as it is)."""
    path = str(path)
    bare = _BARE_SCHEME.match(path)
    if protocol(path) is None and (bare is None or bare.group(1).lower() not in LOCAL):
        return path
    if not is_local(path):
        raise ValueError(f"{masked(path)!r} is not a local path")
    from fsspec.implementations.local import LocalFileSystem

    stripped: str = LocalFileSystem._strip_protocol(_fold_scheme(path))
    return stripped


def mount_dbfs(path: str) -> str:
    """`dbfs:/x` as `/dbfs/x` where this machine has the DBFS mount (a Databricks node); any
    other path as it is."""
    path = str(path)
    if protocol(path) != "dbfs" or not os.path.isdir(DBFS_MOUNT):
        return path
    return posixpath.join(DBFS_MOUNT, path[len("dbfs:") :].lstrip("/"))


def check_scheme(path: str) -> None:
    """Raise ValueError, naming the fix, when no filesystem here can serve `path`: a scheme
    fsspec does not know, or one whose driver package is not installed."""
    proto = protocol(path)
    if proto is None or proto in LOCAL:
        return
    shown = masked(path)
    if proto == "dbfs" and os.path.isdir(DBFS_MOUNT):  # a path that missed normal_path()
        raise ValueError(f"{shown!r}: give it as {mount_dbfs(path)!r} (the DBFS mount)")
    if proto == "dbfs":
        raise ValueError(
            f"{shown!r}: dbfs:/ paths are read through the {DBFS_MOUNT} mount of "
            f"Databricks nodes (dbfs:/x is {DBFS_MOUNT}/x there), and this machine "
            f"has no {DBFS_MOUNT}: run on Databricks, or give the URL of the storage "
            "behind it (abfss://, s3://, gs://)"
        )
    import fsspec
    from fsspec.registry import known_implementations

    try:
        fsspec.get_filesystem_class(proto)
        return
    except ImportError:
        pass
    except ValueError:  # "Protocol not known"
        if proto not in DRIVERS:
            raise ValueError(
                f"{shown!r}: {proto}:// is not a storage scheme fsspec knows: check "
                "the path (local paths and s3://, gs://, abfss://, az://, file:// "
                "and the other schemes of fsspec's registry work)"
            ) from None
    known = known_implementations.get(proto, {})
    package = DRIVERS.get(proto) or known.get("class", proto).split(".")[0]
    raise ValueError(
        f"{shown!r}: {proto}:// needs the package {package!r}, which is not "
        f"installed: `pip install {package}` on every node of the cluster"
    )


# Schemes fsspec serves that a job cannot use, and why. The job's readers, tokenizers and
# engine actors are Ray workers in processes of their own, on any node: every one of them must
# see the same files. (http(s) input is read file by file: `list_input_files`.)
NOT_SHARED = {"memory": "a filesystem inside one process: each Ray worker of the job would see its own, empty one"}
READ_ONLY = {
    "http": "fsspec's HTTP filesystem only reads",
    "https": "fsspec's HTTP filesystem only reads",
    "zip": "an archive is read-only here",
    "tar": "an archive is read-only here",
    "libarchive": "an archive is read-only here",
    "github": "a repository view is read-only",
    "git": "a repository view is read-only",
    "data": "a data: URL holds its bytes inline",
    "reference": "a reference filesystem is read-only",
}
HTTP = ("http", "https")
_S3_INSTANCES: dict[tuple, Any] = {}  # StorageOptions._s3's, by arguments, AWS_* environment, pid


def check_shared(path: str, writes: bool) -> None:
    """Raise ValueError, naming why and what to use, when the job's Ray workers cannot share
    `path` (memory://) or, with `writes`, cannot write it (http(s)://, zip://, github://, ...)."""
    proto = protocol(path)
    why = NOT_SHARED.get(proto or "") or (READ_ONLY.get(proto or "") if writes else None)
    if why is not None:
        use = "a local or shared folder, or object storage (s3://, gs://, abfss://, ...)"
        raise ValueError(f"{masked(path)!r}: {proto}:// cannot be used here ({why}): use {use}")


def normal_path(path: str) -> str:
    """The one form of a path that validate, the input/output clash checks, the readers and the
    writers all use: the scheme case-folded (FILE://x is file://x); a local path (plain,
    file://, or dbfs:/ on a Databricks node) absolute, with `~`, `..` and symbolic links
    resolved, so that two spellings of one folder are one path; other URLs as given (their
    keys are the store's own names). ValueError for an empty path, or a scheme without its
    "//" ("s3:/b", a chained "simplecache::s3://b"), which would be a local folder named "s3:"."""
    text = str(path)
    if not text.strip():
        raise ValueError("the path is empty: give a local path or a URL (s3://, gs://, file://, ...)")
    text = mount_dbfs(_fold_scheme(text))
    proto = protocol(text)
    bare = _BARE_SCHEME.match(text)
    if proto is None and bare is not None and bare.group(1) not in LOCAL:
        why = (
            "fsspec's chained URLs are not taken: give one scheme"
            if "::" in text
            else f"a URL needs '//' after its scheme: {bare.group(1)}://..."
        )
        raise ValueError(
            f"{masked(text)!r} is neither a URL nor a plain path ({why}; a local "
            "path whose first name holds a colon starts with ./)"
        )
    if proto is None and bare is None:
        return str(Path(text).expanduser().resolve())
    if proto is None or proto in LOCAL:  # file:/x, file://x, local://x
        return "file://" + str(Path(local_path(text)).resolve())
    return text


# user:password@ in a URL (or any user part of an http(s) URL: a token given as the user),
# and the values of query parameters that carry credentials (signatures, tokens, keys).
# (A scheme with fewer slashes than "//" too: "s3:/user:password@b" is echoed when refused.)
_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*:/*)([^/\s@:'\"]*):([^/\s@'\"]*)@")
_HTTP_USER = re.compile(r"(\bhttps?:/*)([^/\s@:'\"]+)@", re.IGNORECASE)
_SECRET_QUERY = re.compile(
    r"([?&][\w.-]*(?:sig|signature|token|secret|password|passwd|key|"
    r"credential)[\w.-]*=)[^&\s'\"#]+",
    re.IGNORECASE,
)


def masked(text: str) -> str:
    """`text` (a path, or a message that names URLs) with every URL's secrets replaced by ***:
    a password (user:password@), the user part of an http(s) URL (often a token), and query
    parameters such as sig=, X-Amz-Signature=, token=, api_key=. Every message and file that
    echoes a path shows it through this."""
    text = _PASSWORD.sub(r"\1\2:***@", str(text))
    text = _HTTP_USER.sub(r"\1***@", text)
    return _SECRET_QUERY.sub(r"\1***", text)


# s3fs tries each S3 call this many times (its default 5), each try being botocore's
# max_attempts with its own backoff: throttling and 5xx are botocore's to retry; s3fs's second
# try is for an answer whose body broke off mid-read, which botocore does not retry. At 5, a
# storage that stayed down took 5 x max_attempts requests per call (x max_attempts again for a
# part write): 20 refused PUTs at max_attempts 2 where the settings promised 4.
S3FS_TRIES = 2


@dataclass(frozen=True)
class StorageOptions:
    """How to reach object storage. All None: the AWS environment decides (S3); other schemes
    take their driver's arguments from `options`, else the driver's own environment."""

    endpoint_url: str | None = None
    region: str | None = None
    anonymous: bool = False
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    aws_session_token: str | None = None
    max_attempts: int = 5  # per S3 request (botocore) and per part write (with_retries)
    retry_base_delay_s: float = 0.2
    # {scheme: {argument: value}}: keyword arguments of that scheme's fsspec filesystem, e.g.
    # {"gs": {"project": "p"}, "abfss": {"account_name": "a"}}; for s3 over the fields above.
    options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Checked here, so that a job spec (jobs/spec.py mirrors this class) and Python callers
        # get the same errors.
        require(
            1 <= self.max_attempts <= 20,
            "StorageOptions",
            "max_attempts",
            self.max_attempts,
            "use 1 to 20 tries per storage request",
        )
        require(
            0 <= self.retry_base_delay_s <= 60,
            "StorageOptions",
            "retry_base_delay_s",
            self.retry_base_delay_s,
            "use a first backoff of 0 to 60 seconds",
        )
        bad = [k for k, v in self.options.items() if not isinstance(v, dict) or _URL.match(f"{k}://") is None]
        if bad:  # the scheme names the entry; its value stays out of the message (credentials)
            raise invalid(
                "StorageOptions",
                "options",
                {bad[0]: "..."},
                "give {scheme: {argument: value}}, e.g. {gs: {project: my-project}}",
            )

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(max_attempts=self.max_attempts, base_delay_s=self.retry_base_delay_s)

    def endpoint(self) -> str | None:
        return self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None

    def filesystem(self, path: str) -> Any:
        """An fsspec filesystem for `path`: the local one, s3fs, or the driver of its scheme.
        ValueError (check_scheme) where no installed driver serves the scheme."""
        check_scheme(path)
        proto = protocol(path)
        if proto is None or proto in LOCAL:
            import fsspec

            return fsspec.filesystem("file")
        if proto in S3:
            return self._s3(self.options.get(proto, {}))
        from fsspec.core import url_to_fs

        # A fresh instance: a cached one may carry listings that are stale after another worker
        # wrote a part. url_to_fs also reads arguments the URL carries (the account of
        # abfss://container@account.dfs.core.windows.net/...).
        fs, _ = url_to_fs(str(path), skip_instance_cache=True, **self.options.get(proto, {}))
        return fs

    def _s3(self, extra: dict[str, Any]) -> Any:
        """s3fs over botocore (see S3FS_TRIES), one instance per settings and process."""
        import s3fs

        client_kwargs: dict[str, Any] = {}
        if self.endpoint():
            client_kwargs["endpoint_url"] = self.endpoint()
        region = self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            client_kwargs["region_name"] = region
        kwargs = dict(
            anon=self.anonymous,
            key=self.aws_access_key_id,
            secret=self.aws_secret_access_key,
            token=self.aws_session_token,
            client_kwargs=client_kwargs,
            skip_instance_cache=True,
            # no listings cache: it would go stale when another worker writes a part
            use_listings_cache=False,
            # botocore retries 5xx, throttling and dropped connections with
            # backoff on every request, reads included.
            # (max_pool_connections: botocore's 10 would hold io_map's FETCH_THREADS requests to 10.)
            config_kwargs={
                "retries": {"max_attempts": self.max_attempts, "mode": "standard"},
                "max_pool_connections": FETCH_THREADS,
            },
        )
        kwargs.update(extra)
        # One instance per arguments, AWS_* environment and process: the botocore session and
        # client (their service models: a few tenths of a CPU-second) are made once, not for
        # every part, listing and record. The environment is part of the key because
        # credentials left out of the spec come from it (fsspec's own cache would keep an
        # instance made under credentials since removed).
        env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
        key = (os.getpid(), json.dumps(kwargs, sort_keys=True, default=repr), tuple(env))
        fs = _S3_INSTANCES.get(key)
        if fs is None:
            fs = _S3_INSTANCES[key] = s3fs.S3FileSystem(**kwargs)
            fs.retries = S3FS_TRIES
        return fs

    def arrow_filesystem(self, paths: list[str]) -> tuple[list[str], Any]:
        """(paths, filesystem) for Ray Data's readers: plain local paths as they are with None
        (Ray's own local filesystem); URLs without their scheme, with their fsspec filesystem
        wrapped as a pyarrow one. The paths must share one filesystem (same_filesystem)."""
        if all(protocol(p) is None for p in paths):
            return list(paths), None
        import pyarrow.fs as pafs

        fs = self.filesystem(paths[0])
        return [strip_scheme(p) for p in paths], pafs.PyFileSystem(pafs.FSSpecHandler(fs))

    def object_store_options(self, path: str) -> dict[str, str]:
        """The same settings for the table libraries built on Rust's object_store (deltalake,
        lance): their option names for S3. Other schemes: their own environment variables
        (object_store reads them) or `options` under the table format's name, e.g.
        {delta: {azure_storage_account_name: a}} (`table_options`)."""
        if protocol(path) not in S3:
            return {}
        given = {
            "aws_endpoint": self.endpoint(),
            "aws_region": self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
            "aws_access_key_id": self.aws_access_key_id,
            "aws_secret_access_key": self.aws_secret_access_key,
            "aws_session_token": self.aws_session_token,
            "aws_skip_signature": "true" if self.anonymous else None,
        }
        endpoint = given["aws_endpoint"] or ""
        if endpoint.startswith("http://"):  # object_store refuses plain HTTP unless told
            given["allow_http"] = "true"
        return {k: v for k, v in given.items() if v}

    def iceberg_catalog_properties(self, catalog: dict[str, Any]) -> dict[str, str]:
        """pyiceberg's catalog properties: a spec's `catalog` over these S3 settings as its
        FileIO properties."""
        given = {
            "s3.endpoint": self.endpoint(),
            "s3.region": self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
            "s3.access-key-id": self.aws_access_key_id,
            "s3.secret-access-key": self.aws_secret_access_key,
            "s3.session-token": self.aws_session_token,
            "s3.anonymous": "true" if self.anonymous else None,
        }
        own = {k: str(v) for k, v in catalog.items()}
        return {**{k: v for k, v in given.items() if v}, **own, "name": ICEBERG_CATALOG_NAME}

    def table_location(self, table_format: str, location: str) -> tuple[str, dict[str, str] | None]:
        """(URI, storage options) of a Delta or Lance table at `location`: normal_path's form, and
        object_store_options with what `options` gives under the table format's name (None:
        none, the library's own defaults)."""
        uri = normal_path(location)
        given = {k: str(v) for k, v in self.options.get(table_format, {}).items()}
        return uri, {**self.object_store_options(uri), **given} or None


def iceberg_catalog(catalog: dict[str, Any], storage: StorageOptions) -> Any:
    """The pyiceberg catalog that `catalog`'s properties describe (e.g. {type: sql, uri:
    "sqlite:///catalog.db", warehouse: "s3://bucket/warehouse"}, or {type: rest, uri: ...})."""
    from pyiceberg.catalog import load_catalog

    properties = storage.iceberg_catalog_properties(catalog)
    return load_catalog(properties.pop("name"), **properties)


def same_filesystem(paths: list[str]) -> bool:
    """Whether one filesystem serves all `paths` (one scheme; and one account, for URLs that
    name it before the first '/')."""

    def key(p: str) -> tuple[str, str]:
        if is_local(p):
            return ("file", "")
        authority = p.split("://", 1)[-1].split("/", 1)[0]
        return (protocol(p) or "", authority.split("@", 1)[1] if "@" in authority else "")

    return len({key(p) for p in paths}) <= 1


FETCH_THREADS = 16  # object storage requests at once (s3fs runs them on one event loop)

T = TypeVar("T")
R = TypeVar("R")


def io_map(fn: Callable[[T], R], items: list[T], local: bool) -> list[R]:
    """`fn` of each item, in order: in turn on the local disk, FETCH_THREADS at once on object
    storage, where each request waits a round trip (a resume reads every commit record, a job
    every parquet footer)."""
    if local or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(len(items), FETCH_THREADS)) as pool:
        return list(pool.map(fn, items))


def _protocols(fs: Any) -> tuple[str, ...]:
    """The schemes an fsspec filesystem serves (its `protocol`: one name or several)."""
    return tuple(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)


def on_local_disk(fs: Any) -> bool:
    """Whether `fs` is the local disk's (the paths an fsspec listing gives carry no scheme, so a
    path alone cannot tell)."""
    return "file" in _protocols(fs)


def cat_whole(fs: Any, path: str) -> bytes:
    """The whole file at `path`; on S3 in one request (s3fs first asks an object's size, a HEAD
    and so a second round trip, to split a large one into ranges, unless max_concurrency is 1):
    for the job's own small files, commit records and parts."""
    data: bytes = fs.cat_file(path, max_concurrency=1) if "s3" in _protocols(fs) else fs.cat_file(path)
    return data


def cat_all(fs: Any, paths: list[str]) -> list[bytes]:
    """cat_whole of each of `paths`, in order: at once on object storage (io_map)."""
    return io_map(lambda p: cat_whole(fs, p), paths, on_local_disk(fs))


def cat_each(fs: Any, paths: list[str]) -> Iterator[bytes]:
    """cat_whole of each of `paths`, in order, FETCH_THREADS fetched at once: no more than that
    many files' bytes held (a job's parts, read to assemble its output)."""
    for start in range(0, len(paths), FETCH_THREADS):
        yield from cat_all(fs, paths[start : start + FETCH_THREADS])


def listed_entries(files: list[str], storage: StorageOptions) -> list[dict[str, Any]]:
    """fsspec's info entry (name, size, type, and what the store adds: ETag, mtime) of each of
    `files`, in order: from one listing of each folder that holds several of them, not a
    request per file; a file alone in its folder (whose listing could be a whole bucket's), and
    an http(s) file (HTTP has no folder listing), from its own request."""
    by_folder: dict[str, list[int]] = {}
    for k, f in enumerate(files):
        by_folder.setdefault(f.rstrip("/").rsplit("/", 1)[0], []).append(k)
    entries: list[dict[str, Any]] = [{} for _ in files]
    for folder, ks in by_folder.items():
        fs = storage.filesystem(folder)
        listed = (
            {}
            if protocol(folder) in HTTP or len(ks) == 1
            else {strip_scheme(e["name"]).rstrip("/"): e for e in fs.ls(folder, detail=True)}
        )
        for k in ks:
            entries[k] = listed.get(strip_scheme(files[k]).rstrip("/")) or fs.info(files[k])
    return entries


def join(base: str, *parts: str) -> str:
    if protocol(base) is not None:
        return posixpath.join(base.rstrip("/"), *parts)
    return str(Path(base, *parts))


def strip_scheme(path: str) -> str:
    """`path` as its filesystem's listings name it: s3://b/k -> b/k, file:///x -> /x,
    abfss://c@account.dfs.core.windows.net/k -> c/k. Plain paths are returned as they are."""
    proto = protocol(path)
    if proto is None:
        return path
    if proto in S3:
        return path.split("://", 1)[1]
    import fsspec

    try:  # the driver's own rule
        stripped: str = fsspec.get_filesystem_class(proto)._strip_protocol(path)
        return stripped
    except (ImportError, ValueError):  # no driver: filesystem() refuses the path anyway
        authority, slash, rest = path.split("://", 1)[-1].partition("/")
        return authority.split("@", 1)[0] + slash + rest


def with_scheme(original: str, listed: str) -> str:
    """Put the scheme of `original` back on a path that a listing returned."""
    proto = protocol(original)
    if proto is None or protocol(listed) is not None:
        return listed
    if proto in S3:
        return "s3://" + listed.lstrip("/")
    if proto in LOCAL:
        return "file://" + listed
    authority = original.split("://", 1)[1].split("/", 1)[0]
    if "@" in authority:  # container@account.dfs.core.windows.net: listings name the container
        container, _, rest = listed.lstrip("/").partition("/")
        return f"{proto}://{container}@{authority.split('@', 1)[1]}/{rest}"
    return f"{proto}://{listed.lstrip('/')}"


def list_input_files(path: str | list[str], storage: StorageOptions, suffixes: tuple[str, ...] = ()) -> list[str]:
    """Expand files, directories (their files, sorted, recursively) and globs into file paths
    (normal_path's form). An http(s) URL names one file: HTTP has no listing to expand a folder
    or a glob with ('?' starts its query).

    Raises ValueError naming the path when nothing is found, so a typo fails before any work.
    """
    paths = [path] if isinstance(path, str) else list(path)
    found: list[str] = []
    for p in paths:
        p = normal_path(p)
        check_shared(p, writes=False)
        fs = storage.filesystem(p)
        if protocol(p) in HTTP:
            matches = _http_file(p, fs)
        elif any(ch in p for ch in "*?["):
            matches = sorted(fs.glob(strip_scheme(p)))
        elif fs.isdir(strip_scheme(p)):
            matches = sorted(f for f in fs.find(strip_scheme(p)) if not posixpath.basename(f).startswith(("_", ".")))
            if suffixes:
                matches = [f for f in matches if f.endswith(suffixes)] or matches
        elif fs.exists(strip_scheme(p)):
            matches = [strip_scheme(p)]
        else:
            matches = []
        if not matches:
            raise FieldProblem(
                "input.path",
                f"{masked(p)!r} matches no file: check the path (and, for a URL, the bucket, endpoint and credentials)",
            )
        found.extend(with_scheme(p, m) for m in matches)
    return found


def _http_file(url: str, fs: Any) -> list[str]:
    """[url] when the server has the file (one HEAD request), [] when it answers 404; the
    OSError of a server that cannot be reached."""
    if url.endswith("/"):
        raise FieldProblem(
            "input.path",
            f"{masked(url)!r} names a folder, which HTTP cannot list: "
            "give the URL of each file (input.path takes a list)",
        )
    try:
        fs.info(url)
    except FileNotFoundError as e:  # fsspec's answer to any failure: a 404, or no connection
        if isinstance(e.__cause__, OSError):  # aiohttp's connection errors are OSErrors
            raise e.__cause__ from None
        return []
    return [url]
