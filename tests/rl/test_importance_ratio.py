"""Every optimizer step of an RL step takes its importance ratio against the policy that sampled the batch, however
the batch is cut into minibatches and epochs (GRPO's π_old, Shao et al. 2024 eq. 3; GSPO's, Zheng et al. 2025 eq. 5)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from conftest import tiny_rl_config
from polo import core
from polo.rl import step as step_module
from polo.rl import update as update_module
from polo.rl.setup import set_up
from polo.rl.update import optimizer_steps_per_batch


def digit_share(completion: str, row: dict) -> float:
    """A dense reward a random tiny model already varies on: the share of digits in the completion."""
    return sum(char.isdigit() for char in completion) / max(len(completion), 1)


def record_update(monkeypatch) -> dict:
    """Record, for every micro-batch the update trains on, its rows and the policy loss's log-probs (current and old),
    and the batch the step hands the update."""
    record = {"rows": [], "logprobs": [], "old": [], "batch": None}

    @dataclasses.dataclass
    class RecordedInputs(core.PolicyLossInputs):
        def __post_init__(self):
            record["logprobs"].append(self.logprobs.detach().clone())
            record["old"].append(self.old_logprobs.detach().clone())

    real_micro_batch_step, real_policy_update = update_module.micro_batch_step, step_module.policy_update

    def micro_batch_step(ctx, micro, normalisers):
        record["rows"].append(micro.clone())
        return real_micro_batch_step(ctx, micro, normalisers)

    def policy_update(learner, batch, config, **kwargs):
        record["batch"] = batch
        return real_policy_update(learner, batch, config, **kwargs)

    monkeypatch.setattr(core, "PolicyLossInputs", RecordedInputs)
    monkeypatch.setattr(update_module, "micro_batch_step", micro_batch_step)
    monkeypatch.setattr(step_module, "policy_update", policy_update)
    return record


# minibatches x epochs, on the token ratio; and the sequence ratio of the GSPO recipe's own cut (two minibatches).
MATRIX = [(1, 1, "ppo_clip"), (2, 1, "ppo_clip"), (4, 1, "ppo_clip"), (1, 2, "ppo_clip"), (2, 2, "ppo_clip")]


@pytest.mark.parametrize(("num_minibatches", "update_epochs", "policy_loss"), [*MATRIX, (2, 1, "gspo")])
def test_every_optimizer_step_takes_its_ratio_against_the_sampling_policy(
    num_minibatches, update_epochs, policy_loss, tiny_model_dir, tmp_path, monkeypatch
):
    config = tiny_rl_config(
        tiny_model_dir,
        tmp_path / "run",
        eval={"before": False, "after": False},
        train={"prompts_per_step": 4, "micro_batch_size": 4, "learning_rate": 3e-3, "warmup_steps": 0},
    )
    overrides = [
        f"train.num_minibatches={num_minibatches}",
        f"algorithm.update_epochs={update_epochs}",
        f"algorithm.policy_loss={policy_loss}",
    ]
    run = set_up(config, overrides, reward_functions={digit_share: 1.0})
    sampling_policy = copy.deepcopy(run.model)
    record = record_update(monkeypatch)
    metrics = step_module.rl_step(run, 1).metrics

    batch, steps = record["batch"], optimizer_steps_per_batch(run.config)
    assert steps == num_minibatches * update_epochs
    assert len(record["rows"]) == 4 * update_epochs  # micro-batches of one group each (micro_batch_size 4)
    scored = step_module.score_completions(
        sampling_policy, batch.rollouts, 16, run.compute, run.config.sampling.temperature
    )
    mask = batch.rollouts.completion_mask.bool()
    moved, drift = [], torch.zeros(3, dtype=torch.float64)  # Σ k3(π_old ‖ π), Σ token ratio, tokens
    assert len(record["logprobs"]) == len(record["old"]) == len(record["rows"])
    for rows, logprobs, old in zip(record["rows"], record["logprobs"], record["old"]):
        width = logprobs.shape[1]
        valid, sampled = mask[rows, :width], scored[rows, :width]
        # The ratio's denominator is the sampling policy's log-prob, whichever optimizer step this is.
        torch.testing.assert_close(old[valid], sampled[valid], rtol=0.0, atol=1e-5)
        moved.append(float((logprobs - sampled)[valid].abs().max()))
        log_ratio = (logprobs - old)[valid].double()
        drift += torch.stack(
            [(log_ratio.exp() - 1 - log_ratio).sum(), log_ratio.exp().sum(), log_ratio.new_tensor(1.0) * valid.sum()]
        )
    # The check has teeth: the first minibatch trains the sampling policy itself, and every micro-batch after the
    # first optimizer step trains a policy that has moved since sampling.
    first_minibatch = 4 // num_minibatches
    assert all(change < 1e-5 for change in moved[:first_minibatch]), moved
    assert all(change > 1e-3 for change in moved[first_minibatch:]), moved
    # The step's row says how far the update moved from the sampling policy: the k3 estimate of KL(π_old ‖ π) and the
    # mean importance ratio over every micro-batch's tokens (GSPO's ratio is its sequence's, on each token).
    assert metrics["approx_kl"] == pytest.approx(float(drift[0] / drift[2]), rel=1e-4, abs=1e-9)
    if policy_loss == "ppo_clip":
        assert metrics["ratio/mean"] == pytest.approx(float(drift[1] / drift[2]), rel=1e-5)
    if steps == 1:
        assert metrics["approx_kl"] < 1e-9 and metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    else:
        assert metrics["approx_kl"] > 1e-6 and metrics["ratio/mean"] != pytest.approx(1.0, abs=1e-6)
    assert {"entropy", "clip_fraction/low", "clip_fraction/high"} <= set(metrics)


def test_the_docs_name_the_trl_and_verl_metric_of_every_update_diagnostic():
    """docs/evaluation.md's table of what an update logs has a row for each diagnostic of a step's row (the KL to the
    sampling policy, the mean importance ratio, both clip fractions, the entropy, the KL to the reference), each
    with what TRL and verl call it (or "none")."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "evaluation.md").read_text()
    table = text.split("## What an update logs")[1].split("\n## ")[0]
    rows = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells
    keys = {"approx_kl", "ratio/mean", "clip_fraction/low", "clip_fraction/high", "entropy", "kl"}
    assert keys <= set(rows), sorted(keys - set(rows))
    assert all(rows[key][1] and rows[key][2] and rows[key][3] for key in keys)
    assert rows["clip_fraction/low"][2] == "`clip_ratio/low_mean`" and rows["entropy"][3] == "`actor/entropy`"
