"""A job's console (prefixflow/console.py, issue 41 item 5): Ray's log lines go to a log file,
our lines and Ray's real warnings and errors stay; `prefixflow run` is quiet on a good run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from prefixflow.console import shows_on_console
from support.terminal import run_in_terminal

RAY_INFO = "2026-11-30 03:23:30,355\tINFO worker.py:2038 -- Started a local Ray instance."
RAY_DATA_INFO = "2026-11-30 03:23:33,323\tINFO logging_progress.py:225 -- Total Progress: 0/?"
AUTH_WARNING = (
    "2026-11-30 03:23:19,265\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled "
    "for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out."
)
CONSTRUCTOR_ARGS = (
    "[2026-11-30 03:23:33,049 E 19234 19234] core_worker.cc:2465: Actor with class name: 'MapWorker(x)' and "
    "ID: '296c' has constructor arguments in the object store and max_restarts > 0. If the arguments ..."
)
REAL_ERROR = "[2026-11-30 03:23:33,049 E 19234 19234] core_worker.cc:999: Failed to connect to GCS"
REAL_WARNING = "2026-11-30 03:23:19,265\tWARNING worker.py:1 -- The object store is full"
WORKER_INFO = "\x1b[36m(TokenizeActor pid=4242)\x1b[0m 2026-11-30 03:23:33,323\tINFO foo.py:1 -- hello"
CORE_INFO = "[2026-11-30 03:23:33,049 I 19234 19234] raylet.cc:12: started"


@pytest.mark.parametrize(
    "line, shown",
    [
        (RAY_INFO, False),
        (RAY_DATA_INFO, False),
        (WORKER_INFO, False),
        (CORE_INFO, False),
        (AUTH_WARNING, False),  # known harmless
        # Its cause is gone (operators/stages/tokenize.py: tasks, not an actor pool): shown if it is back.
        (CONSTRUCTOR_ARGS, True),
        (REAL_ERROR, True),
        (REAL_WARNING, True),
        ("[prefixflow] rows 9/48 (19%) | 13.9 generated tok/s", True),
        ("plan: 80 rows -> 20 groups (20 sharing a prefix), order batchllm, 5 replica(s)", True),
        ("Traceback (most recent call last):", True),
        ("(ReplicaGenerator pid=77) prefixflow: the model copied once to this node", True),
    ],
)
def test_which_lines_reach_the_console(line, shown):
    assert shows_on_console(line) is shown


CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from prefixflow.console import quiet_console

    with quiet_console(Path(sys.argv[1])):
        print("ours on stdout")
        print({info!r}, file=sys.stderr)
        os.write(2, ({core!r} + "\\n").encode())  # as Ray's C++ core writes: the descriptor
        os.write(2, ({error!r} + "\\n").encode())
        sys.stderr.write("[prefixflow] rows 1/2\\r[prefixflow] rows 2/2\\n")
        print({worker!r})
        sys.stdout.write("a partial line")
        sys.stdout.flush()
        time.sleep(0.5)  # longer than the filter holds a partial line
        print(" ended")
    print("after the block")
    """
).format(info=RAY_INFO, core=CORE_INFO, error=REAL_ERROR, worker=WORKER_INFO)


def test_the_filter_takes_both_descriptors_and_keeps_ray_lines_in_the_file(tmp_path):
    log = tmp_path / "logs" / "job.log"
    # Bytes: text mode would turn the progress line's "\r" into a newline.
    proc = subprocess.run([sys.executable, "-c", CHILD, str(log)], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode() == "ours on stdout\na partial line ended\nafter the block\n"
    assert proc.stderr.decode() == REAL_ERROR + "\n[prefixflow] rows 1/2\r[prefixflow] rows 2/2\n"
    kept = log.read_text().splitlines()  # two descriptors, two threads: in either's order
    assert sorted(kept) == sorted([RAY_INFO, CORE_INFO, REAL_ERROR, WORKER_INFO])


TERMINAL_CHILD = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from prefixflow.console import quiet_console

    with quiet_console(Path(sys.argv[1])):
        print("tty", sys.stdout.isatty(), sys.stderr.isatty(), os.get_terminal_size(2).columns)
        print({info!r}, file=sys.stderr)
        sys.stderr.write("\\r[prefixflow] rows 1/2\\r[prefixflow] rows 2/2\\n")
    """
).format(info=RAY_INFO)


def test_a_terminal_stays_a_terminal_of_its_size(tmp_path):
    """In a terminal, the filtered descriptors are still terminals (progress redrawn in place)
    of the terminal's width."""
    text = run_in_terminal([sys.executable, "-c", TERMINAL_CHILD, str(tmp_path / "job.log")], timeout_s=30, columns=123)
    assert "tty True True 123" in text and "\r[prefixflow] rows 1/2\r[prefixflow] rows 2/2" in text, text
    assert "Started a local Ray instance" not in text
    assert (tmp_path / "job.log").read_text() == RAY_INFO + "\n"


@pytest.mark.slow
def test_a_good_job_prints_no_ray_log_line(ray_local, tiny_model, tmp_path):
    """`prefixflow run` of a small job (two replicas) on a local Ray it starts: the console has
    our plan, progress and summary and not one of Ray's log lines; the file named at the end has
    them, and not the core's constructor-arguments error line, whose cause (an actor pool for the
    tokenize stage) is gone. Without an address the run starts its own cluster, never joining
    one that happens to run on the machine (the session's, here), and says so (issue 27)."""
    import ray._private.state

    drivers_before = len(ray._private.state.jobs())
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(8)))
    spec = {
        "model": str(tiny_model),
        "input": {"path": str(tmp_path / "in.jsonl")},
        "prompt": {"template": "Q: {{ q }}"},
        "engine": {"device": "cpu"},
        "sampling": {"max_tokens": 4},
        "replicas": 2,
        "output": {"path": str(tmp_path / "out")},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PREFIXFLOW_CACHE": str(tmp_path / "cache")}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "prefixflow.cli", "run", str(tmp_path / "job.yaml")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    assert "plan: 8 rows" in console and "done: 8 rows" in console, console[-4000:]
    assert "Ray: started a local cluster for this run" in console, console[-4000:]
    # The run did not join the session's cluster. (A run given RAY_ADDRESS joins that cluster
    # and says so: every `start_driver` job does, and test_resume_safety's lock test asserts it.)
    assert len(ray._private.state.jobs()) == drivers_before
    ray_lines = [line for line in console.splitlines() if re.match(r"(\(.*\) )?\[?\d{4}-\d\d-\d\d ", line)]
    assert not ray_lines, ray_lines
    assert not [line for line in console.splitlines() if re.match(r"\[\S+ \S+ E ", line)]
    named = re.search(r"Ray's log lines are in (\S+) ", console)
    assert named, console[-2000:]
    log = Path(named.group(1)).read_text()
    assert "Started a local Ray instance" in log and "constructor arguments" not in log, log[-2000:]


def test_our_log_lines_go_to_the_stderr_of_the_moment(monkeypatch):
    """The `prefixflow` logger's handler (cli._show_our_logs, made once per process) writes to
    sys.stderr as it is when a record comes, not to the stream it was made with: a notebook or a
    test that replaced sys.stderr, and closed it, between two runs gets no logging error."""
    import io
    import logging

    from prefixflow import cli

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    cli._show_our_logs()
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("prefixflow.test").info("hello")
    assert second.getvalue() == "prefixflow: hello\n"
