# promptstore: `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Linux: MLX's CPU wheel bundles a slow reference BLAS. Benchmarks preload
# OpenBLAS when it is installed (`make openblas`) so no-cache baselines are fair.
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
BLAS_ENV := $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS),)

.PHONY: setup demo test test-slow bench bench-anchors soak soak-quick openblas clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BLAS_ENV) $(BIN)/promptstore demo

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

# Each benchmark prints its table and writes JSON under bench-results/.
bench: setup
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_snapshots.py
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_tiers.py
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_index.py
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_store.py
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_compact.py
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_anchors.py

# Side by side with mlx-lm (LRU, files) on one machine, about 10 min on 2 cores;
# writes bench-results/anchors-cpu.json (+ .png) and docs/benchmarks.md.
bench-anchors: setup
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_anchors.py

# Longer fault, corruption and concurrency runs; prints figures, writes bench-results/soak.json.
soak: setup
	$(BIN)/python tools/soak.py
	$(BIN)/python -m pytest -q -m slow tests/reliability tests/store

soak-quick: setup
	$(BIN)/python tools/soak.py --quick

openblas:
	@test -f $(OPENBLAS) || (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
