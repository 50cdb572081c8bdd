"""Checkpoints are device-free: everything loads onto the CPU, and RNG states are kept per device."""

from __future__ import annotations

import json
import random
import signal

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from polo.runtime.checkpoint import load_trainer_state
from polo.runtime.seeding import restore_rng, rng_state, seed_everything

TIME_KEYS = ("time/", "tokens_per_second", "update_tokens_per_second", "timestamp")


def fake_cuda_states(devices: int = 2) -> list[torch.Tensor]:
    """Return what `torch.cuda.get_rng_state_all()` gives on a machine with `devices` GPUs (Philox seed, offset)."""
    return [torch.arange(16, dtype=torch.uint8) + index for index in range(devices)]


def draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()


def test_rng_state_round_trips_on_the_cpu_and_has_no_cuda_entry_without_cuda():
    seed_everything(5)
    state = rng_state()
    if not torch.cuda.is_available():
        assert "cuda" not in state  # a CPU run never touches (or initialises) CUDA
    expected = draws()
    restore_rng(state)
    assert draws() == expected


def test_a_state_written_on_a_gpu_machine_restores_on_the_cpu():
    seed_everything(6)
    state = {**rng_state(), "cuda": fake_cuda_states()}
    expected = draws()
    restore_rng(state)  # the CUDA entry is skipped where there is no CUDA; the rest is restored
    assert draws() == expected


def tiny_run_config(model_dir, output_dir) -> dict:
    return {
        "model": {"name": str(model_dir)},
        "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1, "num_train": 40, "num_eval": 0},
        "rewards": {"correct": 1.0},
        "sampling": {"max_new_tokens": 6, "temperature": 1.0},
        "algorithm": {"group_size": 4, "beta": 0.1},
        "train": {
            "steps": 4,
            "prompts_per_step": 2,
            "micro_batch_size": 4,
            "learning_rate": 1e-3,
            "precision": "fp32",
            "seed": 3,
        },
        "eval": {"before": False, "after": False},
        "output": {"dir": str(output_dir), "save_every": 3, "progress": False, "report_to": [], "plots": False},
    }


def add_fake_cuda_rng(checkpoint) -> None:
    """Rewrite a checkpoint's trainer state as a GPU run would have written it: a CUDA RNG state beside each CPU one."""
    path = checkpoint / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    state["rng"]["cuda"] = fake_cuda_states()
    for rank_state in state["rng_per_rank"]:
        rank_state["cuda"] = fake_cuda_states()
    torch.save(state, path)


def test_load_trainer_state_maps_every_tensor_to_the_cpu(tmp_path, monkeypatch):
    torch.save({"step": 3, "rng": {"cuda": fake_cuda_states()}}, tmp_path / "trainer_state.pt")
    seen = {}
    real_load = torch.load

    def recording_load(*args, **kwargs):
        seen.update(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    state = load_trainer_state(tmp_path)
    assert seen["map_location"] == "cpu"  # a CUDA tensor in it would otherwise need a GPU to load
    assert state["step"] == 3 and all(tensor.device.type == "cpu" for tensor in state["rng"]["cuda"])


def test_a_checkpoint_with_a_cuda_rng_state_resumes_on_the_cpu_like_an_uninterrupted_run(
    tiny_model_dir, tmp_path, monkeypatch
):
    from polo.rl import train as trainer

    straight = trainer.train(tiny_run_config(tiny_model_dir, tmp_path / "straight"))
    real_step, calls = trainer.rl_step, []

    def interrupt_on_third_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
        return real_step(*args, **kwargs)

    config = tiny_run_config(tiny_model_dir, tmp_path / "resumed")
    monkeypatch.setattr(trainer, "rl_step", interrupt_on_third_step)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(config)
    monkeypatch.setattr(trainer, "rl_step", real_step)
    add_fake_cuda_rng(tmp_path / "resumed" / "checkpoints" / "step-000003")
    resumed = trainer.train(config, ["output.resume=true"])

    def timeless(rows):
        return [{key: value for key, value in row.items() if not key.startswith(TIME_KEYS)} for row in rows]

    assert timeless(resumed.metrics) == timeless(straight.metrics)
    final = [
        load_file(str(run / "checkpoints" / "step-000004" / "model.safetensors"))
        for run in (tmp_path / "straight", tmp_path / "resumed")
    ]
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])
    assert json.loads((tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4


@pytest.mark.parametrize(
    "message",
    [
        "[enforce fail at inline_container.cc:672] . unexpected pos 4352 vs 4246",  # torch's zip writer, disk full
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })',
    ],
)
def test_a_write_that_fails_in_torch_or_safetensors_is_one_save_error_and_keeps_the_target(tmp_path, message):
    from polo.runtime.checkpoint import SaveError, staged_directory

    target = tmp_path / "step-000010"
    target.mkdir()
    (target / "model.safetensors").write_text("the earlier, whole copy")
    staged = staged_directory(target, "checkpoint step 10", "step 5 is intact")
    with pytest.raises(SaveError) as error, staged as staging:
        (staging / "half").write_text("x")
        raise RuntimeError(message)
    assert str(error.value).startswith(f"could not write checkpoint step 10 to {target}: RuntimeError: {message}")
    assert "free space there" in str(error.value) and str(error.value).endswith("; step 5 is intact")
    assert (target / "model.safetensors").read_text() == "the earlier, whole copy"
    assert list(tmp_path.iterdir()) == [target]  # the staging directory is gone


def test_an_error_that_is_not_a_failed_write_passes_through_unchanged(tmp_path):
    from polo.runtime.checkpoint import staged_directory

    with (
        pytest.raises(RuntimeError, match="^size mismatch for lm_head.weight$"),
        staged_directory(tmp_path / "final", "model"),
    ):
        raise RuntimeError("size mismatch for lm_head.weight")
    assert not list(tmp_path.iterdir())
