"""What a resume checks from files alone: a checkpoint's integrity, and the keys a recipe may not change."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import save_file

from polo.runtime.resume import (
    CHANGES_FILE,
    Change,
    ResumeRefusedError,
    changed_keys,
    check_changes,
    checkpoint_problem,
    forget_changes_from,
    newest_intact,
    recipe_text,
    record_changes,
    safetensors_problem,
    started_recipe,
)


def write_checkpoint(directory, step: int, shards: int = 1):
    """Write a small checkpoint step-N (weights, optimizer state) under `directory`; return its path."""
    checkpoint = directory / f"step-{step:06d}"
    checkpoint.mkdir(parents=True)
    tensors = {f"layer{index}.weight": torch.full((16, 16), float(index)) for index in range(4)}
    if shards == 1:
        save_file(tensors, str(checkpoint / "model.safetensors"))
    else:
        names = list(tensors)
        weight_map = {}
        for shard in range(shards):
            file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
            part = {name: tensors[name] for name in names[shard::shards]}
            save_file(part, str(checkpoint / file))
            weight_map.update(dict.fromkeys(part, file))
        (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.save({"step": step, "optimizer": {"state": torch.zeros(1000)}}, checkpoint / "trainer_state.pt")
    return checkpoint


def truncate(path, keep: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(keep)


def test_an_intact_checkpoint_has_no_problem_sharded_or_not(tmp_path):
    assert checkpoint_problem(write_checkpoint(tmp_path, 2)) is None
    assert checkpoint_problem(write_checkpoint(tmp_path, 4, shards=2)) is None


def test_a_truncated_safetensors_file_is_named_with_its_size_and_the_size_its_header_describes(tmp_path):
    checkpoint = write_checkpoint(tmp_path, 2)
    weights = checkpoint / "model.safetensors"
    whole = weights.stat().st_size
    truncate(weights, whole - 100)
    assert checkpoint_problem(checkpoint) == f"model.safetensors is truncated ({whole - 100:,} of {whole:,} bytes)"
    truncate(weights, 5)
    assert safetensors_problem(weights) == "model.safetensors is truncated (5 bytes, not even a header)"
    truncate(weights, 40)  # the header length is there, the header is not
    assert safetensors_problem(weights).startswith("model.safetensors is truncated (40 bytes, its header alone needs ")


def test_bytes_past_the_header_s_last_tensor_are_named(tmp_path):
    weights = write_checkpoint(tmp_path, 2) / "model.safetensors"
    with open(weights, "ab") as handle:
        handle.write(b"\0" * 7)
    assert safetensors_problem(weights) == "model.safetensors has 7 bytes more than its header describes"


def test_a_missing_or_truncated_trainer_state_and_a_missing_shard_are_named(tmp_path):
    missing = write_checkpoint(tmp_path, 2)
    (missing / "trainer_state.pt").unlink()
    assert checkpoint_problem(missing) == "trainer_state.pt is missing"

    truncated = write_checkpoint(tmp_path, 4)
    truncate(truncated / "trainer_state.pt", (truncated / "trainer_state.pt").stat().st_size // 2)
    assert checkpoint_problem(truncated).startswith("trainer_state.pt cannot be read (RuntimeError: ")

    sharded = write_checkpoint(tmp_path, 6, shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    assert (
        checkpoint_problem(sharded)
        == "model-00002-of-00002.safetensors is missing (named in model.safetensors.index.json)"
    )

    no_weights = write_checkpoint(tmp_path, 8)
    (no_weights / "model.safetensors").unlink()
    assert checkpoint_problem(no_weights) == "it holds no weights (no .safetensors file)"


def test_the_newest_intact_checkpoint_is_found_past_the_damaged_ones_newest_first(tmp_path):
    write_checkpoint(tmp_path, 2)
    intact = write_checkpoint(tmp_path, 10)  # step 10 sorts before step 9 as text, not as a step
    (write_checkpoint(tmp_path, 12) / "trainer_state.pt").unlink()
    truncate(write_checkpoint(tmp_path, 100) / "model.safetensors", 100)
    found, damaged = newest_intact(tmp_path)
    assert found == intact
    assert [(item.checkpoint.name, item.problem.split(" ")[0]) for item in damaged] == [
        ("step-000100", "model.safetensors"),
        ("step-000012", "trainer_state.pt"),
    ]
    assert newest_intact(tmp_path / "none") == (None, [])


RUN = {
    "model": {"name": "models/a"},
    "algorithm": {"name": "grpo", "group_size": 4},
    "task": {"name": "arithmetic", "train_path": None},
    "train": {"learning_rate": 0.001},
}
KEYS = ("model.name", "algorithm.group_size", "task.name", "task.train_path", "task.seed")


def changed(**values) -> dict:
    """Return RUN with dotted keys set to `values` (a `__` in a name stands for a dot)."""
    recipe = json.loads(json.dumps(RUN))
    for dotted, value in values.items():
        section, key = dotted.split("__")
        recipe[section][key] = value
    return recipe


def test_only_the_listed_keys_are_compared_and_a_key_the_saved_recipe_lacks_is_skipped():
    current = changed(algorithm__group_size=8, train__learning_rate=0.1, task__seed=5)
    assert changed_keys(RUN, current, KEYS) == [Change("algorithm.group_size", 4, 8)]


def test_a_refused_change_is_one_line_naming_each_key_and_both_values():
    changes = changed_keys(RUN, changed(model__name="models/b", algorithm__group_size=8), KEYS)
    with pytest.raises(ResumeRefusedError) as error:
        check_changes(changes, ["algorithm.group_size"], "run/checkpoints/step-000004", "output.allow_changes")
    message = str(error.value)
    assert message == (
        "cannot resume from run/checkpoints/step-000004: the recipe changes what the run means (model.name was "
        "'models/a' in the run, 'models/b' here); set it back, or say the change is meant with "
        "output.allow_changes=[model.name] (it is recorded in config_changes.jsonl)"
    )
    assert check_changes(changes, ["model.name", "algorithm.group_size"], "x", "output.allow_changes") == changes


def test_config_yaml_keeps_the_starting_values_and_says_when_each_change_took_effect(tmp_path):
    record_changes(tmp_path, 4, [Change("algorithm.group_size", 4, 8)])
    record_changes(tmp_path, 6, [Change("algorithm.group_size", 8, 2), Change("model.name", "models/a", "models/b")])
    current = changed(algorithm__group_size=2, model__name="models/b")
    started, comments = started_recipe(current, tmp_path)
    assert started == RUN
    assert comments.splitlines() == [
        f"# after step 4 the run went on with algorithm.group_size: 8 (was 4; {CHANGES_FILE})",
        f"# after step 6 the run went on with algorithm.group_size: 2 (was 8; {CHANGES_FILE})",
        f"# after step 6 the run went on with model.name: 'models/b' (was 'models/a'; {CHANGES_FILE})",
    ]
    assert yaml.safe_load(recipe_text(current, tmp_path)) == RUN
    assert current["algorithm"]["group_size"] == 2  # the caller's recipe is not touched

    forget_changes_from(tmp_path, 6)  # a resume from step 6 re-does steps 7 on: the changes made there are void
    assert [row["step"] for row in map(json.loads, (tmp_path / CHANGES_FILE).read_text().splitlines())] == [4]
    assert started_recipe(current, tmp_path)[0]["model"]["name"] == "models/b"  # no longer a change: as given


def test_checking_reads_no_weights_and_maps_the_trainer_state_instead_of_reading_it(tmp_path, monkeypatch):
    import safetensors
    import safetensors.torch

    checkpoint = write_checkpoint(tmp_path, 2)

    def no_weights(*args, **kwargs):
        raise AssertionError("a weights file was loaded")

    for module, name in ((safetensors.torch, "load_file"), (safetensors.torch, "load"), (safetensors, "safe_open")):
        monkeypatch.setattr(module, name, no_weights)
    real_load, calls = torch.load, []

    def recording_load(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    assert checkpoint_problem(checkpoint) is None
    assert [call.get("mmap") for call in calls] == [True]
