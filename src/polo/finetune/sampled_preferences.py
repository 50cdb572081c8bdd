"""Preference data from a model's own samples (`polo make-preferences --from-model`).

The model answers each training problem several times; the task's checker ranks the answers,
and every (correct, wrong) pair becomes a comparison for `polo rm` or `polo dpo`.
"""

from __future__ import annotations

import random
from typing import Any

from polo.data.base import Task
from polo.data.preferences import comparisons_from_samples, user_prompt
from polo.generation.grouped import sample_groups
from polo.runtime.device import CPU, Compute


def check_sampling_request(
    task: Task, num_prompts: int, num_prompts_eval: int, samples: int, max_pairs: int
) -> list[dict]:
    """Raise ValueError for counts `sampled_preference_data` cannot honour; return the task's usable training rows."""
    for name, value in {
        "num_prompts": num_prompts,
        "num_prompts_eval": num_prompts_eval,
        "samples": samples,
        "max_pairs": max_pairs,
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
    model: Any,
    tokenizer: Any,
    task: Task,
    *,
    instruction: str | None = None,
    system_prompt: str | None = None,
    num_prompts: int = 1500,
    num_prompts_eval: int = 200,
    samples: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    max_pairs: int = 4,
    seed: int = 0,
    batch_size: int = 64,
    compute: Compute = CPU,
    progress: bool = False,
) -> tuple[dict[str, list[dict]], dict]:
    """Sample a model on the task's training problems and rank its answers with the task's checker.

    Returns ({"preferences_train", "preferences_eval"}, stats). Problems come from the training
    split only (never the held-out problems `polo train` and `polo eval` use), shuffled with
    `seed`; the first `num_prompts` make the training comparisons, the next `num_prompts_eval`
    the held-out ones. Each prompt gets `samples` completions at `temperature` (the RL run's
    sampling), phrased exactly as the policy sees them, and `comparisons_from_samples` pairs.
    This is InstructGPT's data collection with a program in the labeller's seat: comparisons of
    the model's own outputs, so the reward model learns to tell apart the mistakes the policy
    actually makes.
    """
    template = task.instruction if instruction is None else instruction
    rows = check_sampling_request(task, num_prompts, num_prompts_eval, samples, max_pairs)
    rng = random.Random(seed)
    rows = list(rows)
    rng.shuffle(rows)
    rows = rows[: num_prompts + num_prompts_eval]
    completions = sample_groups(
        model,
        tokenizer,
        task.prompts(tokenizer, rows, template, system_prompt),
        samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        batch_size=batch_size,
        compute=compute,
        progress=progress,
        description="polo make-preferences",
    )
    splits: dict[str, list[dict]] = {"preferences_train": [], "preferences_eval": []}
    correct = mixed = 0
    for index, (row, done) in enumerate(zip(rows, completions)):
        scored = [(sample.text, float(task.correctness(sample.text, row))) for sample in done]
        correct += sum(score > 0.5 for _, score in scored)
        prompt = user_prompt(row["question"], template, system_prompt, task.few_shot)  # exactly what was sampled from
        pairs = comparisons_from_samples(prompt, scored, rng, max_pairs)
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
