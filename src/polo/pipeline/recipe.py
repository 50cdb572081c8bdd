"""A pipeline recipe: sections `pipeline`, `task`, `eval` and `stages`, checked whole before any stage runs.

```yaml
pipeline: {dir: runs/r1_arith, model: smollm2-135m-instruct}
task: {name: arithmetic, answer_in_tags: true}       # the one task: demonstrations, prompts, held-out set
eval: {samples: 16, num_problems: 100}                # after every stage: greedy, pass@1 over K, cons@K
stages:
  cold_start: {kind: sft, demos: {num_train: 300}, train: {...}}
  reason: {kind: grpo, recipe: recipes/grpo_arith_r1.yaml, train: {steps: 30}}
  reject: {kind: reject_sft, rejection: {num_prompts: 64, samples: 8, max_per_prompt: 2}}
  reason2: {kind: grpo, ...}
```

A stage is a mapping (or a list item with `name:`) with `kind` (`sft`, `grpo`, `reject_sft`),
optionally `recipe` (a polo recipe file) and `overrides` (dotted `key=value` strings applied to
that file), and the sections of its kind's own recipe (`polo train`'s for grpo, `polo sft`'s for
the others) merged over it. The pipeline sets each stage's `output.dir` (`<dir>/<letter>_<name>`)
and, after the first, its `model.name` (the previous stage's final model); grpo stages get the
pipeline's `task` under their own `task` keys. A stage set to null is left out.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polo.config import Config, ConfigError, apply_overrides, build_dataclass, config_to_dict, load_config, read_recipe
from polo.config.validation import check_output_dir
from polo.data import instruction_for, make_task
from polo.data.base import Task
from polo.finetune.sft import SFTConfig, load_sft_config
from polo.pipeline.demos import has_builtin_demonstrations

KINDS = ("sft", "grpo", "reject_sft")
STAGE_NAME = re.compile(r"[A-Za-z0-9_]+")


@dataclass
class PipelineSettings:
    """Where the pipeline writes, and the model its first stage starts from."""

    dir: str = "runs/pipeline"
    model: str = "smollm2-135m-instruct"  # the first stage's model.name unless that stage sets its own
    report: bool = True  # write <dir>/report.html at the end
    progress: bool = True  # progress bars while sampling for rejection and evaluation
    threads: int | None = (
        None  # torch intra-op threads for the pipeline (null: torch's default; a stage's train.threads changes it)
    )
    device: str = (
        "auto"  # auto | cpu | cuda | cuda:N: every stage's train.device unless it sets one, and the evaluations'
    )


@dataclass
class StageEvalSettings:
    """The evaluation after every stage (and of the starting model): `polo eval`'s numbers on the held-out set."""

    enabled: bool = True
    base: bool = True  # evaluate the starting model too (the table's first row)
    samples: int = 16  # K: pass@1 over K samples, cons@K
    num_problems: int | None = 100  # the first N held-out problems (null: all)
    temperature: float = 0.6  # DeepSeek-R1's evaluation setting
    top_p: float = 0.95
    greedy: bool = True  # also one greedy answer per problem (the accuracy training reports)
    max_new_tokens: int | None = None  # null: the largest sampling.max_new_tokens of the grpo stages (64 without one)
    batch_size: int = 64
    seed: int = 0
    precision: str = "auto"  # auto | fp32 | bf16


@dataclass
class DemoSettings:
    """Cold-start demonstrations built from the task's training rows (`polo.pipeline.demos`)."""

    num_train: int = 300
    num_eval: int = 0  # more rows (after the training ones) as the SFT held-out set
    seed: int = 0  # which training rows


@dataclass
class RejectionSettings:
    """Rejection sampling from the previous stage's model (`polo.pipeline.rejection`)."""

    num_prompts: int = 64  # N training prompts
    samples: int = 8  # K samples each
    max_per_prompt: int = 2  # M: at most this many kept per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None  # null: as eval.max_new_tokens
    batch_size: int = 64
    seed: int = 0
    min_kept: int = 1  # with fewer kept completions the SFT is skipped and the model passes on unchanged


@dataclass
class PipelineRecipe:
    """The checked top-level sections of a pipeline recipe."""

    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    task: dict = field(default_factory=dict)
    eval: StageEvalSettings = field(default_factory=StageEvalSettings)
    stages: dict = field(default_factory=dict)


KIND_SECTIONS = {
    "grpo": tuple(field.name for field in dataclasses.fields(Config)),
    "sft": (*(field.name for field in dataclasses.fields(SFTConfig)), "demos"),
    "reject_sft": (*(field.name for field in dataclasses.fields(SFTConfig)), "rejection"),
}
STAGE_KEYS = ("kind", "recipe", "overrides")


@dataclass
class Stage:
    """One stage of the plan: its kind, where it writes, and its own recipe (model.name filled in at run time)."""

    name: str
    label: str  # <letter>_<name>: the stage directory's name
    kind: str
    dir: Path
    body: dict  # the stage's recipe for polo train / polo sft, without model.name
    demos: DemoSettings | None = None
    rejection: RejectionSettings | None = None
    own_model: str | None = None  # the model.name written in the stage itself (only the first stage may)

    def recipe(self, model: str) -> dict:
        """Return the stage's recipe starting from `model`."""
        body = copy.deepcopy(self.body)
        body.setdefault("model", {})["name"] = model
        return body

    def config(self, model: str) -> Any:
        """Return the stage's checked config (`Config` for grpo, `SFTConfig` otherwise) starting from `model`."""
        try:
            if self.kind == "grpo":
                return load_config(self.recipe(model))
            return load_sft_config(self.recipe(model))
        except ConfigError as error:
            raise ConfigError(f"stages.{self.name}: {error}") from None

    def final_model(self, config: Any) -> str:
        """Return where the stage's final model will be: checkpoints/step-N for grpo, final/ for sft."""
        if self.kind == "grpo":
            return str(self.dir / "checkpoints" / f"step-{config.train.steps:06d}")
        return str(self.dir / "final")


@dataclass
class Plan:
    """A checked pipeline: settings, the task, the evaluation and the stages in order."""

    settings: PipelineSettings
    task_config: Config  # a Config holding the pipeline's task (for prompts and the held-out set)
    task: Task
    instruction: str
    eval: StageEvalSettings
    stages: list[Stage]
    max_new_tokens: int  # the evaluation's and rejection sampling's default completion budget
    source: dict  # the recipe after overrides, as read

    @property
    def start_model(self) -> str:
        """Return the model the first stage starts from: its own model.name, else pipeline.model."""
        return self.stages[0].own_model or self.settings.model


def load_pipeline(recipe: str | Path | dict, overrides: list[str] | None = None) -> Plan:
    """Return the checked `Plan` of a pipeline recipe (path or mapping) and dotted overrides; nothing runs."""
    data = apply_overrides(normalised_stages(unshared(read_recipe(recipe, None))), overrides or [])
    known = [field.name for field in dataclasses.fields(PipelineRecipe)]
    unknown = [key for key in data if key not in known]
    if unknown:
        raise ConfigError(f"unknown pipeline recipe key {unknown[0]!r}; valid keys: {', '.join(known)}")
    sections = build_dataclass(
        PipelineRecipe, {key: value for key, value in data.items() if key in ("pipeline", "eval")}
    )
    settings, evaluation = sections.pipeline, sections.eval
    check_output_dir("pipeline.dir", settings.dir)
    if settings.threads is not None and settings.threads < 1:
        raise ConfigError(f"pipeline.threads must be at least 1 (or null), got {settings.threads}")
    check_eval(evaluation)
    task_section = data.get("task") or {}
    if not isinstance(task_section, dict):
        raise ConfigError(f"task: expected a mapping of task settings, got {task_section!r}")
    task_config = load_config({"model": {"name": settings.model}, "task": task_section})
    task = make_task(task_config)
    stages = [
        build_stage(name, raw, index, settings, task_section)
        for index, (name, raw) in enumerate((name, raw) for name, raw in stages_of(data).items() if raw is not None)
    ]
    if not stages:
        raise ConfigError(f"stages: the pipeline has no stages; give at least one of kind {', '.join(KINDS)}")
    plan = Plan(settings, task_config, task, instruction_for(task_config, task), evaluation, stages, 64, data)
    plan.max_new_tokens = check_stages(plan)
    return plan


def unshared(value: Any) -> Any:
    """Return a copy of nested mappings and lists in which no two places share an object.

    YAML anchors (`sampling: *rl_sampling`) make two stages hold the same dict; an override of
    one stage must not change the other.
    """
    if isinstance(value, dict):
        return {key: unshared(item) for key, item in value.items()}
    if isinstance(value, list):
        return [unshared(item) for item in value]
    return value


def normalised_stages(data: dict) -> dict:
    """Return the recipe with a `stages` list (items with `name:`) turned into the equivalent mapping."""
    stages = data.get("stages")
    if not isinstance(stages, list):
        return data
    mapping = {}
    for index, item in enumerate(stages):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ConfigError(
                f"stages[{index}]: a stage in a list needs a name, e.g. {{name: reason, kind: grpo}}; got {item!r}"
            )
        if item["name"] in mapping:
            raise ConfigError(f"stages[{index}]: the name {item['name']!r} is used twice")
        mapping[item["name"]] = {key: value for key, value in item.items() if key != "name"}
    return {**data, "stages": mapping}


def stages_of(data: dict) -> dict:
    """Return the `stages` mapping, or raise `ConfigError` saying what a stage looks like."""
    stages = data.get("stages")
    if stages is None:
        raise ConfigError(f"the pipeline recipe has no stages; add `stages:` with stages of kind {', '.join(KINDS)}")
    if not isinstance(stages, dict):
        raise ConfigError(
            f"stages: expected a mapping of stage name -> stage (or a list of stages with names), got {stages!r}"
        )
    return stages


def deep_merge(base: dict, over: dict) -> dict:
    """Return `base` with `over` merged in: mappings merge key by key, anything else in `over` wins."""
    merged = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def build_stage(name: str, raw: Any, index: int, settings: PipelineSettings, task_section: dict) -> Stage:
    """Return the `Stage` a recipe entry describes (keys checked; the stage's own recipe merged and directed)."""
    where = f"stages.{name}"
    if not STAGE_NAME.fullmatch(str(name)):
        raise ConfigError(f"{where}: a stage name is letters, digits and _ only")
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where}: expected a mapping with kind ({', '.join(KINDS)}) and the stage's recipe sections, got {raw!r}"
        )
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"{where}.kind: {kind!r} is not one of {', '.join(KINDS)}")
    valid = (*STAGE_KEYS, *KIND_SECTIONS[kind])
    unknown = [key for key in raw if key not in valid]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} for a {kind} stage; valid keys: {', '.join(valid)}")
    body, own_model = stage_body(where, raw)
    label = f"{chr(ord('a') + index)}_{name}" if index < 26 else f"{index:02d}_{name}"
    stage = Stage(str(name), label, kind, Path(settings.dir) / label, body, own_model=own_model)
    body.setdefault("output", {})["dir"] = str(stage.dir)
    body.setdefault("train", {}).setdefault("device", settings.device)
    if kind == "grpo":
        body["task"] = deep_merge(task_section, body.get("task") or {})
        return stage
    body["output"]["overwrite"] = True  # an interrupted SFT stage starts again
    data = body.setdefault("data", {})
    if kind == "reject_sft":
        stage.rejection = extra_settings(where, raw, "rejection", RejectionSettings)
        data["train_path"] = str(stage.dir / "rejection.jsonl")
    elif not data.get("train_path"):
        stage.demos = extra_settings(where, raw, "demos", DemoSettings)  # built from the task into the stage directory
        data["train_path"] = str(stage.dir / "demos.jsonl")
        if stage.demos.num_eval:
            data["eval_path"] = str(stage.dir / "demos_eval.jsonl")
    elif raw.get("demos") is not None:
        raise ConfigError(
            f"{where}: set either data.train_path (your demonstrations) or demos (built from the task), not both"
        )
    return stage


def stage_body(where: str, raw: dict) -> tuple[dict, str | None]:
    """Return (the stage's recipe: its `recipe` file with `overrides`, inline sections merged over it, the inline model.name)."""
    overrides = raw.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(item, str) for item in overrides):
        raise ConfigError(f"{where}.overrides: expected a list of dotted.key=value strings, got {overrides!r}")
    try:
        body = apply_overrides(read_recipe(raw["recipe"]) if raw.get("recipe") else {}, overrides)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    inline = copy.deepcopy({key: value for key, value in raw.items() if key not in (*STAGE_KEYS, "demos", "rejection")})
    for key, value in [*body.items(), *inline.items()]:
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{where}.{key}: expected a mapping of {key} settings, got {value!r}")
    (body.get("model") or {}).pop("name", None)  # a recipe file's model is not this stage's: the pipeline chains them
    own_model = (inline.get("model") or {}).pop("name", None)
    present = lambda sections: {key: value for key, value in sections.items() if value is not None}  # noqa: E731
    return deep_merge(present(body), present(inline)), own_model


def extra_settings(where: str, raw: dict, key: str, cls: type) -> Any:
    """Return the stage's `demos` or `rejection` section as its settings dataclass (defaults when absent)."""
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}.{key}: expected a mapping of {key} settings, got {value!r}")
    try:
        return build_dataclass(cls, value)
    except ConfigError as error:
        raise ConfigError(f"{where}.{key}: {error}") from None


def check_eval(evaluation: StageEvalSettings) -> None:
    """Raise `ConfigError` for an evaluation setting that makes no sense."""
    if evaluation.samples < 1 or evaluation.batch_size < 1:
        raise ConfigError(
            f"eval.samples and eval.batch_size must be at least 1, got {evaluation.samples} and {evaluation.batch_size}"
        )
    for key, value in (
        ("eval.num_problems", evaluation.num_problems),
        ("eval.max_new_tokens", evaluation.max_new_tokens),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{key} must be at least 1 (or null), got {value}")
    if not 0 <= evaluation.temperature < float("inf") or not 0 < evaluation.top_p <= 1:
        raise ConfigError(
            f"eval.temperature must be >= 0 and eval.top_p in (0, 1], got {evaluation.temperature} and {evaluation.top_p}"
        )
    if evaluation.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"eval.precision: {evaluation.precision!r} is not one of auto, fp32, bf16")


def check_stages(plan: Plan) -> int:
    """Raise `ConfigError` for the first stage that could not run; return the default completion budget."""
    for stage in plan.stages[1:]:
        if stage.own_model:
            raise ConfigError(
                f"stages.{stage.name}.model.name: a later stage starts from the previous stage's final model; "
                "only the first stage may name its model (or set pipeline.model)"
            )
    model, budgets = plan.start_model, []
    for stage in plan.stages:
        config = stage.config(model)
        if stage.kind == "grpo":
            budgets.append(config.sampling.max_new_tokens)
        model = stage.final_model(config)
        check_stage_data(plan, stage)
    return plan.eval.max_new_tokens or max(budgets, default=64)


def check_stage_data(plan: Plan, stage: Stage) -> None:
    """Raise `ConfigError` when a stage asks the task for rows it does not have or demonstrations it cannot build."""
    where, train_rows = f"stages.{stage.name}", len(plan.task.train_rows)
    if stage.demos is not None:
        if not has_builtin_demonstrations(plan.task):
            raise ConfigError(
                f"{where}: task {plan.task.name!r} has no built-in cold-start demonstrations (arithmetic and gsm8k have); "
                "set data.train_path to a jsonl of {prompt, response} demonstrations"
            )
        wanted = stage.demos.num_train + stage.demos.num_eval
        if stage.demos.num_train < 1 or stage.demos.num_eval < 0 or wanted > train_rows:
            raise ConfigError(
                f"{where}.demos: num_train (>= 1) + num_eval (>= 0) = {wanted} must fit the task's {train_rows} training rows"
            )
    rejection = stage.rejection
    if rejection is not None:
        counts = {
            "num_prompts": rejection.num_prompts,
            "samples": rejection.samples,
            "max_per_prompt": rejection.max_per_prompt,
            "batch_size": rejection.batch_size,
        }
        for key, value in counts.items():
            if value < 1:
                raise ConfigError(f"{where}.rejection.{key} must be at least 1, got {value}")
        if rejection.num_prompts > train_rows:
            raise ConfigError(
                f"{where}.rejection.num_prompts={rejection.num_prompts} is more than the task's {train_rows} training rows"
            )
        if not 0 < rejection.temperature < float("inf") or not 0 < rejection.top_p <= 1:
            raise ConfigError(
                f"{where}.rejection: temperature must be > 0 and top_p in (0, 1], got {rejection.temperature} and {rejection.top_p}"
            )


def stage_record(stage: Stage, config: Any) -> dict:
    """Return what decides whether a finished stage is still current: its checked config and data settings."""
    record = {"kind": stage.kind, "config": config_to_dict(config)}
    for key in ("demos", "rejection"):
        value = getattr(stage, key)
        if value is not None:
            record[key] = dataclasses.asdict(value)
    for key in ("resume", "overwrite", "progress"):  # how the stage runs, not what it makes
        record["config"]["output"].pop(key, None)
    return record
