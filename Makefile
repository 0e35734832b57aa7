# Quick start: `make demo` runs the main job, `make test` runs the checks.
# Both build .venv on first use: CPU torch from the local wheel (never a CUDA
# download), then ftdist editable with its dev extra.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ftdist-installed
PYTEST_ARGS ?=

.PHONY: setup demo test lint typecheck bench proto clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is installed first and pinned so that pip never resolves `torch>=2.7`
# to the newest CUDA build from the registry.
$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The main job: about two minutes on a 2-core machine (a 75 s run with
# failures, then the same job without them to compare). DEMO_ARGS adds flags.
DEMO_ARGS ?=
demo: setup
	$(VENV)/bin/ftdist demo --baseline $(DEMO_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests bench examples

typecheck: setup
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) bench/process_group.py
	$(PY) bench/lighthouse.py
	$(PY) bench/recovery.py

# Regenerates the committed protobuf modules from coordination/proto.
proto: setup
	$(PY) -m grpc_tools.protoc -I src/ftdist/_rpc/proto \
		--python_out=src/ftdist/_rpc/_proto \
		--pyi_out=src/ftdist/_rpc/_proto \
		src/ftdist/_rpc/proto/torchft.proto \
		src/ftdist/_rpc/proto/ftdist.proto

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
