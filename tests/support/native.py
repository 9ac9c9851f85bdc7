"""The native backend's greedy outputs as an oracle for other backends' whole jobs."""

from __future__ import annotations

from typing import Any


def native_tokens(spec: dict[str, Any], rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    """The native backend's greedy outputs for a job spec's rows and prompts, by the same
    replica runner (batch_generator.Generator) in this process: cheaper than a second whole
    job. id -> generated tokens."""
    import pyarrow as pa

    from prefixflow.operators.faces.batch_generator import Generator

    engine = {k: v for k, v in spec["engine"].items() if k not in ("backend", "vllm", "http")}
    gen = Generator(model=spec["model"], prompt=spec["prompt"], sampling=spec["sampling"], engine=engine)
    out = gen(pa.Table.from_pylist(rows))
    return dict(zip(out.column("id").to_pylist(), out.column("generated_tokens").to_pylist()))
