"""The code's shape: small functions (STYLE.md) and no silenced errors, in every folder of the
package. An ast check, so a long function or an `except Exception: pass` fails CI where it is
written, not in a later review."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Every folder that installs as part of the prefixflow package (pyproject's package-dir).
FOLDERS = ("prefixflow", "engine", "operators", "jobs", "pipeline", "kernels", "bench")
MAX_LINES = 60
BROAD = ("Exception", "BaseException")


def _trees(folder: Path) -> list[tuple[Path, ast.AST]]:
    return [
        (path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))) for path in sorted(folder.rglob("*.py"))
    ]


def long_functions(folder: Path, max_lines: int = MAX_LINES) -> list[str]:
    """'path:line name (n lines)' for each function or method whose body is over max_lines,
    docstring included (from its first statement to its last line). The signature is not
    counted: `ruff format` puts each parameter of a long one on its own line (a Triton kernel's
    strides), which says how many parameters it takes, not how much it does."""
    found = []
    for path, tree in _trees(folder):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.body[0].lineno + 1
                if lines > max_lines:
                    found.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def silenced_errors(folder: Path) -> list[str]:
    """'path:line' of each handler that catches everything (bare, Exception, BaseException)
    and does nothing with it (only `pass` or `...`): handle the specific error, or log why."""
    found = []
    for path, tree in _trees(folder):
        for node in ast.walk(tree):
            if not isinstance(node, ast.ExceptHandler):
                continue
            caught = node.type
            names = [caught] if not isinstance(caught, ast.Tuple) else list(caught.elts)
            broad = caught is None or any(isinstance(n, ast.Name) and n.id in BROAD for n in names)
            empty = all(
                isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                for s in node.body
            )
            if broad and empty:
                found.append(f"{path.relative_to(folder.parent)}:{node.lineno}")
    return found


def test_no_function_is_over_60_lines():
    found = [f for folder in FOLDERS for f in long_functions(ROOT / folder)]
    assert not found, "split these functions (at most 60 lines each):\n" + "\n".join(found)


def test_no_error_is_silenced():
    found = [f for folder in FOLDERS for f in silenced_errors(ROOT / folder)]
    assert not found, "these handlers swallow every error; catch the specific one or log why:\n" + "\n".join(found)


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES + 1))
    params = "\n".join(f"    p{i}," for i in range(MAX_LINES))  # a long signature alone is not long
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def short(\n{params}\n):\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "pkg") == [f"pkg/m.py:{MAX_LINES + 6} long ({MAX_LINES + 1} lines)"]


def test_the_check_sees_a_silenced_error(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "try:\n    f()\nexcept Exception:\n    pass\n"  # line 3: silenced
        "try:\n    f()\nexcept (OSError, BaseException):\n    ...\n"  # line 7: silenced
        "try:\n    f()\nexcept:\n    pass\n"  # line 11: silenced
        "try:\n    f()\nexcept KeyError:\n    pass\n"  # specific: allowed
        "try:\n    f()\nexcept Exception as e:\n    log(e)\n"
    )  # handled: allowed
    assert silenced_errors(tmp_path / "pkg") == ["pkg/m.py:3", "pkg/m.py:7", "pkg/m.py:11"]
