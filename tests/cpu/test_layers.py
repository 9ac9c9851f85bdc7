"""Each layer imports only downward, and no module imports itself back (issue 30).

The folders install as subpackages of `prefixflow` (pyproject.toml's package-dir), so the rule
is stated over the `prefixflow.*` names. Layers, lowest first:

  0  prefixflow/ base   errors, requests, paths, model_source, digest, tokenizer, sandbox
                        (with template_budget, template_checks, template_filters, deadline),
                        storage, retry: the torch-free pieces every layer needs
  1  pipeline/, kernels/  the planner (numpy) and the kernels (torch): siblings, neither
                        imports the other
  2  engine/            one replica's engine
  3  operators/         the Ray Data stages
  4  jobs/              job runs from a spec
  5  prefixflow, prefixflow.api, prefixflow.cli, prefixflow.prepare   the user's faces: the
                        package, the Python API, the command line and its one-time setup
  6  bench/             benchmarks (they may use everything)

A module may import modules of its own layer and of lower layers, never of a higher or a
sibling layer; tests sit above everything and nothing imports them. Every import counts: at
module level, inside functions and under `if __name__ == "__main__":`. Across all modules the
import graph has no cycle. A function-level import of a `prefixflow` module in the product
(every layer but bench/) says why it is lazy in a comment on its line or right above its run of
import lines (torch kept out of a torch-free module, Ray out of `import prefixflow`, ...): a
function-level import that only dodges a cycle is not allowed.

Inside engine/, the rooms: its shared modules (engine/*.py: config, outputs) < models/ (the
model, its layers, loading) < native/, scoring/, vllm_backend/ and http_backend/, which never import one
another, except that vllm_backend/ may import scoring/ (the score task's choices and options,
which both backends answer).

Inside operators/, the rooms: its shared modules (operators/*.py: config, template, columns,
row_sampling) < results/ (output rows, parts, commits, progress) < stages/ (read, tokenize,
plan, generate) < faces/ (the Python API, map_batches, ray.data.llm's API).

`from prefixflow.kernels import cpu_build` is an import of the submodule cpu_build (its
package's __init__ runs first, as for any import, and is not counted as an edge).
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {
    "prefixflow": "prefixflow",
    "pipeline": "prefixflow.pipeline",
    "kernels": "prefixflow.kernels",
    "engine": "prefixflow.engine",
    "operators": "prefixflow.operators",
    "jobs": "prefixflow.jobs",
    "bench": "prefixflow.bench",
}
RANKS = {"base": 0, "pipeline": 1, "kernels": 1, "engine": 2, "operators": 3, "jobs": 4, "face": 5, "bench": 6}
FACES = ("prefixflow", "prefixflow.api", "prefixflow.cli", "prefixflow.prepare")
# engine/'s and operators/' rooms, and the rooms each may import besides its own (the module docstring)
ENGINE_ROOMS = {
    "shared": set(),
    "models": {"shared"},
    "native": {"shared", "models"},
    "scoring": {"shared", "models"},
    "vllm_backend": {"shared", "models", "scoring"},
    "http_backend": {"shared"},
}
OPERATOR_ROOMS = {
    "shared": set(),
    "results": {"shared"},
    "stages": {"shared", "results"},
    "faces": {"shared", "results", "stages"},
}
ROOMS = {"engine": ENGINE_ROOMS, "operators": OPERATOR_ROOMS}
_IMPORT_LINE = re.compile(r"\s*(from|import)\s")


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    in_function: bool
    commented: bool


def layer(module: str) -> str:
    """The layer of a `prefixflow.*` module name (see the module docstring)."""
    if module in FACES or module.startswith("prefixflow.cli.") or module.startswith("prefixflow.api."):
        return "face"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANKS else "base"


def room(module: str) -> tuple[str, str] | None:
    """(folder, room) of a module of engine/ or operators/ (None elsewhere)."""
    parts = module.split(".")
    if parts[0] != "prefixflow" or len(parts) < 2 or parts[1] not in ROOMS:
        return None
    rooms = ROOMS[parts[1]]
    return parts[1], parts[2] if len(parts) > 3 and parts[2] in rooms else "shared"


def find_modules(root: Path, folders: dict[str, str] = FOLDERS) -> dict[str, Path]:
    """{module name: file} for every .py file of the folders that install as prefixflow.*."""
    modules = {}
    for folder, package in folders.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    names = [a.name for a in node.names if f"{base}.{a.name}" not in modules]
    return subs + ([base] if names else [])


def _commented(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's lines, or on the line above its run of import lines."""
    if any("#" in line for line in lines[node.lineno - 1 : node.end_lineno]):
        return True
    i = node.lineno - 2
    while i >= 0 and _IMPORT_LINE.match(lines[i]):
        i -= 1
    return i >= 0 and lines[i].strip().startswith("#")


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    """Every import of one prefixflow module by another, as edges between module names."""
    edges = []
    for name, path in modules.items():
        text = path.read_text(encoding="utf-8")
        tree, lines = ast.parse(text), text.splitlines()
        in_function = {
            id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)
        }
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(node, name, path.name == "__init__.py", modules):
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name and target.startswith("prefixflow"):
                    edges.append(Edge(name, target, node.lineno, id(node) in in_function, _commented(lines, node)))
    return edges


def upward_imports(edges: list[Edge]) -> list[str]:
    """Imports of a higher layer, or of a sibling layer of the same rank."""
    bad = []
    for e in edges:
        src, dst = layer(e.src), layer(e.dst)
        if src != dst and RANKS[dst] >= RANKS[src]:
            bad.append(f"{e.src}:{e.line} ({src}) imports {e.dst} ({dst})")
    return bad


def room_imports(edges: list[Edge]) -> list[str]:
    """Imports between the rooms of one folder that ROOMS does not allow."""
    bad = []
    for e in edges:
        src, dst = room(e.src), room(e.dst)
        if src and dst and src[0] == dst[0] and src[1] != dst[1] and dst[1] not in ROOMS[src[0]][src[1]]:
            bad.append(f"{e.src}:{e.line} ({src[0]}/{src[1]}) imports {e.dst} ({dst[0]}/{dst[1]})")
    return bad


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def unexplained_lazy_imports(edges: list[Edge]) -> list[str]:
    """Function-level imports of prefixflow modules in the product without a comment."""
    return [
        f"{e.src}:{e.line} imports {e.dst} inside a function without saying why"
        for e in edges
        if e.in_function and not e.commented and layer(e.src) != "bench"
    ]


def problems(root: Path, folders: dict[str, str] = FOLDERS) -> list[str]:
    edges = import_edges(find_modules(root, folders))
    return (
        upward_imports(edges)
        + room_imports(edges)
        + [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
        + unexplained_lazy_imports(edges)
    )


# ---- the repository ---------------------------------------------------------------------------


def test_every_layer_imports_only_downward_and_no_cycle():
    assert problems(REPO) == []


def test_the_product_never_imports_the_tests():
    offenders = []
    for name, path in find_modules(REPO).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level:
                roots = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            else:
                continue
            if {"support", "tests", "conftest"} & set(roots):
                offenders.append(f"{name}:{node.lineno}")
    assert offenders == []


def test_layers_cover_every_module():
    modules = find_modules(REPO)
    assert {layer(m) for m in modules} == set(RANKS)
    assert layer("prefixflow.errors") == "base" and layer("prefixflow.storage") == "base"
    assert layer("prefixflow.cli") == layer("prefixflow.api") == layer("prefixflow") == "face"
    assert layer("prefixflow.engine.models.layers.rotary") == "engine"


# ---- the checker, on planted trees ------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for folder in FOLDERS:
        (root / folder).mkdir(exist_ok=True)
        (root / folder / "__init__.py").touch()
    return root


def test_a_planted_upward_import_fails(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kernels/norm.py": "import torch\n",
            "engine/runner.py": "from prefixflow.kernels.norm import torch\n",  # down: fine
            "pipeline/plan.py": "def f():\n    # lazy: never\n    from prefixflow.engine import runner\n",
            "operators/stages/read.py": "from prefixflow.pipeline.plan import f\n",  # down: fine
        },
    )
    assert problems(root) == ["prefixflow.pipeline.plan:3 (pipeline) imports prefixflow.engine.runner (engine)"]


def test_siblings_and_the_faces_count_as_upward(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kernels/norm.py": "from prefixflow.pipeline import plan\n",
            "pipeline/plan.py": "X = 1\n",
            "jobs/run.py": "if __name__ == '__main__':\n    from prefixflow.cli import main\n",
            "prefixflow/cli.py": "from prefixflow.jobs.run import X\n",
            "prefixflow/storage.py": "from prefixflow import api\n",
            "prefixflow/api.py": "",
        },
    )
    assert sorted(problems(root)) == sorted(
        [
            "prefixflow.kernels.norm:1 (kernels) imports prefixflow.pipeline.plan (pipeline)",
            "prefixflow.jobs.run:2 (jobs) imports prefixflow.cli (face)",
            "prefixflow.storage:1 (base) imports prefixflow.api (face)",
            "import cycle: prefixflow.cli <-> prefixflow.jobs.run",
        ]
    )


def test_a_cycle_inside_one_layer_fails_even_through_functions(tmp_path):
    root = _tree(
        tmp_path,
        {
            "operators/stages/read.py": "from prefixflow.operators.stages.openai_batch import parse\nERROR = 'e'\n",
            "operators/stages/openai_batch.py": "def parse():\n    # lazy: dodges a cycle\n    from prefixflow.operators.stages.read import ERROR\n",
            "operators/results/write.py": "from prefixflow.operators import read\n",  # no cycle: fine
        },
    )
    assert problems(root) == [
        "import cycle: prefixflow.operators.stages.openai_batch <-> prefixflow.operators.stages.read"
    ]


def test_a_lazy_import_must_say_why(tmp_path):
    root = _tree(
        tmp_path,
        {
            "engine/runner.py": "import torch\n",
            "operators/stages/generate.py": textwrap.dedent("""\
            def make():
                from prefixflow.engine.runner import torch
                return torch


            def make_commented():
                # lazy: torch in the engine actor only
                import os
                from prefixflow.engine import runner
                return runner
            """),
            "bench/b.py": "def main():\n    from prefixflow.engine import runner\n",  # bench: free
        },
    )
    assert problems(root) == [
        "prefixflow.operators.stages.generate:2 imports prefixflow.engine.runner inside a function without saying why"
    ]


def test_engine_rooms_import_only_shared_models_and_what_they_may(tmp_path):
    root = _tree(
        tmp_path,
        {
            "engine/config.py": "X = 1\n",
            "engine/outputs.py": "from prefixflow.engine.native.sequence import X\n",  # shared -> room
            "engine/models/loader.py": "from prefixflow.engine.config import X\n",  # fine
            "engine/native/sequence.py": "from prefixflow.engine.models.loader import X\n",  # fine
            "engine/scoring/scorer.py": "from prefixflow.engine.native.sequence import X\n",  # sibling
            "engine/scoring/options.py": "X = 1\n",
            "engine/vllm_backend/engine.py": "from prefixflow.engine.scoring.options import X\n",  # allowed
        },
    )
    for folder in ("engine/models", "engine/native", "engine/scoring", "engine/vllm_backend"):
        (root / folder / "__init__.py").touch()
    assert sorted(problems(root)) == sorted(
        [
            "prefixflow.engine.outputs:1 (engine/shared) imports prefixflow.engine.native.sequence (engine/native)",
            "prefixflow.engine.scoring.scorer:1 (engine/scoring) imports prefixflow.engine.native.sequence "
            "(engine/native)",
        ]
    )


def test_operator_rooms_import_only_shared_and_the_rooms_below(tmp_path):
    root = _tree(
        tmp_path,
        {
            "operators/config.py": "from prefixflow.operators.results.outputs import X\n",  # shared -> room
            "operators/template.py": "X = 1\n",
            "operators/results/outputs.py": "from prefixflow.operators.template import X\n",  # fine
            "operators/results/write.py": "from prefixflow.operators.stages.plan import X\n",  # up
            "operators/stages/plan.py": "from prefixflow.operators.results.outputs import X\n",  # down: fine
            "operators/stages/read.py": "from prefixflow.operators.faces.processor import X\n",  # up
            "operators/faces/processor.py": "from prefixflow.operators.stages.plan import X\n",  # down: fine
        },
    )
    for folder in ("operators/results", "operators/stages", "operators/faces"):
        (root / folder / "__init__.py").touch()
    assert sorted(problems(root)) == sorted(
        [
            "prefixflow.operators.config:1 (operators/shared) imports prefixflow.operators.results.outputs "
            "(operators/results)",
            "prefixflow.operators.results.write:1 (operators/results) imports prefixflow.operators.stages.plan "
            "(operators/stages)",
            "prefixflow.operators.stages.read:1 (operators/stages) imports prefixflow.operators.faces.processor "
            "(operators/faces)",
        ]
    )
