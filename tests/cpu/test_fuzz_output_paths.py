"""Hostile output folders and paths fuzzed through the functions that read them (issue 43), no
Ray, about 150 generated cases per run, each in milliseconds:

- output folders where some of the job's names (`_commits`, records, parts, `_job.json`,
  `_lock.json`, end files) are symbolic links to another job's files, a user's folder or
  nothing: every step that reads or deletes there either refuses, naming the link, or never
  meets one; nothing outside the folder changes;
- commit records whose row ids were moved, appended, dropped, swapped or recounted, parts or
  records deleted: a resume counts exactly the rows its kept parts hold, each once, and never
  a row claimed by a record whose part does not hold it;
- URLs and paths with mixed-case schemes, `..`, `.`, symbolic links and credentials:
  normal_path refuses them by name or gives one idempotent form, masked output never shows a
  secret, and validate refuses an output inside the input however it is spelled.

The property of the issue: a clear error naming the field or file, or every row exactly once,
and no file outside the job's own changed. (Whole jobs: test_output_folder_trust.py and
test_paths_and_validate.py.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixflow.jobs.preflight import preflight
from prefixflow.jobs.spec import SpecError, parse_spec
from prefixflow.operators.results.commit import COMMITS, JOB_FILE, LOCK_FILE, OutputLock, load_committed
from prefixflow.operators.results.write import WriteOptions, prepare_output
from prefixflow.storage import StorageOptions

from support.output_folders import FORMATS, committed_job, record, snapshot

FAST = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)

# -- folders with links ------------------------------------------------------------------------

LINKED = st.sampled_from(
    [
        COMMITS,
        JOB_FILE,
        LOCK_FILE,
        "_SUCCESS",
        "_manifest.json",
        "metrics.json",
        "part-r000-000000000.jsonl",
        "part-r000-000000002.jsonl",
        f"{COMMITS}/part-r000-000000000.jsonl.json",
        "notes.txt",
    ]
)
TARGETS = st.sampled_from(
    ["victim", "victim/keep.txt", "other/_commits", "other/_job.json", "other/part-r000-000000000.jsonl", "nowhere"]
)
STEPS = st.sampled_from(["load", "resume", "overwrite", "fresh", "lock"])


def _link(out: Path, root: Path, name: str, target: str) -> None:
    path = out / name
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.symlink_to(root / target)


def _step(step: str, out: Path) -> None:
    opts = WriteOptions(path=str(out), format="jsonl")
    if step == "load":
        load_committed(str(out), StorageOptions(), verify=True)
    elif step == "lock":
        OutputLock(str(out), StorageOptions()).acquire().release()
    else:
        prepare_output(opts, overwrite=step == "overwrite", resume=step == "resume")


@FAST
@given(st.lists(st.tuples(LINKED, TARGETS), max_size=3, unique_by=lambda t: t[0]), STEPS)
def test_fuzzed_links_in_an_output_folder_are_refused_by_name(tmp_path_factory, links, step):
    root = tmp_path_factory.mktemp("links")
    (root / "victim").mkdir()
    (root / "victim" / "keep.txt").write_text("keep me")
    committed_job(root / "other", "jsonl", [[0, 1], [2, 3]])
    out = root / "out"
    committed_job(out, "jsonl", [[0, 1], [2, 3]])
    made = []
    for name, target in sorted(links):  # _commits before the records in it
        if name.startswith(f"{COMMITS}/") and (out / COMMITS).is_symlink():
            continue  # inside a linked _commits: that link is the one to refuse
        _link(out, root, name, target)
        made.append(name)
    before = snapshot(root, out)
    own = [n for n in made if n != "notes.txt" and (step != "lock" or n == LOCK_FILE)]
    try:
        _step(step, out)
    except ValueError as e:
        message = str(e)
        assert "output.path=" in message, message  # names the field (and the folder)
        if own:
            assert "is a symbolic link" in message and any(n.split("/")[-1] in message for n in own), message
        else:  # refused for another reason, by name (a fresh run into a job's folder)
            assert "already holds a job's output" in message, message
    else:
        assert not own, f"{step} met links {own} without refusing them"
    assert snapshot(root, out) == before  # nothing outside the job's folder changed
    assert all((out / n).is_symlink() for n in made)  # and no link was deleted through


# -- records with moved ids --------------------------------------------------------------------

EDITS = st.lists(
    st.tuples(
        st.sampled_from(["move", "append", "drop", "swap", "recount", "copy", "delete_part", "delete_record", "empty"]),
        st.integers(0, 2),
        st.integers(0, 2),
    ),
    max_size=4,
)


def _edit(out: Path, parts: list[str], edit: tuple[str, int, int]) -> None:
    kind, i, j = edit
    src, dst = record(out, parts[i]), record(out, parts[j])
    if not src.exists() or not dst.exists():
        return
    a, b = json.loads(src.read_text()), json.loads(dst.read_text())
    if kind == "delete_part":
        (out / parts[i]).unlink(missing_ok=True)
        return
    if kind == "delete_record":
        src.unlink()
        return
    if kind == "move" and a["row_ids"]:
        b["row_ids"].append(a["row_ids"].pop())
    elif kind == "append":
        b["row_ids"] += a["row_ids"]
    elif kind == "drop" and a["row_ids"]:
        a["row_ids"].pop(0)
    elif kind == "swap":
        a["row_ids"].reverse()
    elif kind == "recount":
        a["num_rows"] = a["num_rows"] + 1
    elif kind == "copy":
        b["row_ids"] = list(a["row_ids"])
    elif kind == "empty":
        a["row_ids"] = []
    src.write_text(json.dumps(a))
    if src != dst:
        dst.write_text(json.dumps(b))


def _rows_held(path: Path) -> list[int]:
    """The row ids a part holds, read from the part (OpenAI lines name their custom_id)."""
    if path.suffix == ".parquet":
        return pq.read_table(path).column("row_id").to_pylist()
    lines = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [line["row_id"] if "row_id" in line else int(line["custom_id"].removeprefix("req-")) for line in lines]


@FAST
@given(st.sampled_from(FORMATS), EDITS)
def test_fuzzed_records_never_claim_rows_their_parts_do_not_hold(tmp_path_factory, fmt, edits):
    root = tmp_path_factory.mktemp("records")
    (root / "victim.txt").write_text("keep me")
    out = root / "out"
    parts = committed_job(out, fmt, [[0, 1, 2], [3, 4], [5, 6, 7]])
    for edit in edits:
        _edit(out, parts, edit)
    before = snapshot(root, out)
    done = load_committed(str(out), StorageOptions(), verify=True)  # never a RuntimeError
    held = [r for m in done.manifests for r in _rows_held(out / m["part"])]
    assert sorted(held) == done.row_ids.tolist()  # exactly the rows the kept parts hold, once
    assert set(held) <= set(range(8))
    for part in parts:  # a part either counts whole, or is gone and its rows run again
        kept = part in {m["part"] for m in done.manifests}
        assert (out / part).exists() == kept and record(out, part).exists() == kept
    assert snapshot(root, out) == before


# -- paths and URLs ----------------------------------------------------------------------------

SCHEMES = st.sampled_from(
    [
        "",
        "file://",
        "FILE://",
        "File://",
        "file:",
        "s3://",
        "S3://",
        "gs://",
        "HTTPS://",
        "memory://",
        "Memory://",
        "s3:/",
        "simplecache::s3://",
    ]
)
SEGMENTS = st.lists(st.sampled_from(["a", "b", "..", ".", "in", "link", "x y"]), max_size=5)
CREDS = st.sampled_from(["", "alice@", "alice:SECRET1@", "bob:p%40SECRET2@"])
QUERIES = st.sampled_from(["", "?sig=SECRET3", "?a=1&X-Amz-Signature=SECRET4", "?api_key=SECRET5"])


@FAST
@given(SCHEMES, CREDS, SEGMENTS, QUERIES)
def test_fuzzed_paths_have_one_form_and_never_show_a_secret(tmp_path_factory, scheme, creds, segments, query):
    from prefixflow.storage import masked, normal_path, protocol  # here: the other cases run on older code

    root = tmp_path_factory.mktemp("paths")
    (root / "a" / "in").mkdir(parents=True)
    (root / "link").symlink_to(root / "a", target_is_directory=True)
    local = scheme.lower() in ("", "file://", "file:")
    where = (str(root) if local else "bucket") + "/" + "/".join(segments)
    path = f"{scheme}{'' if local else creds}{where}{'' if local else query}"
    try:
        got = normal_path(path)
    except ValueError as e:
        assert "SECRET" not in str(e) and ("is neither a URL nor a plain path" in str(e)), str(e)
        return
    assert normal_path(got) == got  # idempotent: every check and writer sees one form
    assert protocol(got) == (protocol(path) if protocol(path) != "local" else "file") or (
        local and protocol(got) in (None, "file")
    )
    if local:
        plain = got.removeprefix("file://")
        assert plain == os.path.realpath(os.path.join(root, *segments)) and ".." not in plain.split("/")
    assert "SECRET" not in masked(f"cannot reach {got}: no route") and "SECRET" not in masked(got)


@pytest.fixture(scope="module")
def job_root(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("clash")
    (root / "data" / "in").mkdir(parents=True)
    (root / "data" / "in" / "a.jsonl").write_text('{"q": "hi"}\n')
    (root / "data" / "other").mkdir()
    (root / "to_in").symlink_to(root / "data" / "in", target_is_directory=True)
    (root / "to_data").symlink_to(root / "data", target_is_directory=True)
    return root, tiny_model


@FAST
@given(
    st.sampled_from(["", "file://", "FILE://", "file:"]),
    st.lists(st.sampled_from(["data", "in", "other", "..", ".", "to_in", "to_data", "out"]), min_size=1, max_size=5),
    st.sampled_from(["data/in", "data/in/a.jsonl", "data/**/*.jsonl", "data/*/a.jsonl", "to_in"]),
)
def test_fuzzed_outputs_inside_the_input_are_refused_however_spelled(job_root, scheme, segments, inp):
    root, model = job_root
    out = f"{scheme}{root}/{'/'.join(segments)}"
    real = os.path.realpath(os.path.join(root, *segments))
    data, folder, file = (os.path.realpath(root / p) for p in ("data", "data/in", "data/in/a.jsonl"))
    clash = _under(file, real)  # the output is, or holds, the input file
    clash |= inp in ("data/in", "to_in") and _under(real, folder)
    clash |= inp == "data/**/*.jsonl" and _under(real, data)  # its parts would match the glob
    spec = parse_spec(
        {
            "model": str(model),
            "input": {"path": f"{root}/{inp}", "format": "jsonl"},
            "prompt": {"template": "{{ q }}"},
            "engine": {"device": "cpu"},
            "output": {"path": out},
        }
    )
    try:
        preflight(spec)
        problems = {}
    except SpecError as e:
        problems = dict(e.problems)
    problem = problems.get("output.path", "")
    refused = "inside the input" in problem or "holds the input file" in problem
    assert refused == clash, (out, inp, problems)


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")
