# `make train` / `make test` create .venv on first use: CPU torch first (a wheel on local disk), then the rest.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.canopy-installed

.PHONY: train test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/update_step.py

clean:
	rm -rf outputs .cache
