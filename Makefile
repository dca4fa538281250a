# The two commands of the README: `make demo` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ddpkit-installed
NPROC  ?= 2

.PHONY: demo test test-fast lint format bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ddpkit train -c configs/digits.yaml out_dir=runs/demo --nproc-per-node $(NPROC)

test: $(STAMP)
	$(PY) -m pytest tests

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow and not system"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff format src tests examples benchmarks
	$(VENV)/bin/ruff check --fix src tests examples benchmarks

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache
