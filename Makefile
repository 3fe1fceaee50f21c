# make demo  - set up .venv (Python >= 3.12 found automatically) and run the main demo
# make test  - set up .venv and run the fast tier of the tests (a few minutes)
# make test-all - every test (what CI runs), with the 25 slowest
# make test-gpu - the GPU tier on one GPU (skipped, saying why, without one)
# make test-jax-oldest - the fast tier with the oldest supported JAX, in .venv-jax-oldest
# make bench - set up .venv and run the benchmarks (bench/RESULTS.md)
# make bench-quick - the headline ratios in a few minutes, beside their goals
# make lint  - set up .venv and check the code (ruff, mypy)
# make sizes - the largest modules and classes (reported, not capped)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all venv test test-all test-gpu test-jax-oldest demo bench bench-quick docs clean lint sizes

all: test

$(STAMP): pyproject.toml setup.py
	@PYBIN=$$(sh tools/find_python.sh) || exit 1; \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then \
		echo "creating $(VENV) with $$PYBIN"; rm -rf $(VENV); "$$PYBIN" -m venv $(VENV) || exit 1; \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,demo,pymc]"
	@touch $(STAMP)

venv: $(STAMP)

# the tree's bytecode, written before a run: where PYTHONDONTWRITEBYTECODE is set, every process a
# run starts (each runtime's workers, each script a test runs) would compile every module again
BYTECODE := -m compileall -q -j 0 synkhronos tests bench demos

# the test files holding tests that run alone (marked serial): their phase collects only those
SERIAL_FILES = $(shell grep -l "mark.serial" tests/test_*.py)

test: $(STAMP)
	$(PY) $(BYTECODE) > /dev/null
	$(PY) -m pytest -q -n 2 -m "not slow and not gpu and not serial" tests
	$(PY) -m pytest -q -m "serial and not slow and not gpu" $(SERIAL_FILES)

test-all: $(STAMP)
	$(PY) $(BYTECODE) > /dev/null
	$(PY) -m pytest -q -n 2 -m "not serial and not gpu" --durations=25 tests
	$(PY) -m pytest -q -m "serial and not gpu" --durations=25 $(SERIAL_FILES)

# the GPU tier: one GPU, when JAX finds one (else every test says it was skipped, and why)
test-gpu: $(STAMP)
	$(PY) $(BYTECODE) > /dev/null
	SYNK_TEST_GPU=1 $(PY) -m pytest -q -rs -m gpu tests/test_gpu.py

# the oldest JAX the supported range holds (pyproject.toml), in a venv of its own: make test there
OLDEST_JAX := 0.11.2
VENV_OLD   := .venv-jax-oldest
test-jax-oldest:
	@PYBIN=$$(sh tools/find_python.sh) || exit 1; \
	if [ ! -x $(VENV_OLD)/bin/python ]; then "$$PYBIN" -m venv $(VENV_OLD) || exit 1; fi
	$(VENV_OLD)/bin/python -m pip install -q -e ".[test,demo,pymc]" "jax==$(OLDEST_JAX)" "jaxlib==$(OLDEST_JAX)"
	$(VENV_OLD)/bin/python -c "import jax; assert jax.__version__ == '$(OLDEST_JAX)', jax.__version__"
	$(VENV_OLD)/bin/python $(BYTECODE) > /dev/null
	$(VENV_OLD)/bin/python -m pytest -q -m "not slow and not gpu" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

demo: $(STAMP)
	$(PY) demos/mnist.py --epochs 10

bench: $(STAMP)
	$(PY) -m bench

bench-quick: $(STAMP)
	$(PY) -m bench.quick

clean:
	rm -rf $(VENV) *.egg-info

docs: $(STAMP)
	$(PY) tools/gen_api_docs.py

sizes:
	$(PY) .ci/sizes
