"""Reward functions in polo's form and in TRL's, told apart by their signature; reward values checked in float32;
a reward that exits is a reward error."""

from __future__ import annotations

import functools
import math
import sys

import pytest
import torch

from polo.config import ConfigError
from polo.data import Task
from polo.generation.prompts import PROMPT_MESSAGES, TRL_PROMPT
from polo.rewards import RewardFunctionError, RewardSet, exact_number
from polo.rewards.forms import RewardProgress, TrlReward, is_trl_form

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
# Two rows as the hf task makes them from TRL's formats: a text prompt, and a conversational one.
TEXT_ROW = {"question": "What is 47 + 38?", TRL_PROMPT: "What is 47 + 38?", "answer": "85", "solution": "85"}
CHAT_ROW = {"question": MESSAGES[-1]["content"], PROMPT_MESSAGES: MESSAGES, TRL_PROMPT: MESSAGES, "answer": "4"}
CHAT_ROW["solution"] = "4"


def make_task(rows=(TEXT_ROW,)) -> Task:
    return Task("toy", list(rows), list(rows), functools.partial(exact_number, answer_in_tags=False))


def polo_reward(completion, row):
    return float(len(completion))


def trl_length(completions, **kwargs):
    return [-abs(5 - len(completion)) for completion in completions]


def trl_all_arguments(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def trl_named_column(completions, solution, **kwargs):
    return [1.0 if answer in text else 0.0 for text, answer in zip(completions, solution)]


def trl_only_keywords(**kwargs):
    return [0.5] * len(kwargs["completions"])


def trl_without_kwargs(completions, solution):
    return [float(answer in text) for text, answer in zip(completions, solution)]


def two_positionals_and_kwargs(completion, row, **kwargs):
    return 1.0


class CallableReward:
    def __call__(self, completion, row):
        return 1.0


@pytest.mark.parametrize(
    ("function", "trl"),
    [
        (polo_reward, False),
        (lambda completion, row: 1.0, False),
        (two_positionals_and_kwargs, False),
        (CallableReward(), False),
        (functools.partial(lambda scale, completion, row: scale, 2.0), False),
        (trl_length, True),
        (trl_all_arguments, True),
        (trl_named_column, True),
        (trl_only_keywords, True),
        (trl_without_kwargs, True),
    ],
)
def test_the_form_is_read_from_the_signature(function, trl):
    assert is_trl_form(function, "f") is trl


@pytest.mark.parametrize(
    ("function", "shown"),
    [(lambda completion: 1.0, "(completion)"), (lambda a, b, c: 1.0, "(a, b, c)"), (lambda *, row: 1.0, "(*, row)")],
)
def test_a_function_of_neither_form_is_refused_in_one_line_that_shows_both(function, shown):
    with pytest.raises(ConfigError) as error:
        RewardSet({function: 1.0}, make_task())
    message = str(error.value)
    assert "\n" not in message and f"takes {shown}" in message
    assert "(completion: str, row: dict) -> float" in message
    assert "(prompts, completions, completion_ids, **columns) -> list[float | None]" in message


def test_a_trl_reward_is_called_once_per_batch_with_the_columns_as_keywords():
    calls = []

    def spy(prompts, completions, completion_ids, trainer_state, solution, **kwargs):
        calls.append((prompts, completions, completion_ids, trainer_state, solution, kwargs))
        return [1.0, 2.0]

    rewards = RewardSet({spy: 1.0}, make_task())
    rows = [{**TEXT_ROW, "prompt_text": "<rendered>"}, {**TEXT_ROW, "prompt_text": "<rendered>"}]
    progress = RewardProgress(global_step=3, max_steps=10)
    total, columns = rewards.score(["a", "bcd"], rows, completion_ids=[[7], [8, 9, 2]], progress=progress)
    assert total.tolist() == [1.0, 2.0] and columns["spy"].tolist() == [1.0, 2.0]
    assert len(calls) == 1
    prompts, completions, ids, state, solution, kwargs = calls[0]
    assert prompts == [TEXT_ROW[TRL_PROMPT]] * 2 and completions == ["a", "bcd"] and ids == [[7], [8, 9, 2]]
    assert (state.global_step, state.max_steps) == (3, 10) and solution == ["85", "85"]
    assert kwargs == {"answer": ["85", "85"]}  # polo's own keys (question, prompt_text, ...) are not columns


def test_a_conversational_prompt_gives_trl_rewards_messages():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [completion[0]["content"].count("4") for completion in completions]

    total, _ = RewardSet({spy: 1.0}, make_task([CHAT_ROW])).score(["4", "44"], [CHAT_ROW, CHAT_ROW])
    assert seen["prompts"] == [MESSAGES, MESSAGES]
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "44"}]]
    assert total.tolist() == [1.0, 2.0]


def test_a_trl_reward_without_kwargs_gets_only_what_it_names():
    total, _ = RewardSet({trl_without_kwargs: 1.0}, make_task()).score(["so 85", "no"], [TEXT_ROW, TEXT_ROW])
    assert total.tolist() == [1.0, 0.0]


def test_a_trl_reward_naming_a_column_the_rows_lack_is_refused_at_set_up():
    def needs_ground_truth(completions, ground_truth, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ConfigError, match=r"^reward 'needs_ground_truth' needs 'ground_truth', which is not a column"):
        RewardSet({needs_ground_truth: 1.0}, make_task())


def test_none_is_left_out_of_the_sum_as_trl_does():
    def only_long(completions, **kwargs):
        return [1.0 if len(text) > 2 else None for text in completions]

    def only_short(completions, **kwargs):
        return [None if len(text) > 1 else 2.0 for text in completions]

    rewards = RewardSet({only_long: 1.0, only_short: 0.5}, make_task())
    total, columns = rewards.score(["a", "ab", "abc"], [TEXT_ROW] * 3)
    assert total.tolist() == [1.0, 0.0, 1.0]  # sample 1: no reward applies
    assert math.isnan(columns["only_long"][0]) and math.isnan(columns["only_short"][2])
    assert rewards.last_unscorable == 1


def test_none_from_polo_form_is_still_an_error():
    with pytest.raises(RewardFunctionError, match=r"returned NoneType None, expected a float$"):
        RewardSet({lambda completion, row: None: 1.0}, make_task()).score(["a"], [TEXT_ROW])


def test_a_trl_reward_that_raises_names_the_sample():
    def breaks_on_b(completions, **kwargs):
        return [1 / (text != "b") for text in completions]

    with pytest.raises(RewardFunctionError, match=r"'breaks_on_b' failed on sample 1 \(completion 'b'\): ZeroDivision"):
        RewardSet({breaks_on_b: 1.0}, make_task()).score(["a", "b"], [TEXT_ROW, TEXT_ROW])


def test_a_trl_reward_returning_the_wrong_count_is_an_error():
    rewards = RewardSet({lambda **kwargs: [1.0]: 1.0}, make_task())
    assert rewards.score(["a"], [TEXT_ROW])[0].tolist() == [1.0]
    with pytest.raises(RewardFunctionError, match=r"returned 1 values for 2 completions"):
        rewards.score(["a", "b"], [TEXT_ROW, TEXT_ROW])


# ---------------------------------------------------------------- values checked in float32


@pytest.mark.parametrize("value", [1e39, -1e39, 3.5e38])
def test_a_reward_beyond_float32_is_named(value):
    def huge(completion, row):
        return value

    with pytest.raises(RewardFunctionError) as error:
        RewardSet({huge: 1.0}, make_task()).score(["a"], [TEXT_ROW])
    assert str(error.value).startswith("reward function 'huge' failed on sample 0")
    assert f"returned {value!r}, which is not finite in float32" in str(error.value)
    assert error.value.kind == "non_finite"


def test_the_largest_float32_passes_and_an_overflowing_weighted_total_is_named():
    largest = float(torch.finfo(torch.float32).max)

    def big(completion, row):
        return largest

    total, _ = RewardSet({big: 1.0}, make_task()).score(["a"], [TEXT_ROW])
    assert total.tolist() == [largest]
    with pytest.raises(
        RewardFunctionError, match=r"'big' failed on sample 0.*weighted total 2 \* 3.40282e\+38 \(big\)"
    ):
        RewardSet({big: 2.0}, make_task()).score(["a"], [TEXT_ROW])


def test_a_huge_trl_value_is_named_too():
    with pytest.raises(
        RewardFunctionError, match=r"'<lambda>' failed on sample 1 .*returned 1e\+39, which is not finite"
    ):
        RewardSet({lambda completions, **kwargs: [1.0, 1e39]: 1.0}, make_task()).score(["a", "b"], [TEXT_ROW] * 2)


# ---------------------------------------------------------------- a reward that exits


def exits(completion, row):
    sys.exit(0)


def exits_batched(completions, **kwargs):
    raise SystemExit(3)


@pytest.mark.parametrize("function", [exits, exits_batched])
def test_a_reward_that_exits_is_a_reward_error(function):
    with pytest.raises(RewardFunctionError, match=r"failed on sample 0 .*called sys\.exit\((0|3)\)") as error:
        RewardSet({function: 1.0}, make_task()).score(["a"], [TEXT_ROW])
    assert error.value.kind == "SystemExit"
    rewards = RewardSet({function: 1.0, polo_reward: 1.0}, make_task(), on_error="zero")
    total, _ = rewards.score(["ab"], [TEXT_ROW])
    assert total.tolist() == [2.0] and [error.kind for error in rewards.last_errors] == ["SystemExit"]


def test_a_stop_request_inside_a_reward_is_not_a_reward_error():
    def interrupted(completion, row):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        RewardSet({interrupted: 1.0}, make_task(), on_error="zero").score(["a"], [TEXT_ROW])


def test_trl_reward_wrapper_is_what_the_set_calls():
    rewards = RewardSet({trl_length: 1.0, polo_reward: 1.0}, make_task())
    assert isinstance(rewards._functions["trl_length"], TrlReward)
    assert rewards._functions["polo_reward"] is polo_reward
