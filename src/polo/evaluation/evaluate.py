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

import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from polo.generation.episodes import episode_metrics
from polo.generation.grouped import Completion, GroupSampling, sample_groups
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
