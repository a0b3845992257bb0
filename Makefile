# `make serve` and `make test` each create .venv on first use and install everything.
# torch==2.13.0 is installed first so that no multi-GB CUDA build is ever pulled here.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

# two test processes (pytest-xdist); worksteal hands each a half of the tests in order (a module's servers mostly
# start once) and lets one take from the other's rest when it runs out
TEST_PROCESSES ?= -n 2 --dist worksteal

.PHONY: serve test test-fast install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test,ray]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/loraswap serve --model demo --adapters demo-adapters --demo-adapters

# the layering and the size of functions are checked before the tests run
test: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check src tests tools
	$(VENV)/bin/python -m pytest -q $(TEST_PROCESSES) tests

# before every commit: everything but the soak, load, Ray, browser and slow tests (CI runs `make test`)
test-fast: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check src tests tools
	$(VENV)/bin/python -m pytest -q $(TEST_PROCESSES) -m "not soak and not load and not ray and not browser and not slow" --durations=15 tests

clean:
	rm -rf $(VENV)
