"""Everything a session with a GPU owes, in one command: the GPU tests, then the kernel benchmark.

    .venv/bin/python -m prefixflow.bench.gpu_suite [--quick]

Runs `pytest tests/gpu` in a subprocess (JUnit XML parsed for the counts and failures), then
`kernel_bench`, and writes bench/results/gpu_suite_<gpu>.json (kernel_bench also writes its own
file). Exits non-zero when a GPU test fails. Without CUDA it prints why and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer benchmark shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_suite needs a CUDA GPU; none found, nothing run or written.")
        sys.exit(1)
    from prefixflow.bench import kernel_bench

    tests = run_gpu_tests()
    print(f"tests/gpu: { ({k: v for k, v in tests.items() if k != 'output_tail'}) }")
    bench = kernel_bench.run(args.quick)
    results = kernel_bench.RESULTS_DIR
    results.mkdir(parents=True, exist_ok=True)
    slug = kernel_bench.gpu_slug()
    (results / f"kernel_bench_{slug}.json").write_text(json.dumps(bench, indent=2))
    path = results / f"gpu_suite_{slug}.json"
    path.write_text(json.dumps(dict(gpu_tests=tests, kernel_bench=bench), indent=2))
    print(f"goals: {bench['goals']}\nwrote {path}")
    sys.exit(0 if tests.get("returncode") == 0 else 1)


if __name__ == "__main__":
    main()
