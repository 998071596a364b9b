# draftline: train EAGLE-3 draft models, one Make target per stage.
# `make help` lists the targets. Every recipe runs in strict bash; a failed recipe deletes
# its half-written target.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DELETE_ON_ERROR:
.SUFFIXES:
MAKEFLAGS += --warn-undefined-variables --no-builtin-rules
.DEFAULT_GOAL := help

# ---- arguments --------------------------------------------------------------------------
PYTHON ?= python3.11#            interpreter for .venv (the CPU lock is resolved for 3.11)
VENV ?= .venv#                   the project's virtual environment
STACK ?= cpu#                    which lock `make setup` installs: cpu or gpu
UV_VERSION ?= 0.13.9#            uv used to build .venv and the locks
LOCK_DATE ?= 2026-11-28#         locks resolve as of this date (reproducible re-locking)
PYTEST_ARGS ?=#                  extra pytest arguments, e.g. PYTEST_ARGS="-k patchq"

PY := $(VENV)/bin/python
TOOLS := .tools
UV := $(shell command -v uv 2>/dev/null || echo $(TOOLS)/bin/uv)
PATCHES := $(sort $(wildcard patches/*.diff))

# ---- help -------------------------------------------------------------------------------
.PHONY: help
help: ## Show this help
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) \
	  | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

# ---- environment ------------------------------------------------------------------------
$(TOOLS)/bin/uv:
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet uv==$(UV_VERSION)

# The stamp depends on the lock, the patch queue and the applier, so editing any of them
# re-runs setup. uv pip sync leaves an already-patched speculators in place (same version),
# and the applier then either sees the same queue (no-op) or replaces a changed one.
$(VENV)/.setup-$(STACK): requirements/$(STACK).lock $(PATCHES) draftline/patchq.py | $(UV)
	[ -x $(PY) ] || $(UV) venv --quiet --python $(PYTHON) $(VENV)
	$(UV) pip sync --quiet --python $(PY) requirements/$(STACK).lock
	$(PY) -m draftline.patchq apply --replace
	touch $@

.PHONY: setup
setup: $(VENV)/.setup-$(STACK) ## Create .venv from the lock, install speculators, apply patches/

# ---- locks ------------------------------------------------------------------------------
# Humans edit requirements/*.in and overrides-*.txt; these rules write the locks.
LOCK_CPU = requirements/cpu.in --override requirements/overrides-cpu.txt \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --exclude-newer $(LOCK_DATE)
LOCK_GPU = requirements/gpu.in --override requirements/overrides-gpu.txt \
  --python-version 3.12 --python-platform x86_64-manylinux_2_28 --exclude-newer $(LOCK_DATE)

.PHONY: lock
lock: | $(UV) ## Regenerate requirements/{cpu,gpu}.lock from their inputs
	$(UV) pip compile --quiet $(LOCK_CPU) -o requirements/cpu.lock
	$(UV) pip compile --quiet $(LOCK_GPU) -o requirements/gpu.lock

.PHONY: lock-check
lock-check: | $(UV) ## Fail when a lock no longer matches its inputs
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(UV) pip compile --quiet --no-header $(LOCK_CPU) -o $$tmp/cpu.lock; \
	$(UV) pip compile --quiet --no-header $(LOCK_GPU) -o $$tmp/gpu.lock; \
	for l in cpu gpu; do \
	  diff -u <(grep -v '^#' requirements/$$l.lock) $$tmp/$$l.lock \
	    || { echo "requirements/$$l.lock drifted from its inputs: run 'make lock'" >&2; exit 1; }; \
	done; echo "locks match their inputs"

# ---- tests ------------------------------------------------------------------------------
.PHONY: test
test: setup ## Run the default test suite on CPU (real vLLM CPU engine, tiny models)
	$(PY) -m pytest $(PYTEST_ARGS)

# ---- housekeeping -----------------------------------------------------------------------
.PHONY: clean
clean: ## Remove .venv and tool caches (runs/ is kept)
	rm -rf $(VENV) $(TOOLS) .pytest_cache
