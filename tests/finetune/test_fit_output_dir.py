"""polo sft, rm and dpo share `prepare_run`: a second run into a directory holding an earlier one is refused unasked."""

from __future__ import annotations

import hashlib

import yaml
from test_sft import tiny_recipe

from polo.cli import main
from polo.finetune.sft import sft
from polo.models import loading


def snapshot(directory):
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def test_a_second_sft_run_into_the_same_dir_is_refused_before_the_model_loads_unless_overwrite(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    recipe = tiny_recipe(tiny_model_dir, tmp_path, train={"max_steps": 1})
    sft(recipe)
    before = snapshot(tmp_path / "run")
    assert "final/model.safetensors" in before and "metrics.jsonl" in before
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    capsys.readouterr()  # the first run's own output

    real_load = loading.load_policy
    monkeypatch.setattr(
        loading, "load_policy", lambda *args, **kwargs: (_ for _ in ()).throw(AssertionError("the model was loaded"))
    )
    assert main(["sft", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"polo: error: output.dir {tmp_path / 'run'} already holds a run "
        "(final/, metrics.jsonl, config.yaml, summary.json): "
        "replace it with output.overwrite=true, or pick a new output.dir"
    )
    assert snapshot(tmp_path / "run") == before

    monkeypatch.setattr(loading, "load_policy", real_load)
    assert main(["sft", str(path), "output.overwrite=true"]) == 0
    assert (
        f"polo: output.overwrite=true: removed the earlier run in {tmp_path / 'run'} "
        "(final/, metrics.jsonl, config.yaml, summary.json)" in capsys.readouterr().out
    )
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
