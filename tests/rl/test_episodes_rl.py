"""RL over multi-turn episodes: only the model's tokens reach the loss, and a run with an environment trains,
logs tool use, evaluates episodes and plots them."""

from __future__ import annotations

import json
import textwrap

import torch
from test_trainer import tiny_config

from polo.config import load_config
from polo.data.environments import ChatEnvironment
from polo.generation import cpu_sampler
from polo.generation.episodes import EnvStep, EpisodeLimits, EpisodeSampler
from polo.generation.rollouts import Decoding
from polo.models.loading import load_policy
from polo.rl.batching import UpdateBatch
from polo.rl.train import train
from polo.rl.update import Learner, policy_update
from polo.runtime.device import CPU

ENVIRONMENT_MODULE = """
from polo.data.environments import ChatEnvironment, register_environment
from polo.generation.episodes import EnvStep


@register_environment("every_e")
class EveryE(ChatEnvironment):
    stop_strings = tuple("eaoitn 0123")  # common in a random model's text: calls come soon

    def step(self, assistant_text):
        self.calls = getattr(self, "calls", 0) + 1
        return EnvStep([{"role": "tool", "content": "ok"}], done=self.calls > 1, tool_calls=1)
"""


class EveryE(ChatEnvironment):
    """Answers every turn that ends in "e" (common in random text), for two turns."""

    stop_strings = ("e",)

    def step(self, assistant_text: str) -> EnvStep:
        self.calls = getattr(self, "calls", 0) + 1
        return EnvStep([{"role": "tool", "content": "ok"}], done=self.calls > 2, tool_calls=1)


def test_tool_output_and_template_tokens_never_reach_the_loss(tiny_model_dir):
    """Per-token advantages at the tokens the model did not write change neither the gradient nor the metrics."""
    config = load_config(tiny_config(tiny_model_dir, "unused"))
    model, tokenizer = load_policy(str(tiny_model_dir))
    torch.manual_seed(2)
    sampler = EpisodeSampler(EveryE, cpu_sampler.generate, EpisodeLimits(max_turns=3, max_episode_tokens=60))
    rows = [{"question": "1 + 1"}, {"question": "2 + 2"}]
    episodes = sampler(model, tokenizer, ["a", "b"], 4, Decoding(12, temperature=1.0), rows=rows)
    not_written = (episodes.completion_mask == 1) & (episodes.loss_mask == 0)
    assert not_written.any()
    advantages = torch.randn(episodes.completion_ids.shape)

    def gradients(rollouts, token_advantages):
        probe, _ = load_policy(str(tiny_model_dir))
        optimizer = torch.optim.SGD(probe.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        learner = Learner(probe, optimizer, scheduler, CPU)
        metrics = policy_update(learner, UpdateBatch(rollouts, token_advantages), config)
        return [p.grad.clone() for p in probe.parameters()], metrics

    clean_grads, clean_metrics = gradients(episodes, advantages)
    dirty_grads, dirty_metrics = gradients(episodes, advantages.masked_fill(not_written, 100.0))
    for clean, dirty in zip(clean_grads, dirty_grads):
        torch.testing.assert_close(clean, dirty, atol=1e-6, rtol=1e-5)
    assert dirty_metrics == clean_metrics
    # Without the loss mask the observations would be trained on: the gradient differs.
    episodes.loss_mask = None
    unmasked, _ = gradients(episodes, advantages.masked_fill(not_written, 100.0))
    assert any(not torch.allclose(a, b) for a, b in zip(unmasked, clean_grads))


def test_a_run_with_an_environment_logs_tool_use_and_plots_it(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "tiny_envs.py").write_text(textwrap.dedent(ENVIRONMENT_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tiny_config(
        tiny_model_dir,
        tmp_path / "run",
        task={"environment": {"name": "tiny_envs:every_e"}},
        sampling={"max_turns": 3, "max_episode_tokens": 40},
        train={"steps": 2},
        output={"save_every": 0},
    )
    train(config)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward/mean" in row]
    assert len(steps) == 2
    assert sum(row["tool/calls_per_episode"] for row in steps) > 0 and all(row["tool/turns"] >= 1 for row in steps)
    assert all(0.0 <= row["tool/call_success_rate"] <= 1.0 for row in steps)
    evaluations = [row for row in rows if "eval/accuracy" in row]
    assert evaluations and all("eval/tool/calls_per_episode" in row for row in evaluations)
    samples = (tmp_path / "run" / "samples.jsonl").read_text()
    assert "[observation]" in samples  # the whole transcript is logged
    assert (tmp_path / "run" / "tools.png").exists()
