"""Pins for the floor venv of `make test-floor`: each named dependency of pyproject.toml at the
lowest version its own line allows (`ray[data,default]>=2.X,<3` -> `ray==2.X`), as a pip
constraints file on stdout. The floors the package claims are then the versions the floor venv
tests, with nothing to keep in step by hand.

    python tests/floor_constraints.py ray transformers numpy tokenizers > constraints.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pip carries tomli
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")


def floors(text: str) -> dict[str, str]:
    """{normalized name: lowest version} of the [project] dependencies that have a `>=` bound."""
    out = {}
    for line in tomllib.loads(text)["project"]["dependencies"]:
        m = REQUIREMENT.match(line)
        low = [s.strip()[2:].strip() for s in m.group(2).split(",") if s.strip().startswith(">=")]
        if low:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = low[0]
    return out


def main(names: list[str]) -> int:
    found = floors(PYPROJECT.read_text())
    missing = [n for n in names if re.sub(r"[-_.]+", "-", n).lower() not in found]
    if missing:
        print(f"no '>=' floor in pyproject.toml's dependencies for: {', '.join(missing)}", file=sys.stderr)
        return 1
    for name in names:
        print(f"{name}=={found[re.sub(r'[-_.]+', '-', name).lower()]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
