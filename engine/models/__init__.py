"""The model and how it is loaded: llama.py (Llama, Mistral, Qwen2) built from layers/,
loader.py (a Hugging Face folder -> our model, tokenizer, device), tiny.py (tiny deterministic
checkpoints for the tests, the demo and the benchmarks).
"""
