"""Every bad input the `polo` command line meets is one line on stderr and a non-zero exit, never a traceback.

Each case runs the real `polo` executable. Except for the model-directory cases, the recipe names a
model that does not exist: the error each one asserts can only come first if it is found before
any model is looked at.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

POLO = Path(sys.executable).with_name("polo")
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def polo(*args: str, cwd: Path) -> str:
    """Run `polo args...`; assert it failed with exactly one line on stderr and return that line."""
    result = subprocess.run([str(POLO), *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    lines = result.stderr.splitlines()
    assert result.returncode != 0, result.stdout + result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("polo: error: ")
    return lines[0].removeprefix("polo: error: ")


def rl_recipe(tmp_path: Path, model: str | None = None, **sections) -> Path:
    recipe = {
        "model": {"name": model or str(tmp_path / "no-model-here")},
        "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1, "num_train": 40, "num_eval": 6},
        "sampling": {"max_new_tokens": 4},
        "algorithm": {"group_size": 2},
        "train": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4, "precision": "fp32"},
        "eval": {"batch_size": 4, "before": False, "after": False},
        "output": {"dir": str(tmp_path / "run"), "progress": False, "report_to": [], "plots": False},
    }
    for section, values in sections.items():
        recipe[section].update(values)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("sampling.temperature=nan", "sampling.temperature must be a finite number > 0, got nan"),
        ("sampling.temperature=inf", "sampling.temperature must be a finite number > 0, got inf"),
        ("train.learning_rate=-1e-6", "train.learning_rate must be in [0, 1], got -1e-06"),
        ("train.learning_rate=nan", "train.learning_rate must be in [0, 1], got nan"),
        ("train.learning_rate=10", "train.learning_rate must be in [0, 1], got 10.0"),
        ("algorithm.clip_eps_low=5", "algorithm.clip_eps_low must be in [0, 1), got 5.0"),
        ("output.keep_checkpoints=0", "output.keep_checkpoints must be at least 1, got 0"),
        ("eval.batch_size=0", "eval.batch_size must be at least 1, got 0"),
    ],
)
def test_train_bad_value(tmp_path, override, expected):
    assert polo("train", str(rl_recipe(tmp_path)), override, cwd=tmp_path) == expected
    assert not (tmp_path / "run").exists()


def write_jsonl(path: Path, rows: int) -> Path:
    path.write_text("".join(f'{{"question": "{n} + 1?", "answer": "{n + 1}"}}\n' for n in range(rows)))
    return path


def jsonl_task(train: Path, held_out: Path, **options) -> dict:
    return {
        "name": "jsonl",
        "train_path": str(train),
        "eval_path": str(held_out),
        "num_train": None,
        "num_eval": None,
        **options,
    }


def test_train_misspelled_checker(tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", 3)
    recipe = rl_recipe(tmp_path, task=jsonl_task(data, data, checker="exact_nmber"))
    expected = (
        "task.checker: 'exact_nmber' is not a registered answer checker (did you mean 'exact_number'?); "
        "registered: math_verify, exact_number, exact_string (or module:name for your own)"
    )
    assert polo("train", str(recipe), cwd=tmp_path) == expected


def test_train_num_eval_beyond_the_held_out_file(tmp_path):
    train, held_out = write_jsonl(tmp_path / "train.jsonl", 8), write_jsonl(tmp_path / "held_out.jsonl", 3)
    recipe = rl_recipe(tmp_path, task=jsonl_task(train, held_out, num_eval=10))
    expected = (
        f"jsonl eval {held_out}: task.num_eval is 10 but the file holds only 3 rows; set it to at most 3, "
        "or null for every row"
    )
    assert polo("train", str(recipe), cwd=tmp_path) == expected


def test_train_jsonl_with_invalid_utf8(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", 4)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_bytes(b'{"question": "1 + 1?", "answer": "2"}\n{"question": "caf\xe9?", "answer": "3"}\n')
    line = polo("train", str(rl_recipe(tmp_path, task=jsonl_task(train, held_out))), cwd=tmp_path)
    assert line == f"{held_out} line 2: not valid UTF-8 (byte 0xe9 at byte 18 of the line); save the file as UTF-8"


def test_train_output_dir_is_a_file(tmp_path):
    afile = tmp_path / "results.txt"
    afile.write_text("keep me")
    line = polo("train", str(rl_recipe(tmp_path, output={"dir": str(afile)})), cwd=tmp_path)
    assert line == f"output.dir: {afile} is a file, not a directory; name a directory (it is made if missing)"
    assert afile.read_text() == "keep me"


def test_train_model_with_garbage_safetensors(tmp_path, tiny_model_dir):
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "garbage-model"))
    (model_dir / "model.safetensors").write_bytes(b"\x00\xff" * 512)
    line = polo("train", str(rl_recipe(tmp_path, model=str(model_dir))), cwd=tmp_path)
    assert line.startswith(f"model weights {model_dir / 'model.safetensors'} cannot be read (")
    assert line.endswith("the file is damaged or incomplete")


def test_plot_missing_directory(tmp_path):
    assert (
        polo("plot", str(tmp_path / "nowhere"), cwd=tmp_path) == f"run directory {tmp_path / 'nowhere'} does not exist"
    )


def test_plot_directory_that_is_not_a_run(tmp_path):
    line = polo("plot", str(tmp_path), cwd=tmp_path)
    assert line == f"{tmp_path} has no metrics.jsonl: not a polo run directory, or the run logged nothing yet"


def test_sft_bad_learning_rate(tmp_path):
    data = tmp_path / "demos.jsonl"
    data.write_text('{"prompt": "1 + 1?", "response": "2"}\n')
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"name": str(tmp_path / "no-model-here")},
                "data": {"train_path": str(data)},
                "output": {"dir": str(tmp_path / "out")},
            }
        )
    )
    assert (
        polo("sft", str(recipe), "train.learning_rate=nan", cwd=tmp_path)
        == "train.learning_rate must be in [0, 1], got nan"
    )


def test_control_bad_learning_rate(tmp_path):
    line = polo(
        "control",
        str(RECIPES / "ppo_cartpole.yaml"),
        "train.learning_rate=-3e-4",
        f"output.dir={tmp_path / 'out'}",
        cwd=tmp_path,
    )
    assert line == "train.learning_rate must be in [0, 1], got -0.0003"


def test_eval_misspelled_checker(tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", 2)
    line = polo(
        "eval",
        "--task",
        f"jsonl:{data}",
        "--checker",
        "exact_nmber",
        "--model",
        str(tmp_path / "no-model-here"),
        cwd=tmp_path,
    )
    assert line.startswith(
        "task.checker: 'exact_nmber' is not a registered answer checker (did you mean 'exact_number'?)"
    )


def test_eval_nan_temperature(tmp_path):
    line = polo("eval", "--temperature", "nan", "--model", str(tmp_path / "no-model-here"), cwd=tmp_path)
    assert line == "temperature must be a finite number >= 0, got nan"
