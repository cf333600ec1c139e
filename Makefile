# tierkv: `make test` (set-up + tests), `make demo` (set-up + the main job), `make bench`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed

.PHONY: setup system-deps test demo bench clean

setup: $(STAMP)

# torch: the CPU build (2.13.0) unless CUDA is present; then the extras.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[dev,redis,mooncake]'
	touch $@

# Real servers for the remote-tier tests (redis-server; libibverbs1 lets Mooncake import).
system-deps:
	@bash scripts/install-system-deps.sh

test: setup system-deps
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/tierkv run

bench: setup
	$(PY) bench/tiers.py --quick --json bench/results/tiers.json
	$(PY) bench/lookup.py --quick --json bench/results/lookup.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
