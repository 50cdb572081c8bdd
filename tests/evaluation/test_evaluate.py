"""Tests for polo.evaluation.evaluate (pass@k, cons@k, answer keys, sampling) and the `polo eval` command."""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import replace

import pytest
import torch

from polo.cli import main
from polo.config import ConfigError
from polo.evaluation.evaluate import (
    add_reward_scores,
    answer_key_for,
    cons_at_k,
    default_ks,
    evaluate_policy,
    greedy_accuracy,
    majority_vote,
    math_answer_key,
    number_answer_key,
    pass_at_k,
    score_problem,
    summarize,
    text_answer_key,
)
from polo.generation.grouped import Completion, GroupSampling, sample_groups
from polo.rewards.answers import exact_number, exact_string, math_verify_answer

# ---------------------------------------------------------------- pass@k


def brute_force_pass_at_k(correct: list[int], k: int) -> float:
    """Return the fraction of k-subsets of the samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 0, 1, 0.0),
        (5, 5, 1, 1.0),
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (16, 1, 16, 1.0),  # k = n: one correct sample is enough
        (16, 0, 16, 0.0),  # k = n: none correct
        (10, 8, 3, 1.0),  # n - c < k: every draw holds a correct sample
    ],
)
def test_pass_at_k_on_hand_made_counts(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_matches_enumerating_every_subset():
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(correct, k))


def test_pass_at_1_is_the_mean_correctness():
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="must be in"):
        pass_at_k(n, c, k)


def test_default_ks_are_powers_of_two_then_n():
    assert default_ks(1) == [1]
    assert default_ks(16) == [1, 2, 4, 8, 16]
    assert default_ks(10) == [1, 2, 4, 8, 10]
    assert default_ks(2) == [1, 2]


# ---------------------------------------------------------------- majority vote and cons@k


def test_majority_vote_picks_the_most_frequent_answer():
    assert majority_vote(["3", "5", "5", "7"]) == 1  # first occurrence of the winner "5"


def test_majority_vote_tie_goes_to_the_answer_seen_first():
    assert majority_vote(["3", "5", "5", "3"]) == 0
    assert majority_vote(["5", "3", "3", "5"]) == 0
    assert majority_vote(["9", "3", "5"]) == 0  # all tied at one vote


def test_majority_vote_ignores_samples_without_an_answer():
    assert majority_vote([None, None, "4", None]) == 2
    assert majority_vote([None, "2", None, "2", "7"]) == 1
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None


def test_cons_at_k_with_n_samples_scores_the_single_vote():
    answers = ["3", "5", "5", "3"]
    correct = [1.0, 0.0, 0.0, 1.0]
    assert cons_at_k(answers, correct, 4) == 1.0  # tie "3"/"5": "3" came first
    assert cons_at_k(["5", "3", "3", "5"], [0.0, 1.0, 1.0, 0.0], 4) == 0.0  # same tie, "5" first


def test_cons_at_k_averages_disjoint_blocks():
    answers = ["3", "5", "5", "3", "5", "5"]
    correct = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    # blocks of 2: ("3","5") -> "3" right; ("5","3") -> "5" wrong; ("5","5") -> wrong
    assert cons_at_k(answers, correct, 2) == pytest.approx(1 / 3)
    # blocks of 3: ("3","5","5") -> "5" wrong; ("3","5","5") -> "5" wrong
    assert cons_at_k(answers, correct, 3) == 0.0
    # k = 1 is the mean correctness
    assert cons_at_k(answers, correct, 1) == pytest.approx(2 / 6)
    # k = 4 does not divide 6: one block of the first four, a 2-2 tie that "3" wins
    assert cons_at_k(answers, correct, 4) == 1.0


def test_cons_at_k_majority_beats_a_lucky_minority():
    answers = ["12", "12", "12", "10"]
    correct = [0.0, 0.0, 0.0, 1.0]
    assert cons_at_k(answers, correct, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0


def test_cons_at_k_block_without_answers_scores_zero():
    assert cons_at_k([None, None, "1", "1"], [0.0, 0.0, 1.0, 1.0], 2) == 0.5


def test_cons_at_k_rejects_bad_k_and_length_mismatch():
    with pytest.raises(ValueError, match="k must be in"):
        cons_at_k(["1"], [1.0], 2)
    with pytest.raises(ValueError, match="answers"):
        cons_at_k(["1", "2"], [1.0], 1)


# ---------------------------------------------------------------- answer keys


def test_number_key_reads_the_last_number_canonically():
    assert number_answer_key("so 47 + 38 = 85.00") == "85"
    assert number_answer_key("total: 1,234 apples") == "1234"
    assert number_answer_key("0.50") == "1/2"
    assert number_answer_key("no digits") is None
    assert number_answer_key("<think>7</think> <answer>12</answer> then 99") == "12"
    assert number_answer_key("the answer is 12", answer_in_tags=True) is None


def test_math_key_treats_equal_numbers_alike():
    assert math_answer_key("The answer is 72.00") == math_answer_key("$72$") == "72"
    assert math_answer_key("$\\frac{1}{2}$") == math_answer_key("it is 0.5") == "1/2"
    assert math_answer_key("no answer here") is None


def test_text_key_folds_case_and_space():
    assert text_answer_key("  Paris \n") == "paris"


def test_answer_key_for_follows_the_checker_and_its_tags_setting():
    tagged_number = answer_key_for(functools.partial(exact_number, answer_in_tags=True))
    assert tagged_number("<answer>12</answer>") == "12"
    assert tagged_number("12") is None
    assert answer_key_for(functools.partial(exact_string))("A") == "a"
    assert answer_key_for(functools.partial(math_verify_answer, answer_in_tags=False))("$0.5$") == "1/2"
    assert answer_key_for(lambda completion, row: 1.0)("it is 0.5") == "1/2"  # unknown checker: math_verify reading


# The keys read the answer the checkers grade (issue 20): the last committed answer, a
# retraction's restatement, no answer for a hedge; `\$18`, `(18)`, U+2212 and `2 1/2` parse.
KEY_CASES = [
    ("The answer is \\$18.", "18"),
    ("<answer>\\$18</answer>", "18"),
    ("(18)", "18"),
    ("\u221210", "-10"),
    ("2 1/2", "5/2"),
    ("\\boxed{17}. Wait, actually \\boxed{18}", "18"),
    ("\\boxed{17} ... wait ... \\boxed{18}", "18"),
    ("The answer is 18. Wait, no, it is 17.", "17"),
    ("17 or 18", None),
    ("The answer is 17 or 18.", None),
]


@pytest.mark.parametrize("key", [number_answer_key, math_answer_key], ids=lambda key: key.__name__)
@pytest.mark.parametrize(("completion", "expected"), KEY_CASES)
def test_answer_keys_read_the_last_committed_answer(key, completion, expected):
    assert key(completion) == expected


@pytest.mark.parametrize(("checker", "key"), [(exact_number, number_answer_key), (math_verify_answer, math_answer_key)])
@pytest.mark.parametrize(("completion", "expected"), KEY_CASES)
def test_answer_keys_agree_with_their_checker(checker, key, completion, expected):
    """A sample's vote key is the reference's key exactly when its checker passes it."""
    for reference in ("18", "-10", "2.5", "17"):
        passes = checker(completion, {"answer": reference}) == 1.0
        assert passes == (key(completion) is not None and key(completion) == key(reference)), reference


def test_cons_at_k_votes_for_the_corrected_answer():
    row = {"answer": "18"}
    texts = [
        "\\boxed{17} ... wait ... \\boxed{18}",  # an "aha" self-correction: a vote for 18
        "The answer is \\$18.",
        "17 or 18",  # a hedge does not vote
        "The answer is 17.",
        "The answer is 18. Wait, no, it is 17.",  # a vote for 17
    ]
    for checker in (exact_number, math_verify_answer):
        correctness = functools.partial(checker, answer_in_tags=False)
        problem = score_problem(row, fake_completions(texts), correctness, answer_key_for(correctness), [5])
        assert [sample["correct"] for sample in problem["samples"]] == [1.0, 1.0, 0.0, 0.0, 0.0]
        assert [sample["answer"] for sample in problem["samples"]] == ["18", "18", None, "17", "17"]
        assert problem["cons@k"]["5"] == 1.0  # 18 and 17 tie at two votes; 18 came first


# ---------------------------------------------------------------- scoring hand-made samples


def fake_completions(texts: list[str]) -> list[dict]:
    return [Completion(text, len(text.split()), False) for text in texts]


def test_score_problem_on_hand_made_samples():
    row = {"question": "What is 2 + 3?", "answer": "5"}
    texts = ["<think>2+3</think> <answer>5</answer>", "it is 6", "it is 6", "5", "no idea"]
    correctness = functools.partial(exact_number, answer_in_tags=False)
    problem = score_problem(row, fake_completions(texts), correctness, answer_key_for(correctness), [1, 2, 5])
    assert [sample["correct"] for sample in problem["samples"]] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert [sample["answer"] for sample in problem["samples"]] == ["5", "6", "6", "5", None]
    assert [sample["format"] for sample in problem["samples"]] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert problem["num_correct"] == 2
    assert problem["pass@1"] == pytest.approx(0.4)
    assert problem["pass@k"]["1"] == pytest.approx(0.4)
    assert problem["pass@k"]["2"] == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))
    assert problem["pass@k"]["5"] == 1.0
    # all five: "5" and "6" tie at two votes each, "5" came first -> correct
    assert problem["cons@k"]["5"] == 1.0
    assert problem["majority_answer"] == "5"
    # blocks of two: ("5","6") -> "5" right, ("6","5") -> "6" wrong
    assert problem["cons@k"]["2"] == 0.5


def test_reward_scores_are_added_per_sample_problem_and_split_by_correctness():
    result = {
        "summary": {},
        "problems": [
            {
                "prompt": "P1",
                "question": "q1",
                "samples": [{"completion": "a", "correct": 1.0}, {"completion": "bb", "correct": 0.0}],
            },
            {"prompt": "P2", "question": "q2", "samples": [{"completion": "ccc", "correct": 1.0}]},
        ],
    }
    calls = []

    def reward(completions, rows):
        calls.append([row["prompt_text"] for row in rows])
        return [float(len(text)) for text in completions]

    add_reward_scores(result, reward)
    assert calls == [["P1", "P1"], ["P2"]]  # once per problem, with the exact prompt text
    assert [s["reward_model"] for p in result["problems"] for s in p["samples"]] == [1.0, 2.0, 3.0]
    assert [p["reward_model_mean"] for p in result["problems"]] == [1.5, 3.0]
    assert result["summary"]["reward_model_mean"] == 2.0
    assert result["summary"]["reward_model_mean_correct"] == 2.0 and result["summary"]["reward_model_mean_wrong"] == 2.0
    with pytest.raises(ValueError, match="got 1 scores for 2 samples"):
        add_reward_scores(result, lambda completions, rows: [0.0])


def test_summarize_averages_over_problems():
    correctness = functools.partial(exact_number, answer_in_tags=False)
    key = answer_key_for(correctness)
    problems = [
        score_problem({"answer": "1"}, fake_completions(["1", "1", "2", "2"]), correctness, key, [1, 4]),
        score_problem({"answer": "3"}, fake_completions(["4", "4", "4", "3"]), correctness, key, [1, 4]),
    ]
    summary = summarize(problems)
    assert summary["num_problems"] == 2
    assert summary["samples_per_problem"] == 4
    assert summary["pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert summary["pass@k"] == {"1": pytest.approx(0.375), "4": 1.0}
    assert summary["cons@k"] == {"1": pytest.approx(0.375), "4": 0.5}  # tie won by "1"; "4" outvotes "3"
    assert summary["format_compliance"] == 0.0
    assert summary["answered"] == 1.0
    assert summary["mean_response_length"] == 1.0


# ---------------------------------------------------------------- sampling with the tiny model


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    from polo.models.loading import load_policy

    return load_policy(str(tiny_model_dir))


PROMPTS = ["What is 1 + 1?", "Hi", "A much longer prompt than the others, to force padding."]


def test_sample_groups_returns_k_per_prompt_in_prompt_order(tiny_policy):
    model, tokenizer = tiny_policy
    greedy = GroupSampling(max_new_tokens=6, temperature=0.0)
    batched = sample_groups(model, tokenizer, PROMPTS, replace(greedy, samples=3, batch_size=4))
    assert [len(samples) for samples in batched] == [3, 3, 3]
    for prompt, samples in zip(PROMPTS, batched):
        alone = sample_groups(model, tokenizer, [prompt], greedy)[0][0]
        # greedy: every sample of a prompt equals that prompt decoded on its own
        assert all(sample == alone for sample in samples)
        assert all(1 <= sample.length <= 6 for sample in samples)


def test_evaluate_policy_samples_each_problem_as_one_group(tiny_policy):
    """A problem's K samples go to the sampler as one group (one prefill), whole groups per batch."""
    from polo.generation.cpu_sampler import rollout

    model, tokenizer = tiny_policy
    calls = []

    def recording(model, tokenizer, prompts, group_size, decoding, **settings):
        calls.append((len(prompts), group_size))
        return rollout(model, tokenizer, prompts, group_size, decoding, **settings)

    rows = [{"question": prompt, "answer": "2"} for prompt in PROMPTS]
    result = evaluate_policy(
        model,
        tokenizer,
        PROMPTS,
        rows,
        exact_number,
        GroupSampling(samples=4, max_new_tokens=3, temperature=1.0, batch_size=8, sampler=recording),
    )
    assert calls == [(2, 4), (1, 4)]
    assert [problem["prompt"] for problem in result["problems"]] == PROMPTS


def odd_first_character(completion: str, row: dict) -> float:
    """A checker that splits random completions about in half: 1.0 when the first character's code is odd."""
    return float(bool(completion) and ord(completion[0]) % 2 == 1)


def test_evaluate_policy_scores_every_sample(tiny_policy):
    model, tokenizer = tiny_policy
    rows = [{"question": prompt, "answer": "2"} for prompt in PROMPTS]
    torch.manual_seed(0)  # the samples, so that both scores occur (they do for this seed)
    result = evaluate_policy(
        model,
        tokenizer,
        PROMPTS,
        rows,
        odd_first_character,
        GroupSampling(samples=4, max_new_tokens=5, temperature=1.0, batch_size=5),
    )
    assert len(result["problems"]) == 3
    assert all(len(problem["samples"]) == 4 for problem in result["problems"])
    assert result["problems"][1]["prompt"] == PROMPTS[1]
    samples = [sample for problem in result["problems"] for sample in problem["samples"]]
    # Each sample carries its own completion's score; both scores occur, so a mix-up would show.
    assert [sample["correct"] for sample in samples] == [odd_first_character(s["completion"], {}) for s in samples]
    assert {sample["correct"] for sample in samples} == {0.0, 1.0}
    # pass@k averages each problem's unbiased estimate from its own count of correct samples.
    counts = [sum(sample["correct"] for sample in problem["samples"]) for problem in result["problems"]]
    assert [problem["num_correct"] for problem in result["problems"]] == counts
    assert result["summary"]["pass@k"] == {
        str(k): pytest.approx(sum(pass_at_k(4, int(c), k) for c in counts) / 3) for k in (1, 2, 4)
    }
    assert result["summary"]["pass@1"] == pytest.approx(sum(counts) / 12)


def test_evaluate_policy_rejects_k_above_samples(tiny_policy):
    model, tokenizer = tiny_policy
    with pytest.raises(ValueError, match="every k"):
        evaluate_policy(
            model,
            tokenizer,
            ["a"],
            [{"answer": "1"}],
            exact_number,
            GroupSampling(samples=2, max_new_tokens=2, temperature=1.0),
            ks=[4],
        )


def transformers_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Return the greedy completion of one prompt by transformers' own `generate`: an oracle outside polo."""
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    output = model.generate(
        **inputs, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
    )
    return tokenizer.decode(output[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)


def test_greedy_accuracy_scores_each_completion_against_its_own_row(tiny_policy):
    model, tokenizer = tiny_policy
    greedy = [transformers_greedy(model, tokenizer, prompt, 4) for prompt in PROMPTS]
    assert len(set(greedy)) == len(PROMPTS)  # distinct, so a completion scored against another row fails
    # The middle row's answer is its greedy completion changed: two rows right, one wrong.
    rows = [
        {"question": prompt, "answer": text + ("?" if index == 1 else "")}
        for index, (prompt, text) in enumerate(zip(PROMPTS, greedy))
    ]
    result = greedy_accuracy(
        model,
        tokenizer,
        PROMPTS,
        rows,
        lambda completion, row: float(completion == row["answer"]),
        GroupSampling(max_new_tokens=4, batch_size=2),  # the third prompt in a batch of its own
    )
    assert set(result) == {"accuracy", "completion_length", "truncated", "samples"}
    assert result["accuracy"] == pytest.approx(2 / 3)
    assert [sample["score"] for sample in result["samples"]] == [1.0, 0.0, 1.0]
    assert [sample["completion"] for sample in result["samples"]] == greedy
    assert [sample["question"] for sample in result["samples"]] == PROMPTS
    assert 1 <= result["completion_length"] <= 4


# ---------------------------------------------------------------- the command


def test_polo_eval_writes_per_problem_results(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(3))
    )
    output = tmp_path / "out" / "eval.json"
    args = ["eval", "--model", str(tiny_model_dir), "--task", f"jsonl:{data}", "--checker", "exact_number"]
    args += ["--samples", "4", "--limit", "2", "--max-new-tokens", "4", "--output", str(output), "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "pass@k" in printed and "cons@k" in printed
    assert "format compliance" not in printed  # the task does not ask for the R1 format
    result = json.loads(output.read_text())
    assert result["settings"]["samples"] == 4 and result["settings"]["num_problems"] == 2
    assert result["settings"]["task"] == f"jsonl ({data}, exact_number)"
    assert len(result["problems"]) == 2
    assert all(len(problem["samples"]) == 4 for problem in result["problems"])
    assert set(result["summary"]["pass@k"]) == {"1", "2", "4"}


def test_polo_eval_greedy_on_arithmetic(tiny_model_dir, tmp_path, capsys):
    output = tmp_path / "eval.json"
    args = ["eval", "--model", str(tiny_model_dir), "--task", "arith", "--greedy", "--limit", "3"]
    assert main([*args, "--max-new-tokens", "3", "--answer-in-tags", "--output", str(output), "--no-progress"]) == 0
    assert "format compliance (r1_format)" in capsys.readouterr().out  # asked for by task.answer_in_tags
    result = json.loads(output.read_text())
    assert result["settings"]["temperature"] == 0.0 and result["settings"]["max_new_tokens"] == 3
    assert result["summary"]["pass@k"].keys() == {"1"}
    assert result["problems"][0]["question"].startswith("What is ")


def test_polo_eval_runs_an_hf_task_of_a_recipe_with_the_recipes_budget(tiny_model_dir, tmp_path):
    """Any task a recipe builds evaluates: here the hf task over a data file, given as overrides of a recipe."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 2 =", "solution": str(i + 2)}) + "\n" for i in range(5)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: {{name: {tiny_model_dir}}}\nsampling: {{max_new_tokens: 5}}\neval: {{max_new_tokens: 2}}\n"
    )
    output = tmp_path / "eval.json"
    overrides = ["task.name=hf", f"task.path={data}", "task.prompt_field=prompt", "task.answer_field=solution"]
    args = ["eval", "--recipe", str(recipe), *overrides, "task.num_eval=3", "--samples", "2"]
    assert main([*args, "--output", str(output), "--no-progress"]) == 0
    result = json.loads(output.read_text())
    assert result["settings"]["task"] == f"hf ({data}, math_verify)"
    assert result["settings"]["max_new_tokens"] == 2  # eval.max_new_tokens wins over sampling.max_new_tokens
    assert [problem["reference"] for problem in result["problems"]] == ["4", "5", "6"]  # the last 3 rows held out
    assert all(sample["length"] <= 2 for problem in result["problems"] for sample in problem["samples"])


def test_polo_eval_runs_an_hf_task_on_a_local_dataset_directory(tiny_model_dir, tmp_path):
    """The hf task over a `save_to_disk` directory: its "test" split is the held-out rows."""
    import datasets

    rows = [{"question": f"{i} + 2 =", "answer": str(i + 2)} for i in range(6)]
    splits = {"train": datasets.Dataset.from_list(rows[:4]), "test": datasets.Dataset.from_list(rows[4:])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "data"))
    output = tmp_path / "eval.json"
    overrides = ["task.name=hf", f"task.path={tmp_path / 'data'}", "task.checker=exact_number", "task.num_eval=2"]
    args = ["eval", "--model", str(tiny_model_dir), *overrides, "--greedy", "--max-new-tokens", "2"]
    assert main([*args, "--output", str(output), "--no-progress"]) == 0
    result = json.loads(output.read_text())
    assert result["settings"]["task"] == f"hf ({tmp_path / 'data'}, exact_number)"
    assert [problem["reference"] for problem in result["problems"]] == ["6", "7"]


def test_polo_eval_judges_the_code_task_in_the_sandbox(tiny_model_dir, tmp_path, monkeypatch):
    """`polo eval` on the code task runs each completion against the problem's tests in the sandbox: the tiny
    model's own answers fail them, the reference solutions (in place of its samples) pass them."""
    from polo.evaluation import evaluate as evaluate_module

    output = tmp_path / "eval.json"
    args = ["eval", "--model", str(tiny_model_dir), "task.name=code", "task.num_eval=2", "--greedy"]
    args += ["--max-new-tokens", "4", "--output", str(output), "--no-progress"]
    assert main(args) == 0
    own = json.loads(output.read_text())
    assert own["settings"]["task"] == "code" and own["summary"]["pass@1"] == 0.0

    def reference_solutions(model, tokenizer, prompts, sampling, rows):
        text = "```python\n{}\n```"
        return [[Completion(text.format(row["answer"]), 10, False)] for row in rows]

    monkeypatch.setattr(evaluate_module, "sample_groups", reference_solutions)
    assert main(args) == 0
    solved = json.loads(output.read_text())
    assert solved["summary"]["pass@1"] == 1.0 and len(solved["problems"]) == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--greedy", "--samples", "4"], "greedy gives one answer per problem; samples is 4"),
        (["--task", "mnist"], "task.name: 'mnist' is not a registered task"),
        (["--samples", "0"], "samples must be at least 1, got 0"),
        (["--top-p", "0"], "top_p must be"),
        (["--limit", "500"], "limit 500 is more than the 200 held-out problems"),
        (["--task", "gsm8k", "--data-dir", "/nonexistent/gsm8k"], "/nonexistent/gsm8k/test.jsonl"),
    ],
)
def test_polo_eval_rejects_bad_arguments_in_one_line(tiny_model_dir, tmp_path, capsys, extra, message):
    assert main(["eval", "--model", str(tiny_model_dir), "--output", str(tmp_path / "e.json"), *extra]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "e.json").exists()


def test_gsm8k_folder_comes_from_the_argument_or_the_environment(tmp_path, monkeypatch):
    from polo.data.gsm8k import GSM8K_ENV, gsm8k_data_dir

    assert gsm8k_data_dir(tmp_path / "mine") == tmp_path / "mine"
    monkeypatch.setenv(GSM8K_ENV, str(tmp_path / "env"))
    assert gsm8k_data_dir() == tmp_path / "env"
    assert gsm8k_data_dir(tmp_path / "mine") == tmp_path / "mine"
    monkeypatch.delenv(GSM8K_ENV)
    with pytest.raises(ConfigError, match=f"task.train_path and task.eval_path, or {GSM8K_ENV}"):
        gsm8k_data_dir()
