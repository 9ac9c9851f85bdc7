"""The native engine: grouped scheduling over a paged KV cache, and the step loop around it.

llm_engine.py (LLMEngine, the step loop) over scheduler.py (BatchLLM's grouped, memory-centric
batching; AlignedServe's decode batches from alignedserve.py), block_manager.py and sequence.py
(torch-free), step.py (the scheduler / model contract), then the model side: model_runner.py
(step_batch.py builds a step's tensors, sampler.py samples) and finish.py (when a request stops).
"""
