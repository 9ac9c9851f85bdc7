"""`prefixflow prepare` (prefixflow/prepare.py): the machine's one-time work, which `make install`
runs, leaves the CPU kernels and the converted packaged model in the cache, and a second run
redoes nothing."""

from __future__ import annotations

import os

import pytest

from prefixflow.cli import main
from prefixflow.kernels import cpu_exact, cpu_kernels, cpu_linear
from prefixflow.paths import cache_root

LIBRARIES = ("cpu_kernels", "cpu_exact", "cpu_linear")


def _clear_built() -> None:
    for cached in (cpu_kernels._library, cpu_exact._library, cpu_linear._library):
        cached.cache_clear()


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A cache with no kernels built; its models/ is this machine's (the packaged model is
    converted once per machine, not once per test)."""
    models = cache_root() / "models"
    models.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("PREFIXFLOW_CACHE", str(tmp_path))
    (tmp_path / "models").symlink_to(models, target_is_directory=True)
    _clear_built()  # this process loaded them from the real cache
    yield tmp_path
    _clear_built()  # later tests load them from the real cache again


def test_prepare_builds_the_kernels_and_converts_the_model_once(empty_cache, capsys):
    assert main(["prepare"]) == 0
    lines = capsys.readouterr().out.splitlines()
    built = {p.name.rsplit("_", 1)[0]: p for p in (empty_cache / "kernels").glob("*.so")}
    assert set(built) == set(LIBRARIES), lines
    assert any(line.startswith("prefixflow: CPU kernels: built for this CPU") for line in lines), lines
    [model] = [line for line in lines if "smollm2-135m-instruct" in line]
    if "skipped" not in model:  # the packaged model is installed (`make install`), converted now or before
        folder = model.split(": ", 2)[2]
        assert os.path.isfile(os.path.join(folder, "config.json")), model
    stamps = {name: p.stat().st_mtime_ns for name, p in built.items()}

    _clear_built()  # a new process would find the cache, as the second run does
    assert main(["prepare"]) == 0
    assert capsys.readouterr().out.splitlines() == lines
    again = {p.name.rsplit("_", 1)[0]: p.stat().st_mtime_ns for p in (empty_cache / "kernels").glob("*.so")}
    assert again == stamps
