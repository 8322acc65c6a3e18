# sparkbus: `make demo` (set up what the demo needs + the end-to-end demo) and `make test` (set up the development
# tools too + the whole suite). Two stamps: the demo's venv holds the package and its [demo] extra only; the suite's,
# linters' and benchmark's tools are added by `make test`, `make lint` or `make bench` (the same venv, one step more).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup setup-demo demo test lint unit integration bench bench-quick clean

setup: $(VENV)/.installed
setup-demo: $(VENV)/.demo-installed

$(VENV)/.demo-installed: pyproject.toml
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10) and "sparkbus needs Python >= 3.10")'
	@command -v java >/dev/null || { echo "sparkbus needs Java 17+ for Spark (java not found)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	# torch pinned first: the CPU build that lies on our machines' disk (an open range would pull a
	# multi-GB CUDA build from PyPI); the [torch] extra's range (in [demo] and [all]) is then already satisfied
	$(PY) -m pip install --quiet 'torch==2.13.0'
	# [demo]: Spark, MPI (mpiexec), rich, torch and the image example's Pillow and scikit-learn
	$(PY) -m pip install --quiet -e '.[demo]'
	touch $@

# [all]: every user's extra (Spark, Spark Connect, MPI, torch, the broker's metrics and status --watch), which the
# suite exercises; then the suite's, the linters' and the benchmark's own
$(VENV)/.installed: $(VENV)/.demo-installed
	$(PY) -m pip install --quiet -e '.[all,demo,test,bench]'
	touch $@

demo: setup-demo
	$(VENV)/bin/sparkbus demo $(ARGS)

# The whole suite, then the guarantees and the fuzz test again with every broker run with --auth and every
# client holding a key (tests/conftest.py, SPARKBUS_TEST_AUTH); only the first with ARGS (a selection). The suite
# runs in TEST_WORKERS processes (pytest-xdist), each test module whole in one of them, in the order collected
# (integration first: no long module is left for the end; the short unit tests fill it); TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: setup
	$(PY) -m pytest $(XDIST) $(ARGS)
	$(if $(ARGS),,SPARKBUS_TEST_AUTH=1 $(PY) -m pytest $(XDIST) tests/integration/test_fuzz.py tests/integration/test_guarantees.py)

# ruff over the whole tree, mypy over the library (the parts, launch/ and the demo; not examples/); both configured in pyproject.toml. mypy
# reads the package as installed: build/mypy/sparkbus, links to the folders that pyproject.toml maps under sparkbus
lint: setup
	$(VENV)/bin/ruff check .
	rm -rf build/mypy && mkdir -p build/mypy/sparkbus
	ln -s $(CURDIR)/sparkbus/*.py build/mypy/sparkbus/
	ln -s $(CURDIR)/sparkbus/demo $(CURDIR)/sparkbus/bench build/mypy/sparkbus/
	for part in feeder broker worker wire launch; do ln -s $(CURDIR)/$$part build/mypy/sparkbus/$$part; done
	$(VENV)/bin/mypy

bench: setup
	$(PY) benchmarks/bench.py $(ARGS)

bench-quick: setup
	$(PY) benchmarks/bench.py --quick --out $${OUT:-/tmp/sparkbus-bench} $(ARGS)

unit: setup
	$(PY) -m pytest $(XDIST) tests/unit $(ARGS)

integration: setup
	$(PY) -m pytest $(XDIST) tests/integration $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
