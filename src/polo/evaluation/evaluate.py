"""Evaluation of a policy on a task: greedy accuracy, and pass@1 / pass@k / cons@k over K samples.

Sampling K completions per problem gives, for each problem, n = K samples of which c are
correct. The metrics, each averaged over problems:

- pass@1 = c / n, the mean correctness of the samples (DeepSeek-R1's "pass@1 over 16 samples").
- pass@k = 1 − C(n−c, k) / C(n, k): the chance that at least one of k samples drawn without
  replacement from the n is correct. Unbiased for the pass@k of a fresh draw of k samples
  (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"); equals c / n at k = 1.
- cons@k: the correctness of the majority-voted final answer among k samples (R1's cons@64).
  For k < n it is averaged over the ⌊n/k⌋ disjoint blocks of k consecutive samples.

Majority vote: every sample's final answer is reduced to a key (the same reading of the answer
that the task's checker makes: the last number for numeric checks, math_verify's parse for
maths, the folded text for exact strings); the most frequent key wins, a tie goes to the key
whose first sample came earliest, and samples with no answer do not vote. The vote is scored
by the checker's verdict on the first sample that gave the winning key; a block where no sample
has an answer scores 0.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from polo.config import Config, ConfigError, build_dataclass, check_settings, config_to_dict, load_config, setting
from polo.data import instruction_for, make_task
from polo.data.environments import sampler_for
from polo.generation.episodes import episode_metrics
from polo.generation.grouped import Completion, GroupSampling, load_for_sampling, sample_groups
from polo.rewards.answers import (
    _math_verify_timeout,
    answer_region,
    exact_number,
    exact_string,
    final_answer_span,
    final_number,
    is_hedged,
    math_verify_answer,
)
from polo.rewards.format import r1_format
from polo.rewards.reward_model import REWARD_PREFIX, reward_model_reward
from polo.runtime.device import inference_compute, torch_threads
from polo.runtime.run_lock import is_run_dir, owned_run_dir

AnswerKey = Callable[[str], "str | None"]


# ---------------------------------------------------------------- estimators


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Return the unbiased pass@k estimate 1 − C(n−c, k) / C(n, k) for one problem.

    n = `num_samples`, c = `num_correct`, 1 <= k <= n. Computed with exact integers, so it is
    exactly 1.0 whenever n − c < k (every k-subset holds a correct sample).
    """
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct must be in [0, num_samples={num_samples}], got {num_correct}")
    if not 1 <= k <= num_samples:
        raise ValueError(f"k must be in [1, num_samples={num_samples}], got {k}")
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """Return the index of the sample whose answer wins the vote, or None if no sample has one.

    The most frequent answer wins; among tied answers, the one that occurs first wins, and the
    returned index is that answer's first occurrence. `None` answers do not vote.
    """
    counts = Counter(answer for answer in answers if answer is not None)
    if not counts:
        return None
    first_index = {}
    for index, answer in enumerate(answers):
        if answer is not None:
            first_index.setdefault(answer, index)
    winner = max(counts, key=lambda answer: (counts[answer], -first_index[answer]))
    return first_index[winner]


def cons_at_k(answers: Sequence[str | None], correct: Sequence[float], k: int) -> float:
    """Return cons@k for one problem: the mean vote correctness over ⌊n/k⌋ disjoint blocks of k.

    Block b holds samples [b·k, (b+1)·k); its score is `correct` of the sample `majority_vote`
    picks in it, or 0.0 when no sample in it has an answer. With k = n this is the single vote
    over all samples.
    """
    if len(answers) != len(correct):
        raise ValueError(f"got {len(answers)} answers for {len(correct)} correctness values")
    if not 1 <= k <= len(answers):
        raise ValueError(f"k must be in [1, num_samples={len(answers)}], got {k}")
    scores = []
    for start in range(0, len(answers) - k + 1, k):
        winner = majority_vote(answers[start : start + k])
        scores.append(0.0 if winner is None else float(correct[start + winner]))
    return sum(scores) / len(scores)


def default_ks(num_samples: int) -> list[int]:
    """Return the k values to report for n samples: the powers of two below n, then n itself."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    ks = [1 << power for power in range(num_samples.bit_length()) if 1 << power < num_samples]
    return ks + [num_samples]


# ---------------------------------------------------------------- answer keys for the vote


# The keys read the same final answer as the checkers (`final_answer_span`: the last committed
# answer, retractions honoured, hedges void), so a sample votes for what it is graded on.


def number_answer_key(completion: str, answer_in_tags: bool = False) -> str | None:
    """Return the number `exact_number` grades, in canonical form ("72.00" -> "72"), or None."""
    span = final_answer_span(completion, answer_in_tags)
    number = None if span is None else final_number(span)
    return None if number is None else str(number)


def math_answer_key(completion: str, answer_in_tags: bool = False) -> str | None:
    """Return the answer `math_verify_answer` grades, in a canonical form, or None.

    Real numbers become exact rationals ("0.5" and "\\frac{1}{2}" both give "1/2"); other
    expressions keep sympy's printed form. A hedged answer ("17 or 18") does not vote.
    """
    from math_verify import parse

    span = final_answer_span(completion, answer_in_tags)
    if span is None or is_hedged(span):
        return None
    parsed = parse(span, parsing_timeout=_math_verify_timeout())
    if not parsed:
        return None
    expression = parsed[0]
    try:
        if getattr(expression, "is_number", False) and expression.is_real:
            import sympy

            return str(sympy.nsimplify(expression, rational=True))
        return str(expression)
    except Exception:
        return str(parsed[-1])


def text_answer_key(completion: str, answer_in_tags: bool = False) -> str | None:
    """Return the answer region stripped and case-folded (how `exact_string` compares), or None."""
    region = answer_region(completion, answer_in_tags)
    return None if region is None else region.strip().casefold()


# Which key matches which checker: the vote should group answers the way the checker reads them.
ANSWER_KEYS: dict[Callable, Callable[..., str | None]] = {
    exact_number: number_answer_key,
    math_verify_answer: math_answer_key,
    exact_string: text_answer_key,
}


def answer_key_for(correctness: Callable[[str, dict], float]) -> AnswerKey:
    """Return the answer-key function that matches a task's correctness checker.

    Checkers built by polo are partials of the functions in `ANSWER_KEYS` with
    `answer_in_tags` bound; any other callable gets math_verify's reading of the whole reply.
    """
    function = getattr(correctness, "func", correctness)
    keywords = getattr(correctness, "keywords", None) or {}
    key = ANSWER_KEYS.get(function, math_answer_key)
    return functools.partial(key, answer_in_tags=bool(keywords.get("answer_in_tags", False)))


# ---------------------------------------------------------------- scoring


def score_problem(
    row: dict,
    completions: Sequence[Completion],
    correctness: Callable[[str, dict], float],
    answer_key: AnswerKey,
    ks: Sequence[int],
) -> dict:
    """Return one problem's per-sample results and its pass@k / cons@k for every k in `ks`.

    `completions` are one prompt's `polo.generation.grouped.sample_groups` results. Each sample
    gets "correct" (the checker), "format" (`r1_format`) and "answer" (its vote key).
    """
    samples = []
    for completion in completions:
        text = completion.text
        samples.append(
            {
                "completion": text,
                "correct": float(correctness(text, row)),
                "format": r1_format(text, row),
                "answer": answer_key(text),
                "length": completion.length,
                "truncated": completion.truncated,
                **({} if completion.episode is None else episode_fields(completion.episode)),
            }
        )
    correct = [sample["correct"] for sample in samples]
    answers = [sample["answer"] for sample in samples]
    num_correct = sum(1 for value in correct if value > 0.5)
    winner = majority_vote(answers)
    return {
        "question": row.get("question"),
        "reference": row.get("answer"),
        "num_samples": len(samples),
        "num_correct": num_correct,
        "pass@1": sum(correct) / len(correct),
        "pass@k": {str(k): pass_at_k(len(samples), num_correct, k) for k in ks},
        "cons@k": {str(k): cons_at_k(answers, correct, k) for k in ks},
        "majority_answer": None if winner is None else answers[winner],
        "samples": samples,
    }


def episode_fields(episode) -> dict:
    """Return what a sample of a multi-turn episode adds to its result: its transcript and its tool use."""
    return {
        "episode": episode.transcript,
        "turns": len(episode.turns),
        "tool_calls": episode.tool_calls,
        "tool_failures": episode.tool_failures,
    }


def summarize(problems: Sequence[dict]) -> dict:
    """Return the means over problems of every per-problem metric, plus sample-level rates."""
    if not problems:
        raise ValueError("no problems to summarize")
    samples = [sample for problem in problems for sample in problem["samples"]]
    ks = list(problems[0]["pass@k"])

    def mean(values) -> float:
        values = list(values)
        return sum(values) / len(values)

    return {
        "num_problems": len(problems),
        "samples_per_problem": problems[0]["num_samples"],
        "pass@1": mean(problem["pass@1"] for problem in problems),
        "pass@k": {k: mean(problem["pass@k"][k] for problem in problems) for k in ks},
        "cons@k": {k: mean(problem["cons@k"][k] for problem in problems) for k in ks},
        "format_compliance": mean(sample["format"] for sample in samples),
        "answered": mean(sample["answer"] is not None for sample in samples),
        "mean_response_length": mean(sample["length"] for sample in samples),
        "truncated": mean(sample["truncated"] for sample in samples),
        **(tool_summary(samples) if "tool_calls" in samples[0] else {}),
    }


def tool_summary(samples: Sequence[dict]) -> dict:
    """Return the tool use over episode samples: calls per episode, success rate, turns, use by the correct ones."""
    calls = sum(sample["tool_calls"] for sample in samples)
    failures = sum(sample["tool_failures"] for sample in samples)
    right = [sample for sample in samples if sample["correct"] > 0.5]
    return {
        "tool_calls_per_episode": calls / len(samples),
        "tool_call_success_rate": (calls - failures) / calls if calls else 0.0,
        "turns_per_episode": sum(sample["turns"] for sample in samples) / len(samples),
        "correct_that_used_the_tool": sum(sample["tool_calls"] > 0 for sample in right) / len(right) if right else 0.0,
    }


def evaluate_policy(
    model,
    tokenizer,
    prompts: list[str],
    rows: list[dict],
    correctness: Callable[[str, dict], float],
    sampling: GroupSampling,
    *,
    ks: Sequence[int] | None = None,
    answer_key: AnswerKey | None = None,
) -> dict:
    """Return `{"summary", "problems"}`: `sampling.samples` completions per prompt, scored (see module doc).

    A prompt's samples are one group of the sampler (`polo.generation.grouped.sample_groups`; one
    prefill shared by them), `sampling.batch_size` sequences a batch. `ks` defaults to
    `default_ks(samples)`; `answer_key` to the one matching `correctness`. Temperature 0 is greedy
    decoding (then ask for one sample: the others would be copies).
    """
    if len(prompts) != len(rows):
        raise ValueError(f"got {len(prompts)} prompts for {len(rows)} rows")
    samples = sampling.samples
    ks = default_ks(samples) if ks is None else list(ks)
    bad = [k for k in ks if not 1 <= k <= samples]
    if bad:
        raise ValueError(f"every k must be in [1, samples={samples}], got {bad}")
    answer_key = answer_key_for(correctness) if answer_key is None else answer_key
    completions = sample_groups(model, tokenizer, prompts, sampling, rows)
    problems = [score_problem(row, done, correctness, answer_key, ks) for row, done in zip(rows, completions)]
    for prompt, problem in zip(prompts, problems):
        problem["prompt"] = prompt
    return {"summary": summarize(problems), "problems": problems}


def add_reward_scores(
    result: dict, reward: Callable[[Sequence[str], Sequence[dict]], list[float]], name: str = "reward_model"
) -> dict:
    """Score every sample of an `evaluate_policy` result with a batched reward function; return `result`.

    Each sample gets `name` (its score), each problem `<name>_mean` and the summary `<name>_mean`
    (over all samples), `<name>_mean_correct` and `<name>_mean_wrong` (over the samples the checker
    passed and failed; NaN when there are none). `reward` is called once per problem as
    `reward(completions, rows)` with rows carrying the exact prompt text (`prompt_text`), as the
    RL trainer calls a `model:PATH` reward.
    """
    scored = {True: [], False: []}
    for problem in result["problems"]:
        texts = [sample["completion"] for sample in problem["samples"]]
        values = reward(texts, [{"prompt_text": problem["prompt"], "question": problem["question"]}] * len(texts))
        if len(values) != len(texts):
            raise ValueError(f"{name}: got {len(values)} scores for {len(texts)} samples")
        for sample, value in zip(problem["samples"], values):
            sample[name] = float(value)
            scored[sample["correct"] > 0.5].append(float(value))
        problem[f"{name}_mean"] = sum(values) / len(values)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    summary = result["summary"]
    summary[f"{name}_mean"] = mean(scored[True] + scored[False])
    summary[f"{name}_mean_correct"] = mean(scored[True])
    summary[f"{name}_mean_wrong"] = mean(scored[False])
    return result


@torch.no_grad()
def greedy_accuracy(
    model, tokenizer, prompts: list[str], rows: list[dict], correctness, sampling: GroupSampling
) -> dict:
    """Return `{"accuracy", "completion_length", "truncated", "samples"}` for greedy decoding.

    `correctness(completion, row) -> float` is the task's checker; accuracy is the mean of it
    over `rows`. "samples" keeps the first few (prompt, completion, score) triples for reports.
    `sampling` gives max_new_tokens, batch size, device and sampler; decoding is greedy, one sample
    per prompt, whatever its temperature and sample count.
    """
    if len(prompts) != len(rows):
        raise ValueError(f"got {len(prompts)} prompts for {len(rows)} rows")
    greedy = replace(sampling, samples=1, temperature=0.0, top_p=1.0)
    completions = sample_groups(model, tokenizer, prompts, greedy, rows)
    scores, samples = [], []
    for row, (completion,) in zip(rows, completions):
        score = float(correctness(completion.text, row))
        scores.append(score)
        if len(samples) < 8:
            samples.append(
                {
                    "question": row.get("question"),
                    "answer": row.get("answer"),
                    "completion": completion.text if completion.episode is None else completion.episode.transcript,
                    "score": score,
                }
            )
    count = max(len(scores), 1)
    episodes = [done[0].episode for done in completions if done[0].episode is not None]
    return {
        "accuracy": sum(scores) / count,
        "completion_length": sum(done[0].length for done in completions) / count,
        "truncated": sum(done[0].truncated for done in completions) / count,
        **(episode_metrics(episodes, scores, prefix="") if episodes else {}),
        "samples": samples,
    }


# ---------------------------------------------------------------- polo.evaluate: a model on a recipe's task


@dataclass
class EvalSettings:
    """How `polo.evaluate` samples and scores; the task, prompt, model and device come from the recipe."""

    samples: int | None = setting(None, help="K completions per problem; null: 16, or 1 with greedy", range=">= 1")
    greedy: bool = setting(False, help="one deterministic (greedy) answer per problem")
    temperature: float = setting(0.6, help="sampling temperature (DeepSeek-R1's evaluation setting)", range=">= 0")
    top_p: float = setting(0.95, help="nucleus sampling's top-p", range="(0, 1]")
    limit: int | None = setting(None, help="the first N held-out problems only (null: all)", range=">= 1")
    max_new_tokens: int | None = setting(
        None,
        help="the completion budget; null: the recipe's, eval.max_new_tokens else sampling.max_new_tokens",
        range=">= 1",
    )
    batch_size: int = setting(64, help="sequences sampled together", range=">= 1")
    seed: int = setting(0, help="seeds the sampling")
    reward_model: str | None = setting(
        None, help="PATH[?normalize]: also score every sample with this reward model (polo rm)"
    )
    progress: bool = setting(True, help="show a progress bar")

    @property
    def num_samples(self) -> int:
        """Return K: `samples`, else 16, or 1 when greedy."""
        return self.samples if self.samples is not None else 1 if self.greedy else 16


@dataclass
class EvalResult:
    """What `polo.evaluate` returns: what was evaluated and how, the summary, every problem's samples."""

    settings: dict  # model, task, counts, decoding, device: the "settings" of the written file
    summary: dict  # pass@1, pass@k, cons@k (k as strings), format, answered, length, truncated, wall_time_s, ...
    problems: list[dict]  # `score_problem`'s result per problem, with its prompt
    output: Path | None = None  # the JSON file written, if any


def evaluate(
    config: Config | str | Path | dict | None = None,
    overrides: list[str] | None = None,
    *,
    settings: EvalSettings | dict | None = None,
    eval_dataset: object = None,
    output: str | Path | None = None,
) -> EvalResult:
    """Return the pass@1, pass@k and cons@k of a recipe's model on its task's held-out problems (module doc).

    `config` is a `polo train` recipe: a `Config`, a YAML path, a run directory (its config.yaml) or
    a mapping, with `dotted.key=value` `overrides`. It names the model (`model.name`), the task
    and its prompt (every task kind, user tasks and environments included, built as training builds
    them), the device and precision (`train.device`, `train.precision`) and the default completion
    budget (`Config.eval_max_new_tokens`). `settings` (an `EvalSettings` or a mapping of its fields)
    says how to sample. `eval_dataset` (a `datasets.Dataset` or a list of dicts) is evaluated as the
    hf task's held-out rows. With `output`, the result is also written there as JSON, holding the
    lock of the run directory it lands in.
    """
    # Into a run directory, the run's lock comes first, before anything is read; a plain folder has no run to guard.
    guarded = output is not None and is_run_dir(Path(output).parent)
    with (
        owned_run_dir(Path(output).parent, "the run directory of the output", "write the output elsewhere")
        if guarded
        else contextlib.nullcontext()
    ):
        config = load_config(_recipe(config), overrides)
        settings = _eval_settings(settings)
        task = make_task(config, eval_dataset, eval_dataset) if eval_dataset is not None else make_task(config)
        rows = _held_out_rows(task.eval_rows, settings.limit, task.name)
        with torch_threads(config.train.threads):  # the caller's thread count comes back afterwards
            return _evaluate(config, settings, task, rows, output)


def _recipe(config: Config | str | Path | dict | None) -> str | Path | dict | None:
    """Return a recipe `load_config` reads: a Config as its mapping, a run directory as its config.yaml."""
    if isinstance(config, Config):
        return config_to_dict(config)
    if isinstance(config, (str, Path)) and Path(config).is_dir():
        return Path(config) / "config.yaml"
    return config


def _eval_settings(settings: EvalSettings | dict | None) -> EvalSettings:
    """Return `settings` as checked `EvalSettings` (`ConfigError` naming the first bad field)."""
    if settings is None:
        settings = EvalSettings()
    elif not isinstance(settings, EvalSettings):
        settings = build_dataclass(EvalSettings, dict(settings))
    check_settings(settings)
    if settings.greedy and settings.samples not in (None, 1):
        raise ConfigError(f"greedy gives one answer per problem; samples is {settings.samples}")
    return settings


def _held_out_rows(rows: list[dict], limit: int | None, task_name: str) -> list[dict]:
    """Return the first `limit` held-out rows (all of them when None), or raise when there are too few."""
    if limit is not None:
        if limit > len(rows):
            raise ConfigError(f"limit {limit} is more than the {len(rows)} held-out problems of task {task_name}")
        rows = rows[:limit]
    if not rows:
        raise ConfigError(f"task {task_name} has no held-out problems to evaluate")
    return rows


def _evaluate(config: Config, settings: EvalSettings, task, rows: list[dict], output: str | Path | None) -> EvalResult:
    """Sample and score `rows` of `task` as `settings` say with the recipe's model; write `output` when given."""
    compute = inference_compute(config.train.precision, config.train.device)
    torch.manual_seed(settings.seed)
    reward_model = None
    if settings.reward_model:  # loaded first: a wrong path fails before any sampling
        reward_model = reward_model_reward(REWARD_PREFIX + settings.reward_model, task)
    model, tokenizer = load_for_sampling(config.model.name, compute)
    prompts = task.prompts(tokenizer, rows, instruction_for(config, task), config.task.system_prompt)
    temperature, top_p = (0.0, 1.0) if settings.greedy else (settings.temperature, settings.top_p)
    sampling = GroupSampling(
        samples=settings.num_samples,
        max_new_tokens=settings.max_new_tokens or config.eval_max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        batch_size=settings.batch_size,
        compute=compute,
        progress=settings.progress,
        description="polo eval",
        sampler=sampler_for(config, task, compute),
    )
    described = _described(config, settings, task, rows, sampling)
    print(
        f"polo eval: {described['model']} on {described['task']}: {len(rows)} problems x {sampling.samples} "
        f"{'greedy answer' if settings.greedy else f'samples (T={temperature}, top_p={top_p})'}, "
        f"max {sampling.max_new_tokens} new tokens, {compute}",
        flush=True,
    )
    started = time.perf_counter()
    result = evaluate_policy(model, tokenizer, prompts, rows, task.correctness, sampling)
    if reward_model is not None:
        add_reward_scores(result, reward_model)
    summary = {**result["summary"], "wall_time_s": time.perf_counter() - started}
    written = None
    if output is not None:
        written = Path(output)
        written.parent.mkdir(parents=True, exist_ok=True)
        record = {"settings": described, "summary": summary, "problems": result["problems"]}
        written.write_text(json.dumps(record, indent=1))
    return EvalResult(described, summary, result["problems"], written)


def _described(config: Config, settings: EvalSettings, task, rows: list[dict], sampling: GroupSampling) -> dict:
    """Return the "settings" record of an evaluation: what was evaluated, and how."""
    return {
        "model": config.model.name,
        "task": _task_label(config, task),
        "answer_in_tags": config.task.answer_in_tags,
        "num_problems": len(rows),
        "samples": sampling.samples,
        "greedy": settings.greedy,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_new_tokens": sampling.max_new_tokens,
        "precision": sampling.compute.precision,
        "device": str(sampling.compute.device),
        "seed": settings.seed,
        "batch_size": settings.batch_size,
        "reward_model": settings.reward_model,
    }


def _task_label(config: Config, task) -> str:
    """Return the task's name with where its held-out rows come from (a file or dataset) and its checker."""
    source = config.task.eval_path or config.task.path
    checker = config.task.checker if task.name in ("jsonl", "hf") else None
    details = ", ".join(str(part) for part in (source, checker) if part)
    return f"{task.name} ({details})" if details else task.name
