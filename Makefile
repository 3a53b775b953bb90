# promptstore: `make demo` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Linux: MLX's CPU wheel bundles a slow reference BLAS. Benchmarks preload
# OpenBLAS when it is installed (`make openblas`) so no-cache baselines are fair.
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
BLAS_ENV := $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS),)

.PHONY: setup demo test test-slow test-gpu cold-stress lint format bench bench-anchors peers bench-serve soak soak-quick openblas redis redis-cluster redis-sentinel clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BLAS_ENV) $(BIN)/promptstore demo

# Two workers (JOBS=1 for one): every server and Redis a test starts takes a free loopback port.
JOBS ?= 2
test: setup redis lint
	$(BIN)/python -m pytest -q -n $(JOBS)

# One style, checked in CI (`make test` runs it first); `make format` applies it.
lint: setup
	$(BIN)/ruff check promptstore tests tools
	$(BIN)/ruff format --check --quiet promptstore tests tools

format: setup
	$(BIN)/ruff check --fix promptstore tests tools
	$(BIN)/ruff format promptstore tests tools

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

# The serve, generation and shutdown tests on MLX's CUDA backend, run ON the GPU machine
# (docs/serve.md, "Serve tests on a GPU"): no .venv there, so it runs $(PYTHON) with .gpu/w2
# and .gpu/w4 installed into /tmp/site and PYTHONPATH=/tmp/site:$$PWD. It fails unless MLX's
# default device is the GPU (ALLOW_CPU=1 to try it on a CPU). Writes NAME.json (a summary),
# NAME.junit.xml and NAME.log to $$OUT where set, else to bench-results/.
# PART=A or PART=B runs one half (each well inside one 10-minute device call; B takes every
# serve test file not in A, new ones included), TESTS=... any selection; BUDGET stops pytest
# (SIGINT: it still writes its report) that many seconds in; COMMIT names the commit where
# there is no .git. `tools/gpu/run-tests.py --merge A.json B.json` joins two halves' summaries.
GPU_TESTS_A := tests/serve/test_shutdown.py tests/serve/test_generation_loop.py tests/serve/test_hostile.py \
	tests/serve/test_requests.py tests/serve/test_lifecycle.py
GPU_TESTS_B := $(filter-out $(GPU_TESTS_A),$(sort $(wildcard tests/serve/test_*.py))) \
	tests/store/test_end_to_end.py tests/store/test_hybrid_checkpoints.py tests/store/test_tokens.py \
	tests/caches/test_dropin.py tests/cli/test_chat.py
PART ?=
TESTS ?= $(if $(PART),$(GPU_TESTS_$(PART)),$(GPU_TESTS_A) $(GPU_TESTS_B))
NAME ?= test-gpu$(if $(PART),-$(PART))
TEST_TIMEOUT ?= 300
BUDGET ?= 540
test-gpu:
	$(PYTHON) tools/gpu/run-tests.py --name $(NAME) --timeout $(TEST_TIMEOUT) --budget $(BUDGET) \
	  $(if $(ALLOW_CPU),--allow-cpu) $(if $(COMMIT),--commit $(COMMIT)) -- $(TESTS) $(PYTEST_ARGS)

# The cold path's tests (reads, checksums, plans, warm start, corruption, crashes)
# 20 times in a row, each test under a 120 s bound, while the whole suite runs
# beside them: on 2 cores, about 20 minutes. Any failure or hang fails the target.
COLD_TESTS := tests/snapshots/test_cold.py tests/snapshots/test_reader.py tests/store/test_cold_plan.py tests/store/test_warm_start.py \
	tests/store/test_corruption.py tests/store/test_crash.py tests/store/test_tiers.py
cold-stress: setup redis
	@tmp=$$(mktemp -d); \
	$(BIN)/python -m pytest -q -p no:cacheprovider --basetemp=$$tmp/suite > $$tmp/suite.log 2>&1 & suite=$$!; \
	for i in $$(seq 20); do \
	  $(BIN)/python -m pytest -q -x -p no:cacheprovider --timeout=120 --basetemp=$$tmp/cold $(COLD_TESTS) > $$tmp/cold.log 2>&1 \
	    || { tail -40 $$tmp/cold.log; kill $$suite 2>/dev/null; echo "cold-path tests failed on run $$i"; exit 1; }; \
	  echo "cold-path tests, run $$i of 20: $$(tail -1 $$tmp/cold.log)"; \
	done; \
	wait $$suite && echo "whole suite beside them: $$(tail -1 $$tmp/suite.log)" \
	  || { tail -40 $$tmp/suite.log; echo "the suite beside them failed"; exit 1; }; \
	rm -rf $$tmp

# Each benchmark prints its table and writes JSON under bench-results/.
bench: setup
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_snapshots.py
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_tiers.py
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_index.py
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_store.py
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_compact.py
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_wear.py
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_anchors.py

# Side by side with mlx-lm (LRU, files) on one machine, about 10 min on 2 cores;
# writes bench-results/anchors-cpu.json (+ .png) and docs/benchmarks.md.
bench-anchors: setup
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_anchors.py

# vllm-mlx 0.6.0, a peer server for tools/bench/bench_serve.py, in a venv of its own under .peers/
# (git-ignored; never a dependency of promptstore): it pins mlx-lm < 0.32, and on Linux it serves on
# MLX's CPU backend (mlx[cpu]). About 6.5 GB: its dependencies bring torch with CUDA libraries.
PEERS_VENV := .peers/vllm-mlx
peers:
	@test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install --quiet vllm-mlx==0.6.0 'mlx[cpu]'

# promptstore serve beside mlx_lm.server and vllm-mlx on three workloads (chat with restarts, memory
# pressure, one agent), three runs each; writes bench-results/serve-cpu.json and docs/benchmarks.md.
bench-serve: setup peers
	$(BLAS_ENV) $(BIN)/python tools/bench/bench_serve.py

# Longer fault, corruption and concurrency runs; prints figures, writes bench-results/soak.json.
soak: setup
	$(BIN)/python tools/soak.py
	$(BIN)/python -m pytest -q -m slow tests/reliability tests/store tests/serve/test_shutdown.py

soak-quick: setup
	$(BIN)/python tools/soak.py --quick

openblas:
	@test -f $(OPENBLAS) || (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread)

# The remote-tier tests start a real redis-server on a free loopback port.
# Installed when missing; where it cannot be, those tests skip and say why.
redis:
	@command -v redis-server >/dev/null || test -x /usr/bin/redis-server || \
	  (DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	   DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null) || \
	  echo "redis-server could not be installed: the remote-tier tests will skip"

# A Redis Cluster (3 primaries, 3 replicas) on free loopback ports, for trying the
# shared tier by hand: prints its remote_url; Ctrl-C tears it down.
redis-cluster: setup redis
	$(BIN)/python -m promptstore.testing.redis_cluster

# A primary, its replica and three Sentinels on free loopback ports, the same way.
redis-sentinel: setup redis
	$(BIN)/python -m promptstore.testing.redis_sentinel

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
