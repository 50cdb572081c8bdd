"""Hugging Face Hub models: `org/name[@revision]` ids read through the local hub cache, and pushing a trained model.

A `model.name` (or `--model`) that is not an existing local directory but has the form `org/name`
or `org/name@revision` is a Hub id. It is looked up in the Hugging Face cache first
(`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`: the layout
`models--org--name/snapshots/<commit>/` that `hf download` and transformers write) without any
network access; only when it is not there and the Hub is not offline (`HF_HUB_OFFLINE` and
`TRANSFORMERS_OFFLINE` unset) is it downloaded, config, tokenizer and weights only. Every failure is
one line (a `ModelLoadError`) saying where polo looked and what to do.

After a run, `publish` writes the README.md of the final model (`model_card`: the recipe, held-out
figures before and after, how to load it) and uploads that directory to a Hub repository when the
run's `output.push_to_hub` names one (`check_push` asked before anything loaded whether it can).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from polo.config import ConfigError
from polo.config.validation import HUB_REPO_ID

# What a model needs from its repository: config, tokenizer and safetensors weights (not ONNX,
# GGUF or framework copies). Repositories with only PyTorch pickles get those instead.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]
PICKLED_WEIGHTS = ["*.json", "pytorch_model*.bin", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]
# Never uploaded: the optimizer state, RNG streams and run state of a checkpoint (large, and no use to a reader).
NOT_PUSHED = ["trainer_state.pt", ".*"]
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean variable


class HubModelError(ValueError):
    """A Hub id that is neither cached nor downloadable (`polo.models.loading` raises it as a `ModelLoadError`)."""


def parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """Return `(repo_id, revision or None)` when `name` has the form `org/name[@revision]`, else None."""
    repo_id, at, revision = name.partition("@")
    if not HUB_REPO_ID.fullmatch(repo_id) or (at and not re.fullmatch(r"[\w./-]+", revision, re.ASCII)):
        return None
    return repo_id, revision or None


def is_hub_id(name: str) -> bool:
    """Return whether `name` has the form of a Hugging Face Hub model id (`org/name[@revision]`)."""
    return parse_hub_id(name) is not None


def hub_cache_dir() -> Path:
    """Return the Hugging Face hub cache as the environment says now (huggingface_hub reads it once, at import)."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.path.expandvars(os.environ[variable])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def offline_setting() -> str | None:
    """Return the variable that puts the Hub offline, as `NAME=value` (None when the Hub may be reached)."""
    for variable in _OFFLINE_VARIABLES:
        value = os.environ.get(variable, "")
        if value.upper() in _TRUE:
            return f"{variable}={value}"
    return None


def has_weights(directory: Path) -> bool:
    """Return whether a model (or adapter) directory holds weight files."""
    return any(directory.glob("*.safetensors")) or any(directory.glob("*.bin"))


def hub_snapshot(name: str) -> Path:
    """Return the local snapshot directory of Hub id `name`: from the cache, else downloaded (unless the Hub is
    offline)."""
    repo_id, revision = parse_hub_id(name) or (name, None)
    cache = hub_cache_dir()
    cached = _cached_snapshot(repo_id, revision, cache)
    if cached is not None:
        return cached
    offline = offline_setting()
    fetch = f"'hf download {repo_id}{f' --revision {revision}' if revision else ''}'"
    if offline:
        raise HubModelError(
            f"model {name!r} is not a local directory, and as a Hugging Face Hub id it is not in the local cache "
            f"({cache}) while the Hub is offline ({offline}): fetch it on a machine with internet with {fetch} "
            "(or 'huggingface-cli download') and copy the cache here, or point the model at a local directory"
        )
    return _download(name, repo_id, revision, cache, fetch)


def _cached_snapshot(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """Return the cached snapshot of `repo_id` at `revision` when it is there with weights (None otherwise), without
    touching the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache, local_files_only=True, allow_patterns=MODEL_FILES
            )
        )
    except (LocalEntryNotFoundError, ValueError):  # not cached, or cached incompletely (IncompleteSnapshotError)
        return None
    return path if has_weights(path) else None


def _download(name: str, repo_id: str, revision: str | None, cache: Path, fetch: str) -> Path:
    """Download `repo_id`'s config, tokenizer and weights into the cache and return the snapshot directory."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=MODEL_FILES))
        if not has_weights(path):  # an older repository with PyTorch pickles only
            path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=PICKLED_WEIGHTS))
    except Exception as error:
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        raise HubModelError(
            f"model {name!r} is not a local directory or in the local Hugging Face cache ({cache}), and downloading "
            f"it from the Hub failed ({type(error).__name__}: {reason}); check the id and your connection (a gated or "
            f"private model needs 'hf auth login'), fetch it elsewhere with {fetch} and copy the cache, or point the "
            "model at a local directory"
        ) from error
    if not has_weights(path):
        raise HubModelError(f"Hub model {name!r} has no safetensors or pytorch_model*.bin weights ({path})")
    return path


# ---------------------------------------------------------------- pushing a trained model


def check_push(repo_id: str, key: str = "output.push_to_hub") -> None:
    """Raise `ConfigError` before a run starts when its model could not be pushed to `repo_id` (setting `key`) at
    the end."""
    offline = offline_setting()
    if offline:
        raise ConfigError(
            f"{key}={repo_id} needs the Hugging Face Hub, but it is offline ({offline}): "
            f"run where the Hub can be reached, or set {key}=null "
            f"(the final model and its README.md stay in {key.removesuffix('push_to_hub')}dir)"
        )
    from huggingface_hub import get_token

    if not get_token():
        raise ConfigError(
            f"{key}={repo_id} needs a Hugging Face token with write access: "
            f"run 'hf auth login' or set HF_TOKEN, or set {key}=null"
        )


def push_folder(folder: Path, repo_id: str, private: bool, message: str) -> str:
    """Return the URL of `repo_id` after uploading `folder` to it (checkpoint state left out), created if needed
    (private when asked)."""
    from huggingface_hub import HfApi

    api = HfApi()
    url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    api.upload_folder(
        repo_id=repo_id, folder_path=str(folder), repo_type="model", commit_message=message, ignore_patterns=NOT_PUSHED
    )
    return str(url)


@dataclass
class HeldOut:
    """The held-out figures a model card shows: each metric before and after training."""

    description: str  # what was measured, e.g. "Greedy decoding on 200 held-out problems"
    metrics: tuple[str, ...]  # the keys of `before` / `after` shown, in order
    before: dict | None
    after: dict | None


@dataclass
class ModelCard:
    """What the README.md of a trained model says (`model_card` renders it)."""

    location: str  # what loads the model: a Hub repo id or a directory
    base_model: str
    method: str  # grpo, dapo, sft, dpo, reward model, ...
    trained_on: str  # the task's name or the data file
    steps: int
    recipe: str  # the run's config.yaml text
    command: str = "train"  # the polo command whose recipe `recipe` is
    recipe_file: str = "config.yaml"  # the name the run gave `recipe` in its directory
    held_out: HeldOut | None = None  # None: no held-out evaluation was run
    no_eval_note: str = "eval.before and eval.after were off, or the task has no held-out rows"
    adapter: bool = False  # a LoRA adapter, loaded with peft
    reward_model: bool = False  # a sequence classifier with one output, loaded with AutoModelForSequenceClassification
    tags: tuple[str, ...] = ()  # the Hub tags after "polo", the method's first: ("grpo", "reinforcement-learning")


def model_card(card: ModelCard) -> str:
    """Return the README.md of a trained model: Hub metadata, what it is, held-out figures, how to load it, the recipe.

    The metadata names `base_model` only when it is a Hub id (the Hub refuses other values).
    """
    base = parse_hub_id(card.base_model)
    tags = ["polo", *card.tags] + (["lora", "peft"] if card.adapter else [])
    pipeline_tag = "text-classification" if card.reward_model else "text-generation"
    metadata = {"library_name": "polo", "pipeline_tag": pipeline_tag, "tags": list(dict.fromkeys(tags))}
    if base is not None:
        metadata["base_model"] = base[0]
    title = (
        card.location.split("/")[-1]
        if is_hub_id(card.location)
        else f"{card.base_model.rstrip('/').split('/')[-1]}: {card.method} on {card.trained_on}"
    )
    lines = ["---", yaml.safe_dump(metadata, sort_keys=False).strip(), "---", "", f"# {title}", ""]
    kind = "LoRA adapter for" if card.adapter else "reward model on" if card.reward_model else "fine-tune of"
    lines += [
        f"A {kind} `{card.base_model}`, trained with polo's {card.method} for {card.steps} steps "
        f"on `{card.trained_on}`.",
        "",
    ]
    lines += _held_out_table(card)
    lines += ["## Loading", "", "```python", *_loading_lines(card), "```", ""]
    if card.command == "train" and not card.reward_model:
        lines += [
            "With polo, save the recipe below as `recipe.yaml` and run "
            f"`polo eval --model {card.location} --recipe recipe.yaml`.",
            "",
        ]
    lines += [
        "## Recipe",
        "",
        f"The run's `{card.recipe_file}` (`polo {card.command} {card.recipe_file}` repeats it):",
        "",
        "```yaml",
        card.recipe.strip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _loading_lines(card: ModelCard) -> list[str]:
    """Return the Python lines of the card's loading example."""
    if card.adapter:
        model = [
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{card.location}").merge_and_unload()',
        ]
    else:
        auto = "AutoModelForSequenceClassification" if card.reward_model else "AutoModelForCausalLM"
        model = [
            f"from transformers import {auto}, AutoTokenizer",
            "",
            f'model = {auto}.from_pretrained("{card.location}")',
        ]
    return [*model, f'tokenizer = AutoTokenizer.from_pretrained("{card.location}")']


def _held_out_table(card: ModelCard) -> list[str]:
    """Return the card's held-out section: each metric before and after training (or a line saying there was none)."""
    held_out = card.held_out
    if held_out is None or (held_out.before is None and held_out.after is None):
        return [f"No held-out evaluation was run ({card.no_eval_note}).", ""]

    def cells(result: dict | None) -> str:
        return " | ".join("not measured" if result is None else f"{result[key]:.3f}" for key in held_out.metrics)

    return [
        "## Held-out " + ("accuracy" if held_out.metrics == ("accuracy",) else "evaluation"),
        "",
        f"{held_out.description}:",
        "",
        "| | " + " | ".join(held_out.metrics) + " |",
        "|---|" + "---|" * len(held_out.metrics),
        f"| before training | {cells(held_out.before)} |",
        f"| after training | {cells(held_out.after)} |",
        "",
    ]


def publish(folder: Path, card: ModelCard, repo_id: str | None, private: bool = False) -> None:
    """Write `card` as `folder`/README.md and upload `folder` to `repo_id` when set; raise `SaveError` on failure.

    The error says the model is intact and gives the command that uploads it again.
    """
    from polo.runtime.checkpoint import SaveError

    readme, text = folder / "README.md", model_card(card)
    if not readme.exists() or readme.read_text() != text:  # a finished run published again leaves its folder as it was
        readme.write_text(text)
    if not repo_id:
        return
    message = f"polo {card.method}: {card.base_model} after {card.steps} steps on {card.trained_on}"
    try:
        url = push_folder(folder, repo_id, private=private, message=message)
    except Exception as error:
        raise SaveError(
            f"could not push {folder} to the Hugging Face Hub repo {repo_id} ({type(error).__name__}: "
            f"{' '.join(str(error).split())[:300]}); the trained model is intact there: push it again with "
            f"'hf upload {repo_id} {folder} --exclude trainer_state.pt'"
        ) from error
    print(f"polo: pushed {folder} to {url}", flush=True)
