# Two entry points: `make serve` and `make test`. Both create .venv and install the project first.
#   make serve ARGS="..."   arguments for `omnistage serve` (e.g. ARGS="/models/Qwen3-Omni --port 60051")
#   TORCH=cpu|cuda|auto     which torch 2.13.0 build to install (auto: cuda when `nvidia-smi -L` finds a GPU)
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH ?= auto
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_BUILD := $(if $(filter auto,$(TORCH)),$(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu),$(TORCH))

.PHONY: install serve test lint protos clean bench-results browser

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned, so nothing else can pull another build.
#  cpu:  a local CPU wheel (pip's find-links) if there is one, with no network; else the CPU index.
#        PyPI's own Linux wheel of torch is the CUDA build (GBs of CUDA libraries): never asked for here.
#  cuda: PyPI's wheel (CUDA 12 libraries as pip packages; needs an NVIDIA driver).
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(TORCH_BUILD),cuda)
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
else ifeq ($(TORCH_BUILD),cpu)
	$(PY) -m pip install -q --no-index --no-deps torch==$(TORCH_VERSION) 2>/dev/null \
		&& $(PY) -m pip install -q torch==$(TORCH_VERSION) \
		|| $(PY) -m pip install -q torch==$(TORCH_VERSION) --index-url $(TORCH_CPU_INDEX)
else
	$(error TORCH must be cpu, cuda or auto, not '$(TORCH)')
endif
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/omnistage serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) lint browser
	$(PY) -m pytest -q

# The playground's browser test drives the system's Chromium (Playwright without its own browser
# download). Installed here when this runs as root with apt-get; otherwise that test says why it skips.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	       && { apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
	            || { apt-get update -q >/dev/null 2>&1 \
	                 && apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; }; } \
	  || echo "note: could not install Chromium (needs root and apt-get); the playground browser test will skip"

protos: $(STAMP)
	$(PY) -m omnistage.cli.protogen

clean:
	rm -rf $(VENV) .pytest_cache

# Regenerates benchmarks/results/ (JSON, PNG, markdown summary); extra ARGS go to `omnistage bench`.
bench-results: $(STAMP)
	bash benchmarks/make_results.sh $(ARGS)
