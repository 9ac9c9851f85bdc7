"""The names each supported vLLM release defines where the backend looks
(engine/vllm_backend/versions.py SOURCES), read from the release's source with ast.

Recorded from the sdists on PyPI (checked against PyPI's sha256) into vllm_api_names.json:
which of the names the backend uses or lets a job set (`checked_names`) each release lacks.

    cd tests && ../.venv/bin/python -m support.vllm_sources

tests/cpu/test_vllm_versions.py reads that file, and reads the installed vLLM with the same
function (`names_in`), so the recording and what runs here are read alike.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prefixflow.engine.vllm_backend.args import ALLOWED, COMPILATION_CONFIG, OWN_ARGS, vllm_package_root
from prefixflow.engine.vllm_backend.versions import SOURCES, SUPPORTED, USED

RECORDING = Path(__file__).with_name("vllm_api_names.json")
PYPI = "https://pypi.org/pypi/vllm/json"

Reader = Callable[[str], str]  # file under the vllm package -> its text


def checked_names() -> dict[str, list[str]]:
    """What the recording checks: every name the backend uses (versions.USED) and the engine
    arguments a job may set or prefixflow sets (engine/vllm_backend/args.py)."""
    checked = {where: set(names) for where, names in USED.items()}
    checked["EngineArgs"] |= set(ALLOWED) | set(OWN_ARGS)
    checked.setdefault("CompilationConfig", set()).update(COMPILATION_CONFIG.keys)
    return {where: sorted(names) for where, names in sorted(checked.items())}


def missing_in(read: Reader, checked: dict[str, list[str]]) -> dict[str, list[str]]:
    """The checked names one vLLM source tree lacks (where -> names; none: left out)."""
    found = names_in(read)
    missing = {where: [n for n in names if n not in found[where]] for where, names in checked.items()}
    return {where: names for where, names in missing.items() if names}


def names_in(read: Reader) -> dict[str, list[str]]:
    """Every SOURCES entry's names in one vLLM source tree (read: its files by path)."""
    trees: dict[str, ast.Module] = {}
    out = {}
    for where, (path, qualname) in SOURCES.items():
        if path not in trees:
            trees[path] = ast.parse(read(path))
        out[where] = sorted(_names(trees[path], qualname))
    return out


def _names(tree: ast.Module, qualname: str) -> set[str]:
    if not qualname:
        return _module_names(tree)
    cls_name, _, method = qualname.partition(".")
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
    if cls is None:
        return set()
    if method:
        fn = next(
            (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == method), None
        )
        return set() if fn is None else {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    return _class_names(cls)


def _module_names(tree: ast.Module) -> set[str]:
    """Top-level definitions and imports (also under `if TYPE_CHECKING:`), the keys of a
    MODULE_ATTRS table (vllm/__init__.py's lazy exports) and envs.py's environment_variables."""
    names: set[str] = set()
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
            names.update(_dict_keys(node.value, node.target.id))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    names.update(_dict_keys(node.value, target.id))
    return names


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            out += _top_level(node.body) + _top_level(getattr(node, "orelse", []))
    return out


def _dict_keys(value: ast.expr | None, name: str) -> set[str]:
    if name not in ("MODULE_ATTRS", "environment_variables") or not isinstance(value, ast.Dict):
        return set()
    return {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def _class_names(cls: ast.ClassDef) -> set[str]:
    """Fields, class attributes (enum members), methods and properties, and the attributes
    its methods set on self."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            for inner in ast.walk(node):
                targets = inner.targets if isinstance(inner, ast.Assign) else [getattr(inner, "target", None)]
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def installed_reader() -> Reader:
    """The installed vLLM's files (found without importing it)."""
    root = vllm_package_root()
    return lambda path: (root / path).read_text(encoding="utf-8")


def sdist_reader(version: str, releases: dict) -> tuple[Reader, str]:
    """The SOURCES files of vLLM `version`'s sdist from PyPI, and its sha256 (checked against
    PyPI's)."""
    sdist = next(u for u in releases[version] if u["packagetype"] == "sdist")
    url = sdist["url"] if sdist["url"].startswith("http") else "https://pypi.org/" + sdist["url"].lstrip("./")
    data = urllib.request.urlopen(url, timeout=300).read()
    digest = hashlib.sha256(data).hexdigest()
    assert digest == sdist["digests"]["sha256"], f"vllm {version}: sha256 {digest} is not PyPI's"
    wanted = {f"vllm/{path}" for path, _ in SOURCES.values()}
    files = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|gz") as tar:  # one pass: no seeking back
        for member in tar:
            name = member.name.split("/", 1)[-1]
            if member.isfile() and name in wanted:
                f = tar.extractfile(member)
                assert f is not None
                files[name.removeprefix("vllm/")] = f.read().decode()
    return files.__getitem__, digest


def record(versions: tuple[str, ...] = SUPPORTED) -> dict:
    releases = json.loads(urllib.request.urlopen(PYPI, timeout=60).read())["releases"]
    checked = checked_names()
    out: dict = {"checked": checked, "versions": {}}
    for version in versions:
        read, digest = sdist_reader(version, releases)
        out["versions"][version] = {"sdist_sha256": digest, "missing": missing_in(read, checked)}
        print(f"vllm {version}: read", file=sys.stderr)
    return out


if __name__ == "__main__":
    RECORDING.write_text(json.dumps(record(), indent=1) + "\n")
    print(f"wrote {RECORDING}")
