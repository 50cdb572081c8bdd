"""`sampling.top_k`, `min_p` and `repetition_penalty` reach the RL step's sampler and change what it draws."""

from __future__ import annotations

import pytest

from conftest import tiny_rl_config
from polo.config import ConfigError, load_config
from polo.rl import step as step_module
from polo.rl.setup import set_up


def sampled_rollouts(tiny_model_dir, tmp_path, monkeypatch, **sampling):
    config = tiny_rl_config(
        tiny_model_dir,
        tmp_path / "run",
        sampling={"max_new_tokens": 12, **sampling},
        eval={"before": False, "after": False},
        train={"steps": 1},
    )
    run = set_up(config)
    seen = {}
    real_policy_update = step_module.policy_update

    def policy_update(learner, batch, config, **kwargs):
        seen["rollouts"] = batch.rollouts
        return real_policy_update(learner, batch, config, **kwargs)

    monkeypatch.setattr(step_module, "policy_update", policy_update)
    step_module.rl_step(run, 1)
    return seen["rollouts"]


def completions(rollouts) -> list[list[int]]:
    lengths = rollouts.completion_mask.sum(-1).tolist()
    return [row[:length] for row, length in zip(rollouts.completion_ids.tolist(), lengths)]


def test_top_k_one_samples_every_group_alike_and_a_repetition_penalty_stops_repeats(
    tiny_model_dir, tmp_path, monkeypatch
):
    plain = completions(sampled_rollouts(tiny_model_dir, tmp_path / "plain", monkeypatch))
    assert len({tuple(row) for row in plain[:4]}) > 1  # temperature 1: a group's completions differ

    greedy = completions(sampled_rollouts(tiny_model_dir, tmp_path / "top_k", monkeypatch, top_k=1))
    assert all(len({tuple(row) for row in greedy[first : first + 4]}) == 1 for first in (0, 4))
    assert any(len(set(row)) < len(row) for row in greedy)  # the tiny model repeats itself when nothing stops it

    rollouts = sampled_rollouts(tiny_model_dir, tmp_path / "penalty", monkeypatch, top_k=1, repetition_penalty=1e3)
    for row, prompt, mask in zip(completions(rollouts), rollouts.prompt_ids.tolist(), rollouts.prompt_mask.tolist()):
        seen = {token for token, real in zip(prompt, mask) if real}
        assert len(set(row)) == len(row) and not seen & set(row)


@pytest.mark.parametrize("override", ["sampling.top_k=-1", "sampling.min_p=1.5", "sampling.repetition_penalty=0"])
def test_a_bad_sampling_filter_is_one_line_naming_it(override, tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(tiny_rl_config(tiny_model_dir, tmp_path), [override])
    key, value = override.split("=")
    message = str(error.value)
    assert message.startswith(key) and value in message and "\n" not in message
