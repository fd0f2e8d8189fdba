# Two commands on a fresh machine: `make demo` and `make test`. Both create or reuse .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint fmt typecheck bench chaos clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch: an unpinned torch pulls a multi-GB CUDA build (docs/testing.md).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,hf,lightning]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m torchpass.dev.demo

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python -m bench.recovery

# N random failures in one job (default 1000: about 45 minutes on 2 cores); the result goes to docs/benchmarks.md.
chaos: $(STAMP)
	$(BIN)/python -m bench.chaos $(or $(N),1000)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
