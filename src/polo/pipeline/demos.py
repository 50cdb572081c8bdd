"""Cold-start demonstrations (R1's stage 1): a few answers in exactly the layout the RL stage rewards.

`<think>` shows short working, `<answer>` the final answer alone, so SFT teaches the format and
RL only has to improve what goes inside it. Built in for two tasks:

- arithmetic: column addition with the carries written out,
  ``<think>\\n7+5=12, write 2 carry 1. 3+4+1=8. So 82.\\n</think>\\n<answer>82</answer>``
  (short on purpose: the default model is SmolLM2-135M and the CPU is slow); other operators
  get the one-line working ``47 - 38 = 9.``
- gsm8k: the dataset's own worked solution, calculator annotations (``<<48/2=24>>``) and the
  ``#### 72`` line removed, as the think block.

Prompts are the RL stage's own (`polo.data.preferences.user_prompt` with the same instruction
and system prompt), so the demonstrations are the completions the policy would be rewarded for.

With a task environment (docs/tools.md) the demonstrations are episodes instead, one SFT row per
model turn so the loss falls on the model's turns only: arithmetic with `python_tool` gives the
call (``<python>print(47 * 38)</python>``) after the environment's opening messages, then the
answer (``The answer is 1786.``) after the call and the tool's output.
"""

from __future__ import annotations

import re

from polo.data.base import Task
from polo.data.gsm8k import FINAL_ANSWER_MARK
from polo.data.preferences import user_prompt

CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")


def r1_completion(think: str, answer: str) -> str:
    """Return a completion in the R1 layout: the think block, then the answer block."""
    return f"<think>\n{think.strip()}\n</think>\n<answer>{answer.strip()}</answer>"


def column_addition(a: int, b: int) -> str:
    """Return the column-by-column working of a + b (a, b >= 0): "7+5=12, write 2 carry 1. 3+4+1=8. So 82."."""
    if a < 0 or b < 0:
        raise ValueError(f"column addition needs non-negative operands, got {a} and {b}")
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    columns = max(len(digits_a), len(digits_b))
    steps, carry = [], 0
    for column in range(columns):
        terms = [int(digits[column]) if column < len(digits) else 0 for digits in (digits_a, digits_b)]
        total = sum(terms) + carry
        written = "+".join(str(term) for term in terms) + (f"+{carry}" if carry else "")
        if column == columns - 1:
            steps.append(f"{written}={total}.")
        else:
            carry = total // 10
            steps.append(f"{written}={total}, write {total % 10}" + (f" carry {carry}." if carry else "."))
    return " ".join(steps) + f" So {a + b}."


def arithmetic_working(row: dict) -> str:
    """Return the think text for an arithmetic task row: column addition for sums, one line otherwise."""
    a, b = row["operands"]
    if row["operator"] == "+" and a >= 0 and b >= 0:
        return column_addition(a, b)
    return f"{a} {row['operator']} {b} = {row['answer']}."


def gsm8k_working(row: dict) -> str:
    """Return the think text for a GSM8K row: its worked solution without annotations or the final-answer line."""
    solution = (
        row["solution"].rpartition(FINAL_ANSWER_MARK)[0] if FINAL_ANSWER_MARK in row["solution"] else row["solution"]
    )
    return CALCULATOR_ANNOTATION.sub("", solution).strip()


WORKINGS = {"arithmetic": arithmetic_working, "gsm8k": gsm8k_working}


def has_builtin_demonstrations(task: Task) -> bool:
    """Return whether cold-start demonstrations can be built from this task's rows."""
    return task.name in WORKINGS


def cold_start_rows(task: Task, rows: list[dict], instruction: str, system_prompt: str | None) -> list[dict]:
    """Return one SFT demonstration `{"prompt", "response", "question", "answer"}` per task row, in the R1 layout."""
    if not has_builtin_demonstrations(task):
        raise ValueError(
            f"no built-in cold-start demonstrations for task {task.name!r} (built in: {', '.join(WORKINGS)})"
        )
    if task.environment is not None:
        return tool_rows(task, rows)
    working = WORKINGS[task.name]
    return [
        {
            "prompt": user_prompt(row["question"], instruction, system_prompt, task.few_shot),
            "response": r1_completion(working(row), str(row["answer"])),
            "question": row["question"],
            "answer": row["answer"],
        }
        for row in rows
    ]


def tool_rows(task: Task, rows: list[dict]) -> list[dict]:
    """Return two SFT rows per arithmetic row for the `python_tool` environment: the call, then the answer after it.

    The opening messages are the environment's own `reset(row)` (the RL stage's prompt); the tool's
    output is what Python prints for the product, as the sandbox would.
    """
    from polo.data.environments import PythonToolEnvironment

    demos = []
    for row in rows:
        environment = task.environment()
        if task.name != "arithmetic" or not isinstance(environment, PythonToolEnvironment):
            raise ValueError(
                "built-in tool demonstrations are for the arithmetic task with the python_tool environment"
            )
        messages = environment.reset(row)
        a, b = row["operands"]
        call = f"<python>print({a} {row['operator']} {b})</python>"
        after_call = [
            *messages,
            {"role": "assistant", "content": call},
            {"role": "tool", "content": str(row["answer"])},
        ]
        for prompt, response in ((messages, call), (after_call, f"The answer is {row['answer']}.")):
            demos.append({"prompt": prompt, "response": response, "question": row["question"], "answer": row["answer"]})
    return demos
