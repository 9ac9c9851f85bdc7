"""engine.backend: vllm: one replica's engine on vLLM with LLMEngine's interface.

engine.py (VllmEngine), scheduler.py (vLLM's scheduler, observed for per-step statistics; vLLM
loads it by name), args.py (the vLLM arguments a job may pass: torch-free and vLLM-free, checked
in the driver).
"""
