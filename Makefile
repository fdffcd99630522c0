# Two entry points: `make serve` and `make test`. Both create .venv and install the project first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test lint protos clean bench-results

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is installed first and pinned to the CPU build so nothing pulls the CUDA wheels.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/omnistage serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -q

protos: $(STAMP)
	$(PY) -m omnistage.cli.protogen

clean:
	rm -rf $(VENV) .pytest_cache

# Regenerates benchmarks/results/ (JSON, PNG, markdown summary); extra ARGS go to `omnistage bench`.
bench-results: $(STAMP)
	bash benchmarks/make_results.sh $(ARGS)
