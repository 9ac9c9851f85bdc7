# Everything the project needs is installed by this file into .venv (nothing by hand).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/prefixflow demo

test: $(STAMP)
	$(VENV)/bin/pytest

clean:
	rm -rf $(VENV) build *.egg-info
