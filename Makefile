# autohet: `make demo` and `make test` work on a fresh machine (they install first).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PLANS ?= plans
DATA ?= build

.PHONY: install demo test test-torch unit lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@echo "== setting up $(VENV): a Python venv with torch (CPU build) and autohet; a few minutes the first time, then skipped"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pin torch first: the CPU build of 2.13.0 installs from local disk in seconds,
	# a range would pull a multi-GB CUDA build. pyproject.toml asks users for a range
	# (their CUDA torch stays); this pin must lie inside it (tests/unit/test_packaging.py).
	@echo "== 1/2 torch 2.13.0 (CPU build)"
	$(PY) -m pip install --progress-bar on torch==2.13.0
	@echo "== 2/2 autohet and its dependencies (SCIP, typer, paramiko, ...; test tools)"
	$(PY) -m pip install --progress-bar on -e '.[dev]'
	@echo "== $(VENV) is ready"
	touch $(STAMP)

demo: install
	@echo "== 1. plan a heterogeneous fleet (A100 + V100 + RTX 3090, Sailor's measured OPT-350M)"
	@echo "   (planning only: this fleet is not here, and its closing note is expected: OPT trains"
	@echo "   with your own --model-fn; step 3 trains a LLaMA the runtime has built in)"
	$(VENV)/bin/autohet plan --cluster profiles/clusters/paper-mix.yaml --model OPT-350M \
	  --profile profiles/sailor/OPT-350M.yaml --global-batch-size 64 --name demo-paper-mix \
	  --out-dir $(PLANS) --time-limit 20 --explain
	@echo "== 2. tokenize the shipped sample corpus (KJV, public domain) with the shipped tokenizer"
	test -f $(DATA)/sample-tokens/meta.json || $(VENV)/bin/autohet data prepare \
	  autohet_cli/data/sample/corpus.txt --tokenizer sample --doc-separator blank-line \
	  --out $(DATA)/sample-tokens
	@echo "== 3. plan and launch a small LLaMA on it, on the embedded localhost cluster (2 CPU devices)"
	$(VENV)/bin/autohet plan --model llama-tiny --global-batch-size 8 --precision fp32 \
	  --name demo-local --out-dir $(PLANS) --time-limit 10 --explain
	$(VENV)/bin/autohet launch $$(ls -t $(PLANS)/demo-local.v*.yaml | head -1) \
	  --config examples/demo-run.yaml --data $(abspath $(DATA))/sample-tokens

# Both cores by default (pytest-xdist; a file's tests stay on one worker, so a module's
# shared run, sshd hosts or Slurm start once), after the few tests that time themselves
# against a wall clock or another process (marked alone) ran with nothing beside them. Ends
# with the slowest tests; a test over 30 s without @pytest.mark.slow("why") fails the
# run (tests/conftest.py).
JOBS ?= 2
# Files are handed out in collection order, the heavy tiers first (tests/conftest.py),
# so that the last files a worker gets are small ones. xdist's default would hand them
# out by their number of tests, which puts the few-test, minute-long e2e files last: in
# a simulation of the measured durations the two workers then ended 19 s apart on
# average (36 s at the 90th percentile), 1 s in this order.
PYTEST_PAR := -n $(JOBS) --dist loadfile --no-loadscope-reorder
# Only the files that hold `alone` tests are collected for the serial phase (collecting
# every file costs 15 s).
ALONE_FILES := $(shell grep -rl --include='test_*.py' 'mark\.alone' tests)
# Bytecode caches on: a clean clone's hundreds of worker, agent and CLI processes would
# otherwise each compile the package from source (0.4 s of CPU apiece), and every
# pytest process would rewrite every test module's asserts again (11 s).
unexport PYTHONDONTWRITEBYTECODE

test: install lint
	$(if $(ALONE_FILES),OMP_NUM_THREADS=1 $(PY) -m pytest -q -m alone $(ALONE_FILES))
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_PAR) -m "not alone" --durations=15

# The torch range, proven: `make test-torch TORCH=2.11.0` runs the tests marked
# torch_range (what a torch release can break: DCP save/load/reshard, DTensor TP, ZeRO
# collectives, torch.compile on a block, process groups, the agent's signal handling,
# launch -> shutdown -> resume) under that release, in .venv-torch-2.11.0 (.ci/run: the
# floor of pyproject.toml's range and the CUDA image's 2.11). torch comes from PyPI, a
# CUDA build that runs on CPU; the constraint keeps the project's dependencies from
# replacing it.
TORCH ?=
# More pins for that venv, e.g. 'transformers<5' (5.x needs torch 2.6).
TORCH_CONSTRAINTS ?=

.venv-torch-%/.installed-stamp: pyproject.toml
	python3 -m venv .venv-torch-$*
	.venv-torch-$*/bin/python -m pip install -q --upgrade pip
	printf '%s\n' 'torch==$*' $(foreach c,$(TORCH_CONSTRAINTS),'$(c)') \
	  > .venv-torch-$*/constraints.txt
	.venv-torch-$*/bin/python -m pip install -q -c .venv-torch-$*/constraints.txt 'torch==$*'
	.venv-torch-$*/bin/python -m pip install -q -c .venv-torch-$*/constraints.txt -e '.[dev]'
	touch $@

test-torch: $(if $(TORCH),.venv-torch-$(TORCH)/.installed-stamp)
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=2.11.0" >&2; exit 2; }
	.venv-torch-$(TORCH)/bin/python -c 'import torch; assert torch.__version__.split("+")[0] == "$(TORCH)", torch.__version__'
	OMP_NUM_THREADS=1 .venv-torch-$(TORCH)/bin/python -m pytest -q $(PYTEST_PAR) -m torch_range --durations=10

unit: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_PAR) tests/unit

lint: install
	$(VENV)/bin/ruff check autohet_cli tests benchmarks
	$(VENV)/bin/ruff format --check autohet_cli tests benchmarks
	$(VENV)/bin/mypy autohet_cli

bench: install
	OMP_NUM_THREADS=1 $(PY) -m benchmarks

clean:
	rm -rf $(VENV) .venv-torch-* .pytest_cache .mypy_cache .ruff_cache
