# `make train` / `make test` create .venv on first use: CPU torch first (a wheel on local disk), then the rest.
VENV ?= .venv
# the interpreter the venvs are made from (.ci/run passes it resolved, before it changes HOME)
SYSTEM_PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.canopy-installed

# AppWorld (pydantic<2) lives in its own venv: the pool's AppWorld servers run on its python (canopy/envs/appworld.py).
APPWORLD_VENV ?= .venv-appworld
APPWORLD_STAMP := $(APPWORLD_VENV)/.canopy-installed

.PHONY: train test lint bench clean appworld

$(STAMP): pyproject.toml
	test -x $(PY) || $(SYSTEM_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# `appworld install` unpacks the 11 apps into the package (downloads no data) and AppWorld's own tests into
# APPWORLD_CACHE, kept in the venv so that nothing lands in the user's home.
$(APPWORLD_STAMP):
	test -x $(APPWORLD_VENV)/bin/python || $(SYSTEM_PYTHON) -m venv $(APPWORLD_VENV)
	$(APPWORLD_VENV)/bin/pip install -q appworld==0.1.3.post1
	APPWORLD_CACHE=$(abspath $(APPWORLD_VENV))/appworld-cache $(APPWORLD_VENV)/bin/appworld install
	touch $(APPWORLD_STAMP)

appworld: $(APPWORLD_STAMP)

# ruff lint and format (pyproject.toml: line length 120), then pytest
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint $(APPWORLD_STAMP)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/update_step.py

clean:
	rm -rf outputs .cache
