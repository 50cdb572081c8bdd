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
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polo.config import (
    Config,
    ConfigError,
    apply_overrides,
    build_dataclass,
    check_settings,
    config_to_dict,
    load_config,
    read_recipe,
    setting,
)
from polo.config.finetune import SFTConfig, load_sft_config
from polo.config.schema import DEFAULT_MODEL, DEVICE_HELP, TRACKER_PACKAGES
from polo.config.validation import check_hub_repo, check_output_dir, check_trackers
from polo.data import instruction_for, make_task
from polo.data.base import Task
from polo.pipeline.demos import has_builtin_demonstrations

KINDS = ("sft", "grpo", "reject_sft")
STAGE_NAME = re.compile(r"[A-Za-z0-9_]+")


@dataclass
class PipelineSettings:
    """Where the pipeline writes, the model its first stage starts from, and where its stages report."""

    dir: str = setting(
        "runs/pipeline", help="the pipeline directory: one directory per stage (<letter>_<name>), pipeline.yaml, report"
    )
    model: str = setting(DEFAULT_MODEL, help="the first stage's model.name unless that stage sets its own")
    report: bool = setting(True, help="write <dir>/report.html at the end")
    progress: bool = setting(True, help="progress bars while sampling for rejection and evaluation")
    threads: int | None = setting(
        None,
        help="torch intra-op threads for the pipeline (null: torch's default; a stage's train.threads changes it)",
        range=">= 1",
    )
    device: str = setting(
        "auto", help=f"every stage's train.device unless it sets one, and the evaluations': {DEVICE_HELP}"
    )
    report_to: list[str] | None = setting(
        None,
        help="the trackers of every stage that sets no output.report_to (null: each stage's own default, tensorboard); "
        "every stage reports to one project and one store (pipeline.dir), as run <dir name>-<stage directory>",
        choices=tuple(TRACKER_PACKAGES),
    )
    project: str | None = setting(
        None, help="the trackers' project of every stage that sets none (null: as output.project of polo train)"
    )
    push_to_hub: str | None = setting(
        None,
        help="a Hugging Face Hub repo id org/name: the last stage's model and a card of the whole pipeline are "
        "uploaded there at the end; checked (online, token) before anything runs. null: no upload",
    )
    hub_private: bool = setting(False, help="a repository push_to_hub creates is private")


@dataclass
class StageEvalSettings:
    """The evaluation after every stage (and of the starting model): `polo eval`'s numbers on the held-out set."""

    enabled: bool = setting(True, help="evaluate after every stage")
    base: bool = setting(True, help="evaluate the starting model too (the table's first row)")
    samples: int = setting(16, help="K: pass@1 over K samples, cons@K (majority vote)", range=">= 1")
    num_problems: int | None = setting(100, help="the first N held-out problems (null: all)", range=">= 1")
    temperature: float = setting(
        0.6, help="sampling temperature (DeepSeek-R1's evaluation setting); 0: greedy", range=">= 0"
    )
    top_p: float = setting(0.95, help="nucleus sampling's top-p (DeepSeek-R1's evaluation setting)", range="(0, 1]")
    greedy: bool = setting(True, help="also one greedy answer per problem (the accuracy training reports)")
    max_new_tokens: int | None = setting(
        None, help="null: the largest sampling.max_new_tokens of the grpo stages (64 without one)", range=">= 1"
    )
    batch_size: int = setting(64, help="prompts sampled together", range=">= 1")
    seed: int = setting(0, help="seeds the evaluation's sampling")
    precision: str = setting("auto", help="auto | fp32 | bf16", choices=("auto", "fp32", "bf16"))


@dataclass
class DemoSettings:
    """Cold-start demonstrations built from the task's training rows (`polo.pipeline.demos`); an sft stage's `demos`."""

    num_train: int = setting(300, help="demonstrations to train on", range=">= 1")
    num_eval: int = setting(0, help="more rows (after the training ones) as the SFT held-out set", range=">= 0")
    seed: int = setting(0, help="which training rows")


@dataclass
class RejectionSettings:
    """Rejection sampling from the previous stage's model (`polo.pipeline.rejection`): a reject_sft's `rejection`."""

    num_prompts: int = setting(64, help="N training prompts", range=">= 1")
    samples: int = setting(8, help="K samples each", range=">= 1")
    max_per_prompt: int = setting(2, help="M: at most this many accepted answers kept per prompt", range=">= 1")
    temperature: float = setting(1.0, help="sampling temperature", range="> 0")
    top_p: float = setting(1.0, help="nucleus sampling's top-p", range="(0, 1]")
    max_new_tokens: int | None = setting(None, help="null: as eval.max_new_tokens", range=">= 1")
    batch_size: int = setting(64, help="prompts sampled together", range=">= 1")
    seed: int = setting(0, help="which prompts, and the sampling")
    min_kept: int = setting(
        1, help="with fewer kept completions the SFT is skipped and the model passes on unchanged", range=">= 0"
    )


@dataclass
class PipelineRecipe:
    """`polo pipeline RECIPE.yaml`: stages (sft, grpo, reject_sft), each a polo run from the last one's model."""

    pipeline: PipelineSettings = setting(default_factory=PipelineSettings, help="the pipeline as a whole")
    task: dict = setting(
        {}, help="the one task (polo train's task section): demonstrations, prompts and the held-out set"
    )
    eval: StageEvalSettings = setting(default_factory=StageEvalSettings, help="the evaluation after every stage")
    stages: dict = setting(
        {},
        help="name -> stage (or a list of stages with name:): kind (sft | grpo | reject_sft), optionally recipe "
        "(a polo recipe file) and overrides (dotted key=value strings applied to it), demos (sft) or rejection "
        "(reject_sft), and the sections of polo train's (grpo) or polo sft's recipe merged over the file",
    )


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
    check_settings(sections)
    check_output_dir("pipeline.dir", settings.dir)
    check_trackers(settings.report_to or [], "pipeline.report_to")
    check_hub_repo("pipeline.push_to_hub", settings.push_to_hub)
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
    report_to_one_project(body["output"], settings, label)
    if kind == "grpo":
        body["task"] = deep_merge(task_section, body.get("task") or {})
        return stage
    body["output"]["overwrite"] = True  # an SFT stage with no checkpoint to continue from starts again
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
    """Return (the stage's recipe: its `recipe` file with `overrides`, inline sections merged over it; the inline
    model.name)."""
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
        settings = build_dataclass(cls, value)
    except ConfigError as error:
        raise ConfigError(f"{where}.{key}: {error}") from None
    check_settings(settings, f"{where}.{key}.")
    return settings


def report_to_one_project(output: dict, settings: PipelineSettings, label: str) -> None:
    """Fill a stage's `output` so every stage reports to the pipeline's trackers and project, its label in the run name.

    What the stage sets itself wins.
    """
    if settings.report_to is not None:
        output.setdefault("report_to", list(settings.report_to))
    if settings.project is not None:
        output.setdefault("project", settings.project)
    output.setdefault("run_name", f"{Path(settings.dir).resolve().name}-{label}")
    output.setdefault("tracker_dir", settings.dir)


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
                f"{where}: task {plan.task.name!r} has no built-in cold-start demonstrations (arithmetic and gsm8k "
                "have); set data.train_path to a jsonl of {prompt, response} demonstrations"
            )
        wanted = stage.demos.num_train + stage.demos.num_eval
        if wanted > train_rows:
            raise ConfigError(
                f"{where}.demos: num_train + num_eval = {wanted} must fit the task's {train_rows} training rows"
            )
    rejection = stage.rejection
    if rejection is not None and rejection.num_prompts > train_rows:
        raise ConfigError(
            f"{where}.rejection.num_prompts={rejection.num_prompts} is more than the task's {train_rows} training rows"
        )


# How a stage runs and reports, not what it makes: left out of the record that decides whether it is current.
RUN_ONLY_KEYS = (
    "resume",
    "overwrite",
    "progress",
    "report_to",
    "project",
    "run_name",
    "tracker_dir",
    "push_to_hub",
    "hub_private",
)


def stage_record(stage: Stage, config: Any) -> dict:
    """Return what decides whether a finished stage is still current: its checked config and data settings."""
    record = {"kind": stage.kind, "config": config_to_dict(config)}
    for key in ("demos", "rejection"):
        value = getattr(stage, key)
        if value is not None:
            record[key] = dataclasses.asdict(value)
    for key in RUN_ONLY_KEYS:
        record["config"]["output"].pop(key, None)
    return record


def same_record(stored: dict | None, record: dict) -> bool:
    """Return True when a stage's stored record (from an earlier polo, perhaps) describes the same stage as `record`.

    A setting polo added since the record was written counts as unchanged when it holds its
    default, and one polo removed (output.tensorboard) is ignored: upgrading polo does not make a
    finished stage run again.
    """
    if not isinstance(stored, dict) or stored.get("kind") != record["kind"]:
        return False
    default_stage = Stage("", "", record["kind"], Path(), {}, DemoSettings(), RejectionSettings())
    defaults = stage_record(default_stage, Config() if record["kind"] == "grpo" else SFTConfig())
    defaults = json.loads(json.dumps(defaults, default=str))  # as the stored record was written
    return set(stored) <= set(record) and all(
        upgraded(stored.get(key), record[key], defaults.get(key)) == record[key] for key in record
    )


def upgraded(stored: Any, current: Any, default: Any) -> Any:
    """Return `stored` with the keys only `current` has taken from `default`, and the keys `current` lacks dropped."""
    if not (isinstance(stored, dict) and isinstance(current, dict)):
        return stored
    default = default if isinstance(default, dict) else {}
    return {
        key: upgraded(stored[key], current[key], default.get(key)) if key in stored else default.get(key, _MISSING)
        for key in current
    }


_MISSING = object()  # a key neither the stored record nor the defaults have: never equal to a current value
