"""The training loop end to end on a tiny model: outputs, resume, padding, clear errors."""

from __future__ import annotations

import dataclasses
import json
import signal

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import tiny_rl_config as tiny_config
from polo.config import load_config
from polo.data import make_task
from polo.generation.cpu_sampler import rollout
from polo.generation.rollouts import Decoding
from polo.models.loading import load_policy
from polo.rewards import RewardFunctionError, RewardSet
from polo.rl.batching import UpdateBatch, batch_rows
from polo.rl.setup import optimizer_steps
from polo.rl.train import train
from polo.rl.update import Learner, policy_update
from polo.runtime.device import CPU
from polo.runtime.errors import NonFiniteLossError
from polo.runtime.optimizer import build_optimizer, build_schedule

TIME_KEYS = ("time/", "tokens_per_second", "update_tokens_per_second", "timestamp")


def without_times(rows):
    return [{k: v for k, v in row.items() if not k.startswith(TIME_KEYS)} for row in rows]


def final_weights(output_dir):
    """The last checkpoint's weights: the whole model, or the adapter of a LoRA run."""
    latest = sorted((output_dir / "checkpoints").glob("step-*"))[-1]
    weights = latest / "model.safetensors"
    return load_file(str(weights if weights.exists() else latest / "adapter_model.safetensors"))


def interrupted_then_resumed(config, monkeypatch, interrupt_at: int = 3):
    """Return the result of resuming `config` after a Ctrl-C in the middle of step `interrupt_at` (which finishes and
    is saved)."""
    from polo.rl import train as trainer

    real_step, calls = trainer.rl_step, []

    def interrupting_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == interrupt_at:
            signal.raise_signal(signal.SIGINT)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "rl_step", interrupting_step)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    monkeypatch.setattr(trainer, "rl_step", real_step)
    return train(config, ["output.resume=true"])


def test_train_writes_metrics_checkpoints_and_plots(tiny_model_dir, tmp_path):
    result = train(tiny_config(tiny_model_dir, tmp_path / "run"), ["algorithm.beta=0.1", "algorithm.update_epochs=2"])
    rows = [row for row in result.metrics if "reward/mean" in row]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    expected = {
        "reward/mean",
        "reward/std",
        "reward/correct/mean",
        "reward/tag_count/mean",
        "accuracy",
        "completion_length/mean",
        "completion_length/min",
        "completion_length/max",
        "truncated_fraction",
        "kl",
        "entropy",
        "clip_fraction/low",
        "clip_fraction/high",
        "zero_spread_group_fraction",
        "grad_norm",
        "learning_rate",
        "time/generation",
        "time/reward",
        "time/update",
        "tokens_per_second",
        "update_tokens_per_second",
    }
    assert expected <= set(rows[0]), expected - set(rows[0])
    for row in rows:  # the step's real tokens, once per update epoch (2), over the update's time alone
        tokens = row["tokens_per_second"] * row["time/step"]
        assert tokens > 0 and row["update_tokens_per_second"] * row["time/update"] == pytest.approx(2 * tokens)
        # the 8 completions + each of the 2 groups' prompt once (where every row's prompt counts in `tokens`), less
        # the chat template's opening both prompts share, counted once (`test_the_floor_counts_a_shared_prefix_once`)
        completions = 8 * row["completion_length/mean"]
        assert completions < row["floor_tokens"] < completions + (tokens - completions) / 4
    assert all(row["kl"] >= 0 for row in rows)
    assert rows[-1]["kl"] > 0  # the policy has moved away from the reference
    assert (
        1
        <= rows[0]["completion_length/min"]
        <= rows[0]["completion_length/mean"]
        <= rows[0]["completion_length/max"]
        <= 8
    )
    evals = [row for row in result.metrics if "eval/accuracy" in row]
    assert [row["step"] for row in evals] == [0, 4]
    assert result.eval_before is not None and 0.0 <= result.eval_after["accuracy"] <= 1.0
    # a checkpoint is an ordinary transformers directory
    checkpoint = result.output_dir / "checkpoints" / "step-000004"
    reloaded = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    assert isinstance(reloaded, torch.nn.Module)
    assert (checkpoint / "trainer_state.pt").exists()
    for picture in ("reward.png", "accuracy.png", "length.png"):
        assert (result.output_dir / picture).stat().st_size > 1000
    assert any((result.output_dir / "tensorboard").iterdir())
    # training changed the weights
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    end = load_file(str(checkpoint / "model.safetensors"))
    assert any(not torch.equal(start[name], end[name]) for name in start)


def test_resume_equals_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    """Ctrl-C during step 3, resume: same metrics and the same weights as 4 straight steps."""
    straight = train(tiny_config(tiny_model_dir, tmp_path / "straight", output={"save_every": 3}))

    from polo.rl import train as trainer

    real_step, calls = trainer.rl_step, []

    def interrupt_on_third_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C in the middle of step 3
        return real_step(*args, **kwargs)

    interrupted = tiny_config(tiny_model_dir, tmp_path / "resumed", output={"save_every": 3})
    monkeypatch.setattr(trainer, "rl_step", interrupt_on_third_step)
    with pytest.raises(KeyboardInterrupt):
        train(interrupted)
    monkeypatch.setattr(trainer, "rl_step", real_step)
    # Ctrl-C let step 3 finish and saved it (periodic saving alone would have kept nothing)
    assert [p.name for p in (tmp_path / "resumed" / "checkpoints").glob("step-*")] == ["step-000003"]
    resumed = train(interrupted, ["output.resume=true"])
    assert without_times(resumed.metrics) == without_times(straight.metrics)
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_padding_never_contributes_to_the_update(tiny_model_dir):
    """Changing the token ids that stand in padded positions changes neither gradient nor metrics."""
    config = load_config(tiny_config(tiny_model_dir, "unused"))
    model, tokenizer = load_policy(str(tiny_model_dir))
    torch.manual_seed(0)
    batch = rollout(model, tokenizer, ["1+1=", "9+9= please"], 4, Decoding(8, temperature=1.0))
    # a random model rarely stops: end some completions early by hand (EOS, then padding)
    for row, length in enumerate([2, 8, 5, 1, 8, 3, 6, 4]):
        batch.completion_ids[row, length - 1] = tokenizer.eos_token_id
        batch.completion_mask[row, length:] = 0
        batch.completion_ids[row, length:] = tokenizer.pad_token_id
    assert (batch.completion_mask == 0).any() and (batch.prompt_mask == 0).any()
    advantages = torch.linspace(-1, 1, 8)

    def gradients(rollouts):
        probe, _ = load_policy(str(tiny_model_dir))
        optimizer = torch.optim.SGD(probe.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        metrics = policy_update(Learner(probe, optimizer, scheduler, CPU), UpdateBatch(rollouts, advantages), config)
        return [p.grad.clone() for p in probe.parameters()], metrics

    clean_grads, clean_metrics = gradients(batch)
    batch.completion_ids[batch.completion_mask == 0] = 50
    batch.prompt_ids[batch.prompt_mask == 0] = 51
    dirty_grads, dirty_metrics = gradients(batch)
    for clean, dirty in zip(clean_grads, dirty_grads):
        torch.testing.assert_close(clean, dirty, atol=1e-6, rtol=1e-5)
    assert dirty_metrics == pytest.approx(clean_metrics, rel=1e-5, abs=1e-7)


def test_micro_batch_size_does_not_change_the_gradient(tiny_model_dir):
    """Gradient accumulation with global normalisers equals one full-batch backward."""
    model, tokenizer = load_policy(str(tiny_model_dir))
    torch.manual_seed(1)
    batch = rollout(model, tokenizer, ["3+4=", "5+6="], 4, Decoding(8, temperature=1.0))
    advantages = torch.linspace(-1, 1, 8)
    results = []
    for mode in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"):
        for micro in (8, 3):
            config = load_config(
                tiny_config(tiny_model_dir, "unused"),
                [f"train.micro_batch_size={micro}", f"algorithm.loss_aggregation={mode}"],
            )
            probe, _ = load_policy(str(tiny_model_dir))
            optimizer = torch.optim.SGD(probe.parameters(), lr=0.0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            policy_update(Learner(probe, optimizer, scheduler, CPU), UpdateBatch(batch, advantages), config)
            results.append([p.grad.clone() for p in probe.parameters()])
        for full, accumulated in zip(results[-2], results[-1]):
            torch.testing.assert_close(full, accumulated, atol=1e-6, rtol=1e-4)


def test_micro_batch_token_mean_is_the_mean_of_each_micro_batchs_token_mean(tiny_model_dir):
    """TRL's bnpo through the update: micro-batches of 3, 3 and 2 rows each normalise by their own tokens."""
    model, tokenizer = load_policy(str(tiny_model_dir))
    torch.manual_seed(1)
    batch = rollout(model, tokenizer, ["3+4=", "5+6="], 4, Decoding(8, temperature=1.0))
    for row, length in enumerate([2, 8, 5, 1, 8, 3, 6, 4]):  # unequal token counts per micro-batch
        batch.completion_mask[row, length:] = 0
    advantages = torch.linspace(-1, 1, 8)

    def gradients(rollouts, advantages, overrides):  # unclipped: each call's norm differs
        config = load_config(tiny_config(tiny_model_dir, "unused"), ["train.max_grad_norm=1e9", *overrides])
        probe, _ = load_policy(str(tiny_model_dir))
        optimizer = torch.optim.SGD(probe.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        policy_update(Learner(probe, optimizer, scheduler, CPU), UpdateBatch(rollouts, advantages), config)
        return [p.grad.clone() for p in probe.parameters()]

    local = gradients(batch, advantages, ["train.micro_batch_size=3", "algorithm.loss_aggregation=bnpo"])
    parts = [slice(0, 3), slice(3, 6), slice(6, 8)]
    alone = [  # each micro-batch as the whole step: its own token mean
        gradients(
            dataclasses.replace(batch.select(rows), group_size=1),
            advantages[rows],
            ["train.micro_batch_size=8", "algorithm.loss_aggregation=token_mean"],
        )
        for rows in parts
    ]
    for index, grad in enumerate(local):
        torch.testing.assert_close(grad, sum(part[index] for part in alone) / 3, atol=1e-6, rtol=1e-4)
    one_micro_batch = gradients(batch, advantages, ["train.micro_batch_size=8", "algorithm.loss_aggregation=bnpo"])
    token_mean = gradients(batch, advantages, ["train.micro_batch_size=8", "algorithm.loss_aggregation=token_mean"])
    for a, b in zip(one_micro_batch, token_mean):
        torch.testing.assert_close(a, b)
    assert any(not torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(local, token_mean))


def test_nan_loss_is_a_clear_error_and_applies_no_update(tiny_model_dir, tmp_path):
    config = load_config(tiny_config(tiny_model_dir, "unused"))
    model, tokenizer = load_policy(str(tiny_model_dir))
    batch = rollout(model, tokenizer, ["1+1="], 4, Decoding(4, temperature=1.0))
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    before = {name: p.clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(NonFiniteLossError, match="not applied"):
        advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
        policy_update(Learner(model, optimizer, scheduler, CPU), UpdateBatch(batch, advantages), config)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], equal_nan=True)


def test_raising_reward_names_function_and_sample(tiny_model_dir, tmp_path):
    def broken_reward(completion, row):
        raise KeyError("oops")

    with pytest.raises(RewardFunctionError, match="broken_reward") as error:
        train(
            tiny_config(tiny_model_dir, tmp_path / "run", eval={"before": False}), reward_functions={broken_reward: 1.0}
        )
    assert "sample" in str(error.value)


def test_batch_rows_walks_epochs_deterministically():
    rows = [{"i": i} for i in range(10)]
    first_epoch = [row["i"] for step in range(5) for row in batch_rows(rows, step, 2, seed=0)]
    assert sorted(first_epoch) == list(range(10))  # every row once per epoch
    assert first_epoch == [row["i"] for step in range(5) for row in batch_rows(rows, step, 2, seed=0)]
    assert first_epoch != [row["i"] for step in range(5) for row in batch_rows(rows, step, 2, seed=1)]


def test_learning_rate_warmup_then_schedule(tiny_model_dir):
    config = load_config(
        tiny_config(tiny_model_dir, "unused"), ["train.warmup_steps=3", "train.lr_schedule=linear", "train.steps=10"]
    )
    assert optimizer_steps(config) == 10
    schedule = build_schedule(build_optimizer([torch.nn.Parameter(torch.zeros(1))], config.train), config.train, 10)
    multiplier = schedule.lr_lambdas[0]
    assert [multiplier(step) for step in range(3)] == pytest.approx([0.25, 0.5, 0.75])
    assert multiplier(3) == pytest.approx(1.0) and multiplier(10) == pytest.approx(0.0)
    assert multiplier(6) == pytest.approx(4 / 7)


def test_reward_set_used_by_trainer_scores_groups(tiny_model_dir):
    config = load_config(tiny_config(tiny_model_dir, "unused"))
    task = make_task(config)
    rewards = RewardSet(config.rewards, task)
    row = task.train_rows[0]
    total, columns = rewards.score([f"<think>x</think><answer>{row['answer']}</answer>", "no"], [row, row])
    assert total.tolist() == pytest.approx([1.0 + 0.5 * 1.0, 0.0])
    assert set(columns) == {"correct", "tag_count"}


def test_metrics_file_is_json_lines(tiny_model_dir, tmp_path):
    result = train(
        tiny_config(tiny_model_dir, tmp_path / "run", train={"steps": 1}, eval={"before": False, "after": False})
    )
    lines = (result.output_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 1


def test_kl_is_zero_while_the_policy_equals_the_reference(tiny_model_dir, tmp_path):
    """With one pass per batch, step 1 is scored before any update: the k3 KL is exactly 0."""
    result = train(
        tiny_config(tiny_model_dir, tmp_path / "run", train={"steps": 1}, eval={"before": False, "after": False}),
        ["algorithm.beta=0.1"],
    )
    assert result.metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6)


def test_the_floor_counts_a_shared_prefix_once():
    from polo.rl.step import least_tokens

    # two groups of 3 rows: prompts of 5 and 4 real tokens (left-padded), the first 3 alike; completions 2 + 3 + 1 each
    prompt_ids = torch.tensor([[7, 8, 9, 4, 5]] * 3 + [[0, 7, 8, 9, 6]] * 3)
    prompt_mask = (prompt_ids != 0).long()
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]] * 2)
    assert least_tokens(prompt_ids, prompt_mask, completion_mask, 3) == 12 + (5 + 4) - 3
    different = prompt_ids.clone()
    different[3:, 1] = 3  # the second group's prompt opens otherwise: nothing shared across the groups
    assert least_tokens(different, prompt_mask, completion_mask, 3) == 12 + 9
    assert least_tokens(prompt_ids[:3], prompt_mask[:3], completion_mask[:3], 3) == 6 + 5  # one group
