# The two commands of the README: `make train` and `make test`. Each creates .venv when it is missing.
# torch is installed first and alone, pinned, so that nothing later asks the resolver for another build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: train test venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,crafter,dmc,atari,sweeps,media,ray]'
	touch $@

train: venv
	$(PY) -m dreamer.train $(ARGS)

test: venv
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV)
