"""`prefixflow prepare`: the work a machine does once, done before the first job needs it.

Without it the first job does it, in whichever process gets there first, and pays for it inside
its own run: converting the packaged SmolLM2-135M GGUF file into a Hugging Face folder (the model
of `prefixflow demo` and of a spec that names `smollm2-135m-instruct`) and compiling the C CPU
kernels for this CPU (kernels/cpu_build.py), each cached under $PREFIXFLOW_CACHE. `make install`
runs it. Running it again finds each cache and does nothing; a step that cannot be done here (no
packaged model, no C compiler) is reported and skipped, as a job would skip it.
"""

from __future__ import annotations

from collections.abc import Callable

PACKAGED_MODEL = "smollm2-135m-instruct"


def prepare() -> list[str]:
    """Each step done (or found done), one line each saying what it left in the cache."""
    steps: list[Callable[[], str]] = [_packaged_model, _cpu_kernels]
    return [step() for step in steps]


def _packaged_model() -> str:
    # lazy: the conversion's modules (transformers, gguf) load only for this step
    from prefixflow.model_source import ModelError, resolve_model

    try:
        return f"{PACKAGED_MODEL}: {resolve_model(PACKAGED_MODEL)}"
    except ModelError as e:  # not installed (the floor venv): a job naming it says the same
        return f"{PACKAGED_MODEL}: skipped ({e})"


def _cpu_kernels() -> str:
    # lazy: torch (the kernels' callers) loads only for this step
    from prefixflow.kernels import cpu_build, cpu_exact, cpu_kernels, cpu_linear

    built = {"cpu_kernels": cpu_kernels.build(), "cpu_exact": cpu_exact.build(), "cpu_linear": cpu_linear.build()}
    missing = [name for name, ok in built.items() if not ok]
    if missing:  # cpu_build logged why; the engine runs its torch code instead
        return f"CPU kernels: {', '.join(missing)} not built (the torch code runs instead)"
    return f"CPU kernels: built for this CPU ({cpu_build.vector_floats()} floats a vector) in {cpu_build.kernel_dir()}"
