"""examples/grpo_minimal.py computes what `polo train` computes: on one fixed batch its loss and its update
equal polo's update path (polo.rl.update over polo.core) to fp32 tolerance, and its defaults are the recipe's.
It also runs end to end: a few GRPO steps on the tiny test model, and a clear exit without a model."""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from polo.config import load_config
from polo.generation.rollouts import Rollouts
from polo.rl.batching import Batch
from polo.rl.setup import set_up
from polo.rl.step import compute_advantages, score_before_update
from polo.rl.update import policy_update

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_minimal.py"
RECIPE = ROOT / "recipes" / "grpo_arith.yaml"  # the recipe the example's defaults follow (`make demo`)
ACCURACY_LINE = re.compile(r"^greedy accuracy on 2 held-out problems: (\S+) before -> (\S+) after$")


def load_example() -> ModuleType:
    """Return examples/grpo_minimal.py as a module (its script part runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("grpo_minimal", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_the_example_defaults_are_the_recipe():
    args, config = load_example().Args(), load_config(str(RECIPE))
    alg, train, sampling = config.algorithm, config.train, config.sampling
    assert config.algorithm.name == "grpo" and (alg.policy_loss, alg.loss_aggregation) == (
        "ppo_clip",
        "seq_mean_token_mean",
    )
    assert (alg.advantage_estimator, alg.kl_estimator, alg.scale_rewards) == ("grpo", "k3", True)
    assert (args.group_size, args.beta, args.update_epochs) == (alg.group_size, alg.beta, alg.update_epochs)
    assert args.clip_eps == alg.clip_eps_low == alg.clip_eps_high
    assert (args.temperature, args.top_p, args.max_new_tokens) == (
        sampling.temperature,
        sampling.top_p,
        sampling.max_new_tokens,
    )
    # micro_batch_size is not compared: it bounds memory, and the gradient is the batch's either way.
    assert (args.steps, args.prompts_per_step) == (train.steps, train.prompts_per_step)
    assert (args.learning_rate, args.warmup_steps, args.max_grad_norm, args.seed) == (
        train.learning_rate,
        train.warmup_steps,
        train.max_grad_norm,
        train.seed,
    )
    optimizer, _ = load_example().build_optimizer(torch.nn.Linear(2, 2), args)
    assert optimizer.defaults["betas"] == (train.adam_beta1, train.adam_beta2)
    assert optimizer.defaults["weight_decay"] == train.weight_decay and train.lr_schedule == "constant"


# One fixed batch: 2 prompts x 4 completions of 6 tokens; rows 0, 2, 5 and 7 stop early at an EOS.
GROUP_SIZE, COMPLETION_LEN = 4, 6
EOS_AT = {0: 1, 2: 3, 5: 0, 7: 4}
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
# A KL term and two epochs, so that the loss is not ~0 by construction (ratio 1, advantages centred).
SETTINGS = {"beta": 0.1, "update_epochs": 2, "micro_batch_size": 3, "learning_rate": 1e-3, "warmup_steps": 0}


def fixed_completions(tokenizer) -> torch.Tensor:
    """Return (8, COMPLETION_LEN) completion ids: random characters, EOS then padding where EOS_AT says."""
    ids = torch.randint(4, len(tokenizer), (len(REWARDS), COMPLETION_LEN), generator=torch.Generator().manual_seed(0))
    for row, position in EOS_AT.items():
        ids[row, position] = tokenizer.eos_token_id
        ids[row, position + 1 :] = tokenizer.pad_token_id
    return ids


def polo_run(tiny_model_dir: Path, tmp_path: Path):
    """Return `polo train`'s Run for the example's recipe on the tiny model, in fp32, with SETTINGS."""
    overrides = [
        f"model.name={tiny_model_dir}",
        f"output.dir={tmp_path / 'run'}",
        "train.precision=fp32",
        "train.gradient_checkpointing=false",
        f"algorithm.group_size={GROUP_SIZE}",
        "train.prompts_per_step=2",
        f"sampling.max_new_tokens={COMPLETION_LEN}",
        f"algorithm.beta={SETTINGS['beta']}",
        f"algorithm.update_epochs={SETTINGS['update_epochs']}",
        f"train.micro_batch_size={SETTINGS['micro_batch_size']}",
        f"train.learning_rate={SETTINGS['learning_rate']}",
        f"train.warmup_steps={SETTINGS['warmup_steps']}",
    ]
    return set_up(str(RECIPE), overrides)


def test_the_example_loss_and_update_equal_polo_train_on_one_batch(tiny_model_dir, tmp_path):
    example, run = load_example(), polo_run(tiny_model_dir, tmp_path)
    tokenizer = run.tokenizer
    # The example's model, loaded as the example loads it (plain transformers, fp32, eval mode).
    model = example.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    start, reference = copy.deepcopy(model), copy.deepcopy(model).requires_grad_(False)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), run.model.parameters()))  # the same start
    args = example.Args(model=str(tiny_model_dir), group_size=GROUP_SIZE, max_new_tokens=COMPLETION_LEN, **SETTINGS)
    prompts = example.encode_prompts(tokenizer, [(12, 34), (56, 78)], "cpu")
    completion_ids = fixed_completions(tokenizer)
    eos_ids = torch.tensor([tokenizer.eos_token_id])
    rewards = torch.tensor(REWARDS)

    # The example: its own rollout layout, advantages, reference, optimizer and update.
    rollout = example.rollout_from(prompts, completion_ids, eos_ids, GROUP_SIZE)
    optimizer, scheduler = example.build_optimizer(model, args)
    advantages = example.group_advantages(rewards, GROUP_SIZE)
    example_loss, _ = example.update(model, reference, optimizer, scheduler, rollout, advantages, args)

    # polo train: the same rollouts through its step's reference, advantage and update functions.
    rollouts = Rollouts(
        prompt_ids=prompts.input_ids.repeat_interleave(GROUP_SIZE, dim=0),
        prompt_mask=prompts.attention_mask.repeat_interleave(GROUP_SIZE, dim=0),
        completion_ids=completion_ids,
        completion_mask=rollout.completion_mask,
        truncated=torch.tensor([row not in EOS_AT for row in range(len(REWARDS))]),
        texts=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
        group_size=GROUP_SIZE,
    )
    update_batch = compute_advantages(
        Batch(rollouts, rewards, ["p1", "p2"]), score_before_update(run, rollouts), run.config
    )
    torch.testing.assert_close(update_batch.advantages, example.expand_to_tokens(advantages, rollout.completion_mask))
    metrics = policy_update(run.learner, update_batch, run.config)

    assert abs(example_loss) > 1e-3  # a loss worth comparing: the second epoch's ratio and the KL are not trivial
    # Measured: -0.02052759 both, 5e-7 apart; the parameters moved by 0.28 and ended 3e-7 apart.
    assert example_loss == pytest.approx(metrics["loss"], rel=1e-5)
    # The same update: the parameters moved the same way (Adam's first steps are about lr * sign(gradient)).
    moved = torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), start.parameters())])
    differ = torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), run.model.parameters())])
    assert moved.norm() > 10 * SETTINGS["learning_rate"]
    assert differ.norm() < 1e-4 * moved.norm()


def run_example(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300, env=env)


def parse_step_line(line: str) -> dict[str, str]:
    """'step   1 | reward 0.125 | ... | kl - | 0.3 s' -> {'step': '1', 'reward': '0.125', ..., 'seconds': '0.3'}."""
    *named, seconds = [part.strip() for part in line.split("|")]
    fields = dict(part.split(maxsplit=1) for part in named)
    value, unit = seconds.split()
    assert unit == "s", line
    return {**fields, "seconds": value}


@pytest.mark.parametrize(
    "extra",
    [[], ["--beta", "0.1", "--update-epochs", "2", "--micro-batch-size", "3"]],
    ids=["grpo", "kl-and-two-epochs"],
)
def test_two_steps_on_the_tiny_model(tiny_model_dir: Path, extra: list[str]) -> None:
    result = run_example(
        "--model",
        str(tiny_model_dir),
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "8",
        "--num-eval",
        "2",
        *extra,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()

    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == 2, result.stdout
    for expected_step, line in enumerate(step_lines, start=1):
        fields = parse_step_line(line)
        assert int(fields.pop("step")) == expected_step
        kl = fields.pop("kl")
        if "--beta" in extra:
            fields["kl"] = kl
        else:
            assert kl == "-", line  # no reference model, so no KL to report
        assert set(fields) >= {"reward", "accuracy", "length", "loss", "seconds"}, line
        for name, text in fields.items():
            assert math.isfinite(float(text)), f"{name} is not a finite number in {line!r}"
        assert 0.0 <= float(fields["reward"]) <= 1.0 and 0.0 <= float(fields["accuracy"]) <= 1.0
        assert 1.0 <= float(fields["length"]) <= 8.0

    match = ACCURACY_LINE.match(lines[-1])
    assert match, result.stdout
    assert all(0.0 <= float(value) <= 1.0 for value in match.groups())


def test_missing_default_model_exits_2_with_one_line(tmp_path: Path) -> None:
    # An empty POLO_CACHE is a fresh machine where `make model` has not run yet.
    result = run_example("--steps", "1", env={**os.environ, "POLO_CACHE": str(tmp_path)})
    assert result.returncode == 2
    output = (result.stdout + result.stderr).strip().splitlines()
    assert len(output) == 1, output
    assert "make model" in output[0] and str(tmp_path) in output[0]
