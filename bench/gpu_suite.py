"""Everything a session with a GPU owes, in one command: the GPU tests, the kernel benchmark and
the engine's section.

    .venv/bin/python -m prefixflow.bench.gpu_suite [--quick] [--dry-run] [--out FILE] [--sections tests,engine,kernels]

Runs `pytest tests/gpu` in a subprocess (JUnit XML parsed for the counts and failures), then
`gpu_engine` (parity with transformers, the 1B-shape decode step beside its weights floor, device
busy share, kernels per step, warm-up), then `kernel_bench`, and writes
bench/results/gpu_suite_<gpu>.json after each section, so a run cut short keeps what it got
(kernel_bench also writes its own file); --sections runs some of them, keeping the others' in
the file and saying when each was written. Exits non-zero when a GPU test fails. Without CUDA it
prints why and writes nothing.

--dry-run runs every section on the CPU at tiny shapes (Triton's kernels under its interpreter;
the GPU tests skip themselves): a check, before a GPU session spends its minutes, that the suite
runs to its end. It writes only to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("tests", "engine", "kernels")  # in the order they run


def run_gpu_tests() -> dict:
    """pytest tests/gpu -> {passed, failed, skipped, errors, failures: [test ids], seconds}."""
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "gpu.xml"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/gpu", "-q", f"--junitxml={xml_path}"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if not xml_path.exists():
            return dict(
                returncode=proc.returncode,
                error="pytest wrote no report",
                output_tail=(proc.stdout + proc.stderr)[-4000:],
            )
        suites = ET.parse(xml_path).getroot()
    counts = dict(tests=0, failures=0, errors=0, skipped=0, time=0.0)
    failed: list[str] = []
    for suite in suites.iter("testsuite"):
        for key in counts:
            counts[key] += type(counts[key])(suite.get(key, 0))
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return dict(
        returncode=proc.returncode,
        passed=passed,
        failed=counts["failures"],
        errors=counts["errors"],
        skipped=counts["skipped"],
        seconds=counts["time"],
        failures=failed,
        output_tail=proc.stdout[-4000:],
    )


def write_section(path: Path, section: str, result: dict, fresh: bool) -> None:
    """`result` as `section` of the JSON report at `path`, beside the sections the file holds
    (none when `fresh`), and the time it was written in `written` (UTC): a second run in one
    lease, of the sections that changed, keeps the first run's others and says which is which."""
    report: dict = {}
    if not fresh and path.exists():
        try:
            report = json.loads(path.read_text())
        except json.JSONDecodeError:  # a report cut off mid-write: its sections are lost anyway
            report = {}
    report[section] = result
    report.setdefault("written", {})[section] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer benchmark shapes")
    parser.add_argument("--dry-run", action="store_true", help="every section on the CPU at tiny shapes")
    parser.add_argument("--out", default=None, help="write the JSON here (a dry run writes nowhere else)")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, of {','.join(SECTIONS)}: a second run in one lease need not repeat what passed",
    )
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        parser.error(f"--sections takes {','.join(SECTIONS)}, got {args.sections}")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (the kernels below)
    elif not torch.cuda.is_available():
        print("gpu_suite needs a CUDA GPU; none found, nothing run or written (--dry-run runs it on the CPU).")
        sys.exit(1)
    from prefixflow.bench import gpu_engine, kernel_bench

    paths = [Path(args.out)] if args.out else []
    if not args.dry_run:
        slug = kernel_bench.gpu_slug()
        paths.append(kernel_bench.RESULTS_DIR / f"gpu_suite_{slug}.json")
    started: set[Path] = set()

    def write(section: str, result: dict) -> None:
        """The report so far, after each section: a run cut short by the GPU's time keeps what it
        got. A run of every section starts each file afresh; a run of some keeps the others'."""
        for path in paths:
            write_section(path, section, result, fresh=sections == set(SECTIONS) and path not in started)
            started.add(path)

    tests: dict = {"returncode": 0}
    if "tests" in sections:
        tests = run_gpu_tests()
        print(f"tests/gpu: { ({k: v for k, v in tests.items() if k != 'output_tail'}) }", flush=True)
        write("gpu_tests", tests)
    if "engine" in sections:  # before the kernels': it holds the issue's goals
        engine = gpu_engine.run(args.dry_run)
        print(f"gpu_engine goals: {engine['goals']}", flush=True)
        write("engine", engine)
    if "kernels" in sections:
        bench = kernel_bench.run(args.quick, dry_run=args.dry_run)
        print(f"kernel_bench goals: {bench['goals']}", flush=True)
        write("kernel_bench", bench)
        if not args.dry_run:
            (kernel_bench.RESULTS_DIR / f"kernel_bench_{slug}.json").write_text(json.dumps(bench, indent=2))
    for path in paths:
        print(f"wrote {path}")
    sys.exit(0 if tests.get("returncode") == 0 else 1)


if __name__ == "__main__":
    main()
