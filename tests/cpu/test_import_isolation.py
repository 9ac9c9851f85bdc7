"""The planning layers import neither torch nor ray (they run on the driver and in CPU tasks)."""

import subprocess
import sys

import pytest

LIGHT_MODULES = [
    "prefixflow",
    "prefixflow.requests",
    "prefixflow.errors",
    "prefixflow.paths",
    "prefixflow.model_source",  # the torch-free pieces every layer needs (tests/cpu/test_layers.py)
    "prefixflow.tokenizer",
    "prefixflow.sandbox",  # every template's bounded Jinja, with its limits and clock
    "prefixflow.digest",
    "prefixflow.storage",
    "prefixflow.retry",
    "prefixflow.pipeline",
    "prefixflow.engine.config",
    "prefixflow.engine.models.model_args",  # the model's shape, read by the driver's preflight
    "prefixflow.engine.scoring.srjf",
    "prefixflow.engine.native.scheduler",
    "prefixflow.engine.native.block_manager",
    "prefixflow.engine.native.step",
    "prefixflow.engine.scoring.options",
]


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_module_imports_no_torch_or_ray(module):
    code = (
        f"import sys, {module}\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'triton', 'transformers'))\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} pulled in: {out.stdout.strip()[:200]}"


def test_planner_builds_a_plan_without_torch():
    code = (
        "import sys\n"
        "from prefixflow.pipeline import build_plan\n"
        "plan = build_plan([[1, 2, 3], [1, 2, 4]], order='dfs', num_replicas=2)\n"
        "assert plan.summary['num_rows'] == 2\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_packages_lazy_names_are_the_apis_names():
    """`prefixflow.X` resolves the names of api.__all__, listed in prefixflow/__init__.py so
    that `import prefixflow` imports nothing: the two lists agree."""
    import prefixflow
    from prefixflow import api

    assert sorted(prefixflow.__all__) == sorted(["__version__", *api.__all__])
    assert all(getattr(prefixflow, name) is getattr(api, name) for name in api.__all__)
