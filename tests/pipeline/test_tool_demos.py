"""Cold-start demonstrations for a task with the python_tool environment: episodes cut into one SFT row per turn."""

from __future__ import annotations

from polo.config import load_config
from polo.data import make_task
from polo.data.preferences import read_demonstrations, write_jsonl
from polo.generation.prompts import render_prompt
from polo.models.loading import load_policy
from polo.pipeline.demos import cold_start_rows


def test_tool_demonstrations_are_the_episode_turns_with_the_rl_prompt(tmp_path, tiny_model_dir):
    config = load_config(
        {
            "task": {
                "name": "arithmetic",
                "operators": ["*"],
                "num_train": 10,
                "num_eval": 2,
                "instruction": "{question}",
                "environment": {"name": "python_tool"},
            },
            "output": {"dir": str(tmp_path / "unused")},
        }
    )
    task = make_task(config)
    rows = task.train_rows[:3]
    demos = cold_start_rows(task, rows, "{question}", None)
    assert len(demos) == 6
    call, answer = demos[0], demos[1]
    a, b = rows[0]["operands"]
    assert call["response"] == f"<python>print({a} * {b})</python>"
    assert answer["response"] == f"The answer is {a * b}."
    assert answer["prompt"][-2:] == [
        {"role": "assistant", "content": call["response"]},
        {"role": "tool", "content": str(a * b)},
    ]
    # The SFT prompt of the first turn is the RL stage's prompt; the rows load as demonstrations.
    _, tokenizer = load_policy(str(tiny_model_dir))
    assert render_prompt(tokenizer, call["prompt"]) == task.prompts(tokenizer, rows[:1])[0]
    loaded = read_demonstrations(write_jsonl(tmp_path / "demos.jsonl", demos))
    assert [demo.messages[-1]["role"] for demo in loaded[:2]] == ["user", "tool"]
