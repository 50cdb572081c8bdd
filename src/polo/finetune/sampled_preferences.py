"""Preference data from a model's own samples (`polo make-preferences --from-model`).

The model answers each training problem several times; the task's checker ranks the answers,
and every (correct, wrong) pair becomes a comparison for `polo rm` or `polo dpo`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from polo.data.base import Task
from polo.data.preferences import comparisons_from_samples, user_prompt
from polo.generation.grouped import GroupSampling, sample_groups


@dataclass(frozen=True)
class PreferenceDraw:
    """Which training problems `sampled_preference_data` draws and how it phrases them, and how many pairs it keeps."""

    num_prompts: int = 1500  # problems for the training comparisons
    num_prompts_eval: int = 200  # the next problems, for the held-out comparisons
    max_pairs: int = 4  # at most this many (correct, wrong) pairs per problem
    seed: int = 0  # the shuffle that picks the problems and the pairs
    instruction: str | None = None  # None: the task's own instruction
    system_prompt: str | None = None


def check_sampling_request(task: Task, draw: PreferenceDraw, samples: int) -> list[dict]:
    """Raise ValueError for counts `sampled_preference_data` cannot honour; return the task's usable training rows."""
    num_prompts, num_prompts_eval = draw.num_prompts, draw.num_prompts_eval
    for name, value in {
        "num_prompts": num_prompts,
        "num_prompts_eval": num_prompts_eval,
        "samples": samples,
        "max_pairs": draw.max_pairs,
    }.items():
        minimum = 2 if name == "samples" else 0  # a comparison needs two answers to one prompt
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    rows = task.unseen_train_rows()
    if num_prompts + num_prompts_eval > len(rows):
        raise ValueError(
            f"asked for {num_prompts} + {num_prompts_eval} prompts but the task's training split holds {len(rows)}"
        )
    return rows


def sampled_preference_data(
    model: Any, tokenizer: Any, task: Task, draw: PreferenceDraw, sampling: GroupSampling
) -> tuple[dict[str, list[dict]], dict]:
    """Sample a model on the task's training problems and rank its answers with the task's checker.

    Returns ({"preferences_train", "preferences_eval"}, stats). Problems come from the training
    split only (never the held-out problems `polo train` and `polo eval` use), shuffled with
    `draw.seed`; the first `num_prompts` make the training comparisons, the next `num_prompts_eval`
    the held-out ones. Each prompt gets `sampling.samples` completions (the RL run's sampling),
    phrased exactly as the policy sees them, and `comparisons_from_samples` pairs.
    This is InstructGPT's data collection with a program in the labeller's seat: comparisons of
    the model's own outputs, so the reward model learns to tell apart the mistakes the policy
    actually makes.
    """
    template = task.instruction if draw.instruction is None else draw.instruction
    system_prompt, num_prompts, samples = draw.system_prompt, draw.num_prompts, sampling.samples
    rows = check_sampling_request(task, draw, samples)
    rng = random.Random(draw.seed)
    rows = list(rows)
    rng.shuffle(rows)
    rows = rows[: num_prompts + draw.num_prompts_eval]
    completions = sample_groups(model, tokenizer, task.prompts(tokenizer, rows, template, system_prompt), sampling)
    splits: dict[str, list[dict]] = {"preferences_train": [], "preferences_eval": []}
    correct = mixed = 0
    for index, (row, done) in enumerate(zip(rows, completions)):
        scored = [(sample.text, float(task.correctness(sample.text, row))) for sample in done]
        correct += sum(score > 0.5 for _, score in scored)
        prompt = user_prompt(row["question"], template, system_prompt, task.few_shot)  # exactly what was sampled from
        pairs = comparisons_from_samples(prompt, scored, rng, draw.max_pairs)
        mixed += bool(pairs)
        splits["preferences_train" if index < num_prompts else "preferences_eval"].extend(pairs)
    stats = {
        "prompts": len(rows),
        "samples_per_prompt": samples,
        "sample_accuracy": correct / max(len(rows) * samples, 1),
        "prompts_with_a_comparison": mixed,
        **{name: len(split) for name, split in splits.items()},
    }
    return splits, stats
