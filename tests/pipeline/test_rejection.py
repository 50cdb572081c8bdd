"""Rejection sampling keeps only correct, well-formed, distinct completions, at most M per prompt; cold-start demos
pass both checks."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from polo.data import arithmetic_task
from polo.data.gsm8k import gsm8k_row
from polo.pipeline import select
from polo.pipeline.demos import cold_start_rows, column_addition, gsm8k_working, r1_completion
from polo.pipeline.rejection import training_prompts
from polo.rewards.answers import exact_number, math_verify_answer
from polo.rewards.format import r1_format

ROW = {"question": "What is 37 + 45?", "answer": "82"}
CHECK = functools.partial(exact_number, answer_in_tags=True)
GOOD = "<think>\n7+5=12, write 2 carry 1. 3+4+1=8. So 82.\n</think>\n<answer>82</answer>"
GOOD_SHORT = "<think>37+45=82</think> <answer>82</answer>"


def test_select_keeps_only_correct_and_well_formed_completions():
    completions = [
        GOOD,
        "<think>\n7+5=12. So 72.\n</think>\n<answer>72</answer>",  # well formed, wrong
        "The answer is 82. <answer>82</answer>",  # right answer, no think block
        "<think>82</think><answer>82</answer> and more text",  # right answer, text after the answer
        "<answer>82</answer>",  # right answer, no think block at all
        "<think>a</think><think>b</think><answer>82</answer>",  # two think blocks
        "<think>\n37+45\n</think>\n<answer>82",  # cut off: no </answer> (the checker still reads 82)
        GOOD_SHORT,
    ]
    selection = select(completions, ROW, CHECK, max_per_prompt=8)
    assert selection.kept == [GOOD, GOOD_SHORT]
    for text in selection.kept:
        assert CHECK(text, ROW) == 1.0 and r1_format(text, ROW) == 1.0
    assert selection.counts() == {
        "sampled": 8,
        "correct": 6,
        "well_formed": 3,
        "accepted": 2,
        "duplicates": 0,
        "over_cap": 0,
        "kept": 2,
    }


def test_select_drops_duplicates_and_caps_at_m_per_prompt():
    variants = [f"<think>\nstep {index}\n</think>\n<answer>82</answer>" for index in range(4)]
    completions = [GOOD, "  " + GOOD + "\n", variants[0], GOOD, variants[1], variants[2], variants[0], variants[3]]
    selection = select(completions, ROW, CHECK, max_per_prompt=3)
    assert selection.kept == [GOOD, variants[0], variants[1]]  # first occurrences, in sample order
    assert selection.accepted == 8
    assert selection.duplicates == 3  # GOOD twice more (one with spaces around it), variants[0] once more
    assert selection.over_cap == 2  # variants[2] and variants[3]: distinct, but over M
    assert len(set(text.strip() for text in selection.kept)) == len(selection.kept)
    assert select(completions, ROW, CHECK, max_per_prompt=1).kept == [GOOD]


def test_select_with_nothing_acceptable_keeps_nothing():
    selection = select(["82", "<answer>81</answer>", ""], ROW, CHECK, max_per_prompt=2)
    assert selection.kept == [] and selection.accepted == 0 and selection.sampled == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_select_refuses_a_cap_below_one(bad):
    with pytest.raises(ValueError, match="max_per_prompt"):
        select([GOOD], ROW, CHECK, max_per_prompt=bad)


@pytest.mark.parametrize(
    ("a", "b", "working"),
    [
        (37, 45, "7+5=12, write 2 carry 1. 3+4+1=8. So 82."),
        (21, 53, "1+3=4, write 4. 2+5=7. So 74."),
        (99, 98, "9+8=17, write 7 carry 1. 9+9+1=19. So 197."),
        (3, 4, "3+4=7. So 7."),
        (12, 5, "2+5=7, write 7. 1+0=1. So 17."),
    ],
)
def test_column_addition_shows_the_carries(a, b, working):
    assert column_addition(a, b) == working


def test_arithmetic_cold_start_demonstrations_are_correct_and_well_formed():
    task = arithmetic_task(num_train=200, num_eval=20, answer_in_tags=True)
    rows = training_prompts(task, 100, seed=0)
    demos = cold_start_rows(task, rows, task.instruction, "You are careful.")
    assert len(demos) == 100
    for demo, row in zip(demos, rows):
        assert task.correctness(demo["response"], row) == 1.0
        assert r1_format(demo["response"], row) == 1.0
        assert demo["prompt"][0] == {"role": "system", "content": "You are careful."}
        assert demo["prompt"][1]["content"].startswith(row["question"])
    held_out = {row["question"] for row in task.eval_rows}
    assert not held_out & {row["question"] for row in rows}


def test_cold_start_prompts_carry_the_few_shot_example_turns():
    task = arithmetic_task(num_train=20, num_eval=5, answer_in_tags=True)
    task.few_shot = (("What is 1 + 1?", "<think>1+1=2</think> <answer>2</answer>"),)
    (demo,) = cold_start_rows(task, task.train_rows[:1], "{question}", None)
    assert [message["role"] for message in demo["prompt"]] == ["user", "assistant", "user"]
    assert demo["prompt"][1]["content"] == task.few_shot[0][1]
    assert demo["prompt"][2]["content"] == task.train_rows[0]["question"]


def test_gsm8k_cold_start_uses_the_worked_solution_without_annotations():
    row = gsm8k_row(
        {
            "question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
            "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
            "Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72",
        },
        "train.jsonl",
        1,
    )
    think = gsm8k_working(row)
    assert think == "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips."
    completion = r1_completion(think, row["answer"])
    assert r1_format(completion, row) == 1.0
    assert math_verify_answer(completion, row, answer_in_tags=True) == 1.0


def test_stage_sampling_goes_through_the_one_grouped_sampler(tiny_model_dir):
    """Greedy answers sampled in groups are each prompt's alone; K samples per problem score as `polo eval` scores
    them."""
    from polo.evaluation.evaluate import evaluate_policy
    from polo.generation.grouped import GroupSampling, load_for_sampling, sample_groups
    from polo.runtime.device import Compute

    task = arithmetic_task(min_digits=1, max_digits=2, num_train=10, num_eval=5, answer_in_tags=True)
    model, tokenizer = load_for_sampling(str(tiny_model_dir), Compute.named("fp32"))
    prompts = task.prompts(tokenizer, task.eval_rows)
    greedy = GroupSampling(max_new_tokens=6, temperature=0.0)
    grouped = sample_groups(model, tokenizer, prompts, dataclasses.replace(greedy, batch_size=2))
    single = [sample_groups(model, tokenizer, [prompt], greedy)[0] for prompt in prompts]
    assert grouped == single
    sampling = GroupSampling(samples=3, max_new_tokens=6, temperature=1.0, batch_size=4)
    sampled = sample_groups(model, tokenizer, prompts, sampling)
    assert [len(done) for done in sampled] == [3] * 5
    assert all(0 < sample.length <= 6 for done in sampled for sample in done)
    result = evaluate_policy(
        model,
        tokenizer,
        prompts,
        task.eval_rows,
        task.correctness,
        GroupSampling(samples=4, max_new_tokens=6, temperature=1.0),
    )
    assert result["summary"]["samples_per_problem"] == 4 and set(result["summary"]["cons@k"]) == {"1", "2", "4"}
    assert [problem["question"] for problem in result["problems"]] == [row["question"] for row in task.eval_rows]
