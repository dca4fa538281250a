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

# Tests run on TEST_WORKERS parallel workers (pytest-xdist); the system tests and those marked `serial` run one
# after another on one of them (tests/conftest.py). The last lines name the 20 slowest tests; the per-test times
# are kept in runs/test-report.xml (benchmarks/suite_times.py sums them per folder).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup

# Every test starts many Python processes: ddpkit's modules are compiled once here (compileall writes the .pyc
# files even where PYTHONDONTWRITEBYTECODE is set), not again in each process (0.15 s of CPU each).
test: $(STAMP)
	mkdir -p runs
	$(PY) -m compileall -q src
	$(PYTEST) --durations=20 --junitxml=runs/test-report.xml

test-fast: $(STAMP)
	$(PY) -m compileall -q src
	$(PYTEST) -m "not slow and not system" --durations=10

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
