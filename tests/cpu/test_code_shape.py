"""The code's shape: small functions (STYLE.md). An ast check, so a long function fails CI
where it is written, not in a later review."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("engine", "operators", "jobs", "pipeline")
MAX_LINES = 60


def long_functions(folder: Path, max_lines: int = MAX_LINES) -> list[str]:
    """'path:line name (n lines)' for each function or method over max_lines, decorators
    and docstring included (from `def` to its last line)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > max_lines:
                    found.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_60_lines():
    found = [f for folder in FOLDERS for f in long_functions(ROOT / folder)]
    assert not found, "split these functions (at most 60 lines each):\n" + "\n".join(found)


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "pkg") == [f"pkg/m.py:5 long ({MAX_LINES + 1} lines)"]
