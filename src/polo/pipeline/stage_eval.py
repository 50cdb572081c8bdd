"""The evaluation after each stage: `polo eval`'s numbers on the pipeline task's held-out problems.

Greedy tagged accuracy (one answer per problem, temperature 0), then K samples per problem at
the R1 evaluation setting (T 0.6, top-p 0.95) for pass@1 over K, cons@K, the r1_format rate and
the mean response length, scored by `polo.evaluation.evaluate` (a problem's samples are one group
of polo's one sampler, `polo.generation.grouped`). The whole result goes to `<stage dir>/stage_eval.json`;
a result whose settings and model match is reused instead of sampling again.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from polo.data.environments import sampler_for
from polo.evaluation.evaluate import evaluate_policy
from polo.generation.grouped import GroupSampling, load_for_sampling
from polo.pipeline.recipe import Plan

EVAL_FILE = "stage_eval.json"


def read_json(path: Path) -> dict | None:
    """Return a JSON file's object, or None when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, value: object) -> None:
    """Write `value` to `path` whole or not at all (a temporary file renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(value, indent=1, default=str) + "\n")
    temporary.replace(path)


def eval_settings(plan: Plan, model: str) -> dict:
    """Return what decides an evaluation's result: the model, the settings and the held-out problems."""
    settings = dataclasses.asdict(plan.eval)
    settings["max_new_tokens"] = plan.max_new_tokens
    settings.pop("enabled")
    settings.pop("base")
    return {
        "model": model,
        **settings,
        "task": plan.task.name,
        "num_problems": len(eval_rows(plan)),
        "instruction": plan.instruction,
        "system_prompt": plan.task_config.task.system_prompt,
        "few_shot": [list(example) for example in plan.task.few_shot],
    }


def eval_rows(plan: Plan) -> list[dict]:
    """Return the held-out rows every stage is evaluated on (the first eval.num_problems)."""
    return plan.task.eval_rows[: plan.eval.num_problems]


def evaluate_model(plan: Plan, model: str, directory: Path) -> dict | None:
    """Return the evaluation of `model` ({"settings", "greedy", "sampled", "seconds"}), `directory`'s when current.

    None when evaluation is off or the task has no held-out rows.
    """
    if not plan.eval.enabled or not eval_rows(plan):
        return None
    settings = eval_settings(plan, model)
    path = Path(directory) / EVAL_FILE
    earlier = read_json(path) or {}
    if earlier.get("settings") == json.loads(json.dumps(settings)):
        return {key: value for key, value in earlier.items() if key != "problems"}
    result = run_evaluation(plan, model, settings)
    write_json(path, result)
    return {key: value for key, value in result.items() if key != "problems"}


def run_evaluation(plan: Plan, model_name: str, settings: dict) -> dict:
    """Return greedy and sampled results of `model_name` on the held-out rows (per-problem results under "problems")."""
    from polo.runtime.device import inference_compute
    from polo.runtime.seeding import seed_everything

    evaluation = plan.eval
    started = time.perf_counter()
    seed_everything(evaluation.seed)
    compute = inference_compute(evaluation.precision, plan.settings.device)
    model, tokenizer = load_for_sampling(model_name, compute)
    rows = eval_rows(plan)
    prompts = plan.task.prompts(tokenizer, rows, plan.instruction, plan.task_config.task.system_prompt)
    common = GroupSampling(
        max_new_tokens=plan.max_new_tokens,
        batch_size=evaluation.batch_size,
        compute=compute,
        progress=plan.settings.progress,
        description="polo eval",
        sampler=sampler_for(plan.task_config, plan.task, compute),  # episodes when the task has an environment
    )
    print(f"polo pipeline: evaluating {model_name} on {len(rows)} held-out problems ({compute})", flush=True)
    greedy = (
        evaluate_policy(
            model,
            tokenizer,
            prompts,
            rows,
            plan.task.correctness,
            dataclasses.replace(common, samples=1, temperature=0.0),
        )
        if evaluation.greedy
        else None
    )
    sampled = evaluate_policy(
        model,
        tokenizer,
        prompts,
        rows,
        plan.task.correctness,
        dataclasses.replace(
            common, samples=evaluation.samples, temperature=evaluation.temperature, top_p=evaluation.top_p
        ),
    )
    return {
        "settings": settings,
        "greedy": None if greedy is None else greedy["summary"],
        "sampled": sampled["summary"],
        "seconds": time.perf_counter() - started,
        "problems": sampled["problems"],
    }


def headline(evaluation: dict | None) -> dict:
    """Return the numbers the pipeline table shows for one evaluation (NaN where absent)."""
    nan = float("nan")
    if not evaluation:
        return {
            "greedy_accuracy": nan,
            "greedy_format": nan,
            "format": nan,
            "pass@1": nan,
            "cons@k": nan,
            "length": nan,
            "samples": None,
        }
    greedy, sampled = evaluation.get("greedy") or {}, evaluation["sampled"]
    k = str(sampled["samples_per_problem"])
    return {
        "greedy_accuracy": greedy.get("pass@1", nan),
        "greedy_format": greedy.get("format_compliance", nan),
        "format": sampled["format_compliance"],
        "pass@1": sampled["pass@1"],
        "cons@k": sampled["cons@k"].get(k, nan),
        "length": sampled["mean_response_length"],
        "samples": sampled["samples_per_problem"],
    }
