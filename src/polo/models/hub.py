"""Hugging Face Hub models: `org/name[@revision]` ids read through the local hub cache, and pushing a trained model.

A `model.name` (or `--model`) that is not an existing local directory but has the form `org/name`
or `org/name@revision` is a Hub id. It is looked up in the Hugging Face cache first
(`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`: the layout
`models--org--name/snapshots/<commit>/` that `hf download` and transformers write) without any
network access; only when it is not there and the Hub is not offline (`HF_HUB_OFFLINE` and
`TRANSFORMERS_OFFLINE` unset) is it downloaded, config, tokenizer and weights only. Every failure is
one line (a `ModelLoadError`) saying where polo looked and what to do.

After a run, `model_card` writes the README.md of the final model (recipe, held-out accuracy before
and after, how to load it) and `push_folder` uploads that directory to a Hub repository.
"""

from __future__ import annotations

import os
import re
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
    """Return the local snapshot directory of Hub id `name`: from the cache, else downloaded unless the Hub is offline."""
    repo_id, revision = parse_hub_id(name) or (name, None)
    cache = hub_cache_dir()
    cached = _cached_snapshot(repo_id, revision, cache)
    if cached is not None:
        return cached
    offline = offline_setting()
    fetch = f"'hf download {repo_id}{f' --revision {revision}' if revision else ''}'"
    if offline:
        raise HubModelError(
            f"model {name!r} is not a local directory, and as a Hugging Face Hub id it is not in the local cache ({cache}) "
            f"while the Hub is offline ({offline}): fetch it on a machine with internet with {fetch} "
            "(or 'huggingface-cli download') and copy the cache here, or point the model at a local directory"
        )
    return _download(name, repo_id, revision, cache, fetch)


def _cached_snapshot(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """Return the cached snapshot of `repo_id` at `revision` when it is there with weights, without touching the network."""
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
            f"model {name!r} is not a local directory or in the local Hugging Face cache ({cache}), and downloading it "
            f"from the Hub failed ({type(error).__name__}: {reason}); check the id and your connection (a gated or private "
            f"model needs 'hf auth login'), fetch it elsewhere with {fetch} and copy the cache, or point the model at a local directory"
        ) from error
    if not has_weights(path):
        raise HubModelError(f"Hub model {name!r} has no safetensors or pytorch_model*.bin weights ({path})")
    return path


# ---------------------------------------------------------------- pushing a trained model


def check_push(repo_id: str) -> None:
    """Raise `ConfigError` before a run starts when its model could not be pushed to `repo_id` at the end."""
    offline = offline_setting()
    if offline:
        raise ConfigError(
            f"output.push_to_hub={repo_id} needs the Hugging Face Hub, but it is offline ({offline}): "
            "run where the Hub can be reached, or set output.push_to_hub=null (the final model and its README.md stay in output.dir)"
        )
    from huggingface_hub import get_token

    if not get_token():
        raise ConfigError(
            f"output.push_to_hub={repo_id} needs a Hugging Face token with write access: "
            "run 'hf auth login' or set HF_TOKEN, or set output.push_to_hub=null"
        )


def push_folder(folder: Path, repo_id: str, private: bool, message: str) -> str:
    """Create `repo_id` if needed (private when asked) and upload `folder` to it, checkpoint state left out; return its URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    api.upload_folder(
        repo_id=repo_id, folder_path=str(folder), repo_type="model", commit_message=message, ignore_patterns=NOT_PUSHED
    )
    return str(url)


def model_card(
    *,
    location: str,
    base_model: str,
    algorithm: str,
    task: str,
    steps: int,
    recipe: str,
    eval_before: dict | None,
    eval_after: dict | None,
    num_eval: int,
    adapter: bool = False,
) -> str:
    """Return the README.md of a trained model: Hub metadata, what it is, held-out accuracy, how to load it, the recipe.

    `location` is what loads it (a Hub repo id or a directory); `recipe` is the run's config.yaml text.
    The metadata names `base_model` only when it is a Hub id (the Hub refuses other values).
    """
    base = parse_hub_id(base_model)
    tags = ["polo", algorithm.lower(), "reinforcement-learning"] + (["lora", "peft"] if adapter else [])
    metadata = {"library_name": "polo", "pipeline_tag": "text-generation", "tags": list(dict.fromkeys(tags))}
    if base is not None:
        metadata["base_model"] = base[0]
    title = (
        location.split("/")[-1]
        if is_hub_id(location)
        else f"{base_model.rstrip('/').split('/')[-1]}: {algorithm} on {task}"
    )
    lines = ["---", yaml.safe_dump(metadata, sort_keys=False).strip(), "---", "", f"# {title}", ""]
    kind = "LoRA adapter for" if adapter else "fine-tune of"
    lines += [f"A {kind} `{base_model}`, trained with polo's {algorithm} for {steps} steps on the `{task}` task.", ""]
    lines += _accuracy_table(eval_before, eval_after, num_eval)
    lines += ["## Loading", "", "```python"]
    if adapter:
        lines += [
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{location}").merge_and_unload()',
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{location}")',
        ]
    lines += [
        f'tokenizer = AutoTokenizer.from_pretrained("{location}")',
        "```",
        "",
        f"With polo, save the recipe below as `recipe.yaml` and run `polo eval --model {location} --recipe recipe.yaml`.",
        "",
    ]
    lines += [
        "## Recipe",
        "",
        "The run's `config.yaml` (`polo train config.yaml` repeats it):",
        "",
        "```yaml",
        recipe.strip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _accuracy_table(eval_before: dict | None, eval_after: dict | None, num_eval: int) -> list[str]:
    """Return the card's held-out section: greedy accuracy before and after training (or a line saying there was none)."""
    if eval_before is None and eval_after is None:
        return [
            "No held-out evaluation was run (eval.before and eval.after were off, or the task has no held-out rows).",
            "",
        ]

    def cell(result: dict | None) -> str:
        return "not measured" if result is None else f"{result['accuracy']:.3f}"

    return [
        "## Held-out accuracy",
        "",
        f"Greedy decoding on {num_eval} held-out problems:",
        "",
        "| | accuracy |",
        "|---|---|",
        f"| before training | {cell(eval_before)} |",
        f"| after training | {cell(eval_after)} |",
        "",
    ]
