"""`run_pipeline`: the stages of a pipeline recipe, each a normal polo run, chained through their final models.

A stage is done once `<stage dir>/stage_done.json` exists (written last, with the stage's summary);
a later run skips it while its recipe is unchanged and no stage before it ran again. A grpo or sft
stage that stopped midway continues from its last checkpoint (`output.resume=true`); a reject_sft
stage, whose data is sampled anew, starts again.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from polo.models.hub import HeldOut, ModelCard, check_push, publish
from polo.models.lora import is_adapter_dir
from polo.pipeline.recipe import Plan, Stage, load_pipeline, same_record, stage_record
from polo.pipeline.stage_eval import EVAL_FILE, evaluate_model, headline, read_json, write_json
from polo.runtime.checkpoint import SaveError
from polo.runtime.device import torch_threads
from polo.runtime.interrupt import RunStopped, StopRequest
from polo.runtime.run_lock import owned_run_dir

DONE_FILE = "stage_done.json"
STARTED_FILE = "stage_started.json"
BASE_DIR = "base"


@dataclass
class StageResult:
    """What one stage left: its final model, whether it ran now, its time and its evaluation."""

    name: str
    label: str
    kind: str
    dir: Path
    model_dir: str
    ran: bool  # False: finished earlier and skipped
    seconds: float  # the stage's own work (data, training), not its evaluation
    evaluation: dict | None = None
    details: dict = field(default_factory=dict)


@dataclass
class PipelineResult:
    """What `run_pipeline` returns: the starting model's evaluation, every stage's result, the report."""

    dir: Path
    base: dict | None
    stages: list[StageResult]
    report: Path | None = None


def run_pipeline(recipe: str | Path | dict, overrides: list[str] | None = None) -> PipelineResult:
    """Run a pipeline recipe (path or mapping) with dotted overrides; return every stage's result.

    Everything is checked before the first stage starts: unknown keys, each stage's own recipe,
    the task and the counts it must supply. The pipeline holds `pipeline.dir` (and each stage its
    own directory) against a second run; a stop signal (Ctrl-C, SIGTERM, SIGHUP) stops it after
    the step in progress with `RunStopped`, and running the same command again continues it.
    """
    plan = load_pipeline(recipe, overrides)
    with owned_run_dir(plan.settings.dir, "pipeline.dir"), StopRequest() as stop, torch_threads(plan.settings.threads):
        for key, repo_id in push_targets(plan):
            check_push(repo_id, key)  # before anything runs: a model that could not be pushed is never trained
        return run_plan(plan, stop)


def push_targets(plan: Plan) -> list[tuple[str, str]]:
    """Return (key, repo id) of every Hub push the pipeline would make: `pipeline.push_to_hub`, the stages' own."""
    model, targets = plan.start_model, [("pipeline.push_to_hub", plan.settings.push_to_hub)]
    for stage in plan.stages:
        config = stage.config(model)
        targets.append((f"stages.{stage.name}.output.push_to_hub", config.output.push_to_hub))
        model = stage.final_model(config)
    return [(key, repo_id) for key, repo_id in targets if repo_id]


def run_plan(plan: Plan, stop: StopRequest) -> PipelineResult:
    """Run a loaded pipeline's stages in order and return every stage's result; the caller holds `pipeline.dir`.

    Raises `RunStopped` once `stop` is requested, between stages at the latest.
    """
    root = Path(plan.settings.dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "pipeline.yaml").write_text(yaml.safe_dump(plan.source, sort_keys=False))
    base = evaluate_model(plan, plan.start_model, root / BASE_DIR) if plan.eval.base else None
    results, model, upstream_ran, previous_dir = [], plan.start_model, False, root / BASE_DIR
    for stage in plan.stages:
        with owned_run_dir(
            stage.dir, "the stage directory", "pick another pipeline.dir"
        ):  # its data, its run and its evaluation
            result = run_stage(plan, stage, model, upstream_ran, previous_dir)
        upstream_ran = upstream_ran or result.ran
        model, previous_dir = result.model_dir, stage.dir
        results.append(result)
        if stop.requested and stage is not plan.stages[-1]:  # a signal during the stage's evaluation: the stage is done
            raise RunStopped(stop.signum, None, None, where=stage.label)
    report = None
    if plan.settings.report:
        from polo.pipeline.report import write_pipeline_report

        report = write_pipeline_report(root, [stage.label for stage in plan.stages])
    outcome = PipelineResult(root, base, results, report)
    print(summary_table(outcome), flush=True)
    publish_pipeline(plan, outcome)
    return outcome


def publish_pipeline(plan: Plan, outcome: PipelineResult) -> None:
    """Write the card of the whole pipeline into its final model, and push that to `pipeline.push_to_hub` when set.

    A final model that is not a directory the pipeline wrote (every stage passed its model on
    unchanged) gets no card; asking to push it is an error.
    """
    final = Path(outcome.stages[-1].model_dir)
    repo_id = plan.settings.push_to_hub
    if not (final.is_dir() and final.resolve().is_relative_to(outcome.dir.resolve())):
        if repo_id:
            raise SaveError(f"pipeline.push_to_hub={repo_id}: no stage trained a model, nothing to push ({final})")
        return
    kinds = [stage.kind for stage in plan.stages]
    samples = headline(outcome.stages[-1].evaluation)["samples"] or plan.eval.samples
    held_out = HeldOut(
        f"The pipeline's evaluation on its held-out problems: greedy accuracy, pass@1 over {samples} samples, "
        f"cons@{samples}",
        ("greedy_accuracy", "pass@1", "cons@k"),
        headline(outcome.base) if outcome.base is not None else None,
        headline(outcome.stages[-1].evaluation) if outcome.stages[-1].evaluation is not None else None,
    )
    card = ModelCard(
        location=repo_id or str(final),
        base_model=plan.start_model,
        method=f"pipeline ({' → '.join(f'{stage.label}: {stage.kind}' for stage in plan.stages)})",
        trained_on=plan.task.name,
        steps=sum(stage_steps(stage.details) for stage in outcome.stages),
        recipe=yaml.safe_dump(plan.source, sort_keys=False),
        command="pipeline",
        recipe_file="pipeline.yaml",
        held_out=held_out,
        no_eval_note="eval.enabled was off, or the task has no held-out rows",
        adapter=is_adapter_dir(final),
        tags=("pipeline", *dict.fromkeys(kinds), *(["reinforcement-learning"] if "grpo" in kinds else [])),
    )
    publish(final, card, repo_id, plan.settings.hub_private)


def stage_steps(details: dict) -> int:
    """Return the optimizer or RL steps a stage's details record (0 for a stage that trained nothing)."""
    return int(details.get("steps") or (details.get("sft") or {}).get("steps") or 0)


def run_stage(
    plan: Plan, stage: Stage, model: str, upstream_ran: bool, previous_dir: Path | None = None
) -> StageResult:
    """Run one stage from `model` (or skip it when it finished with the same recipe), evaluate it, mark it done.

    `previous_dir` is where `model`'s evaluation was written (the previous stage's directory, or base/).
    """
    config = stage.config(model)
    record = json.loads(json.dumps(stage_record(stage, config), default=str))
    done = read_json(stage.dir / DONE_FILE)
    if done is not None and same_record(done.get("record"), record) and not upstream_ran:
        print(
            f"polo pipeline: stage {stage.label} ({stage.kind}) already done; skipping it ({stage.dir / DONE_FILE})",
            flush=True,
        )
        evaluation = evaluate_model(plan, done["model_dir"], stage.dir)
        return StageResult(
            stage.name,
            stage.label,
            stage.kind,
            stage.dir,
            done["model_dir"],
            False,
            done["seconds"],
            evaluation,
            done.get("details", {}),
        )
    started = read_json(stage.dir / STARTED_FILE)
    resumable = done is None and not upstream_ran and started is not None and same_record(started.get("record"), record)
    why = (
        "its recipe changed"
        if done is not None and not same_record(done.get("record"), record)
        else "an earlier stage ran again"
        if done
        else ""
    )
    (stage.dir / DONE_FILE).unlink(missing_ok=True)
    (stage.dir / EVAL_FILE).unlink(missing_ok=True)  # it may name the same model directory, now to be trained again
    write_json(stage.dir / STARTED_FILE, {"record": record})
    print(
        f"polo pipeline: stage {stage.label} ({stage.kind}) from {model} -> {stage.dir}"
        + (f" (again: {why})" if why else " (continuing)" if resumable and stage.kind in ("grpo", "sft") else ""),
        flush=True,
    )
    began = time.perf_counter()
    try:
        model_dir, details = RUNNERS[stage.kind](plan, stage, config, model, resumable)
    except RunStopped as stopped:
        raise stopped.in_stage(stage.label) from None
    seconds = time.perf_counter() - began
    gc.collect()
    if model_dir == model and previous_dir is not None and (previous_dir / EVAL_FILE).exists():
        shutil.copyfile(
            previous_dir / EVAL_FILE, stage.dir / EVAL_FILE
        )  # the same model: its evaluation is the previous one
    evaluation = evaluate_model(plan, model_dir, stage.dir)
    result = StageResult(stage.name, stage.label, stage.kind, stage.dir, model_dir, True, seconds, evaluation, details)
    write_json(
        stage.dir / DONE_FILE,
        {
            "stage": stage.name,
            "label": stage.label,
            "kind": stage.kind,
            "model_dir": model_dir,
            "started_from": model,
            "seconds": seconds,
            "details": details,
            "evaluation": evaluation,
            "record": record,
        },
    )
    return result


def run_grpo(plan: Plan, stage: Stage, config: Any, model: str, resumable: bool) -> tuple[str, dict]:
    """Train a grpo stage (continuing an interrupted one); return (its final checkpoint, details)."""
    from polo.rl.train import train
    from polo.runtime.checkpoint import Checkpointer

    # overwrite: a run that cannot continue (none yet, or from another recipe) replaces what is there
    result = train(config, ["output.overwrite=true"] + (["output.resume=true"] if resumable else []))
    final = Checkpointer(Path(result.output_dir), 1).latest()
    if final is None:
        raise RuntimeError(f"stage {stage.label}: the run wrote no checkpoint in {result.output_dir}")
    accuracy = lambda result: None if result is None else result.get("accuracy")  # noqa: E731
    return str(final), {
        "steps": result.steps,
        "eval_before": accuracy(result.eval_before),
        "eval_after": accuracy(result.eval_after),
    }


def run_sft(plan: Plan, stage: Stage, config: Any, model: str, resumable: bool) -> tuple[str, dict]:
    """Write the stage's cold-start demonstrations (when built from the task), fine-tune; return (final/, details)."""
    from polo.data.preferences import write_jsonl
    from polo.finetune.sft import sft
    from polo.pipeline.demos import cold_start_rows
    from polo.pipeline.rejection import training_prompts

    details: dict = {}
    if stage.demos is not None:
        demos = stage.demos
        rows = training_prompts(plan.task, demos.num_train + demos.num_eval, demos.seed)
        examples = cold_start_rows(plan.task, rows, plan.instruction, plan.task_config.task.system_prompt)
        write_jsonl(Path(config.data.train_path), examples[: demos.num_train])
        if demos.num_eval:
            write_jsonl(Path(config.data.eval_path), examples[demos.num_train :])
        details["demonstrations"] = demos.num_train
    result = sft(config, ["output.resume=true"] if resumable else None)  # overwrite: none to continue, start anew
    loss = lambda result: None if result is None else result.get("loss")  # noqa: E731
    return str(result.model_dir), {
        **details,
        "steps": result.steps,
        "loss_before": loss(result.eval_before),
        "loss_after": loss(result.eval_after),
    }


def run_reject_sft(plan: Plan, stage: Stage, config: Any, model: str, resumable: bool) -> tuple[str, dict]:
    """Return (final model, details) after sampling the previous model and fine-tuning on its correct, well-formed
    answers.

    With fewer than `rejection.min_kept` answers kept there is nothing to learn from: the stage
    passes `model` on unchanged, and says so.
    """
    from polo.data.preferences import write_jsonl
    from polo.finetune.sft import sft
    from polo.generation.grouped import GroupSampling, load_for_sampling
    from polo.pipeline.rejection import RejectionDraw, rejection_sample
    from polo.runtime.device import inference_compute
    from polo.runtime.seeding import seed_everything

    settings, compute = stage.rejection, inference_compute(config.train.precision, config.train.device)
    seed_everything(settings.seed)
    policy, tokenizer = load_for_sampling(model, compute)
    print(
        f"polo pipeline: rejection sampling {settings.num_prompts} prompts x {settings.samples} samples from {model}",
        flush=True,
    )
    draw = RejectionDraw(
        num_prompts=settings.num_prompts,
        max_per_prompt=settings.max_per_prompt,
        instruction=plan.instruction,
        system_prompt=plan.task_config.task.system_prompt,
        seed=settings.seed,
    )
    sampling = GroupSampling(
        samples=settings.samples,
        max_new_tokens=settings.max_new_tokens or plan.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        batch_size=settings.batch_size,
        compute=compute,
        progress=plan.settings.progress,
        description="polo pipeline",
    )
    sampled = rejection_sample(policy, tokenizer, plan.task, draw, sampling)
    del policy
    gc.collect()
    summary = sampled.summary
    write_jsonl(Path(config.data.train_path), sampled.rows)
    write_json(stage.dir / "rejection_summary.json", summary)
    totals = {key: value for key, value in summary.items() if key != "per_prompt"}
    print(
        f"polo pipeline: kept {summary['kept']} of {summary['sampled']} samples (accepted {summary['accepted']}: "
        f"acceptance rate {summary['acceptance_rate']:.3f}; correct {summary['correct_rate']:.3f}, "
        f"well formed {summary['format_rate']:.3f})",
        flush=True,
    )
    if summary["kept"] < settings.min_kept:
        print(
            f"polo pipeline: warning: fewer than rejection.min_kept={settings.min_kept} kept; "
            f"stage {stage.label} passes {model} on unchanged",
            flush=True,
        )
        return model, {"rejection": totals, "sft": None}
    result = sft(config)
    return str(result.model_dir), {"rejection": totals, "sft": {"steps": result.steps}}


RUNNERS = {"grpo": run_grpo, "sft": run_sft, "reject_sft": run_reject_sft}


def summary_table(result: PipelineResult) -> str:
    """Return the pipeline's results as a plain aligned table: the starting model, then one row per stage."""
    rows = [("start", "", result.base, None)] if result.base is not None else []
    rows += [(stage.label, stage.kind, stage.evaluation, stage.seconds) for stage in result.stages]
    header = (
        f"{'stage':<16} {'kind':<10} {'greedy':>7} {'format':>7} {'pass@1':>7} {'cons@k':>7} {'length':>7} {'time':>8}"
    )
    lines = [header]
    for label, kind, evaluation, seconds in rows:
        numbers = headline(evaluation)
        cells = [numbers[key] for key in ("greedy_accuracy", "format", "pass@1", "cons@k")]
        time_text = "" if seconds is None else f"{seconds / 60:.1f} min"
        lines.append(
            f"{label:<16} {kind:<10} "
            + " ".join(f"{value:>7.3f}" for value in cells)
            + f" {numbers['length']:>7.1f} {time_text:>8}"
        )
    return "\n".join(lines)
