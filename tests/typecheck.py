"""Type-check the package with mypy ([tool.mypy] in pyproject.toml): `make test` runs it.

    python tests/typecheck.py [ROOT]

The repository's folders install as subpackages of one import package (pyproject's package-dir:
engine/ is prefixflow.engine), which mypy cannot follow through setuptools' editable finder.
This builds ROOT/prefixflow, a tree of links laid out as the installed package (read from the
same package-dir table, so it cannot drift), and checks it there; findings name the linked
paths (prefixflow/engine/x.py is engine/x.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO / "build" / "typecheck"


def build_tree(root: Path) -> Path:
    """ROOT/prefixflow linked to the repository as pyproject's package-dir installs it."""
    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(root / "prefixflow", ignore_errors=True)
    # Outer packages first, so that a subpackage's link is made inside its parent's folder.
    for name, folder in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):
        target = root.joinpath(*name.split("."))
        if target.exists():  # a subfolder already reached through its parent's links
            continue
        target.mkdir(parents=True)
        for entry in (REPO / folder).iterdir():
            if entry.suffix == ".py" or (
                entry.is_dir() and (entry / "__init__.py").exists() and f"{name}.{entry.name}" not in dirs
            ):
                os.symlink(entry, target / entry.name)
    return root / "prefixflow"


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else DEFAULT_ROOT
    build_tree(root)
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(REPO / "pyproject.toml"),
        "--cache-dir",
        str(root / ".mypy_cache"),
        "-p",
        "prefixflow",
    ]
    return subprocess.run(cmd, cwd=root).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
