"""The one optimizer builder: every command's `train` section is an OptimizerConfig built the same way."""

from __future__ import annotations

import pytest
import torch

from polo.config import load_config
from polo.config.finetune import load_dpo_config, load_sft_config
from polo.control.config import load_control_config
from polo.runtime.optimizer import build_optimizer, build_schedule


def parameter(seed: int = 0) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize(
    ("loader", "overrides", "expected"),
    [
        (load_config, [], {"lr": 1e-6, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0}),
        (load_sft_config, ["data.train_path=x.jsonl"], {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8}),
        (load_dpo_config, ["data.train_path=x.jsonl", "train.adam_eps=1e-6"], {"lr": 5e-7, "eps": 1e-6}),
        (load_control_config, ["train.weight_decay=0.01"], {"lr": 3e-4, "eps": 1e-5, "weight_decay": 0.01}),
    ],
)
def test_every_commands_train_section_builds_the_same_fused_adamw(loader, overrides, expected):
    settings = loader(None, overrides).train
    optimizer = build_optimizer([parameter()], settings)
    (group,) = optimizer.param_groups
    assert isinstance(optimizer, torch.optim.AdamW) and group["fused"] is True  # a plain CPU tensor: fused
    assert {key: group[key] for key in expected} == expected
    assert group["initial_lr"] == group["lr"]
    assert build_optimizer([parameter()], settings, learning_rate=0.5).param_groups[0]["lr"] == 0.5


def test_an_fsdp_shard_gets_the_unfused_kernel():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        shard = torch.nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Shard(0)]))
        optimizer = build_optimizer([parameter(), shard], load_config().train)
        assert not optimizer.param_groups[0]["fused"]
    finally:
        dist.destroy_process_group()


def test_adamw_without_weight_decay_steps_exactly_as_control_s_former_adam():
    """`polo control` built torch's fused Adam; the shared AdamW at weight_decay 0 gives the same bits."""
    settings = load_control_config().train
    ours, theirs = parameter(), parameter()
    adamw = build_optimizer([ours], settings)
    adam = torch.optim.Adam([theirs], lr=settings.learning_rate, eps=settings.adam_eps, fused=True)
    for step in range(5):
        gradient = torch.randn(64, generator=torch.Generator().manual_seed(100 + step))
        ours.grad, theirs.grad = gradient.clone(), gradient.clone()
        adamw.step()
        adam.step()
    assert torch.equal(ours, theirs)


def test_rmsprop_keeps_a2c_s_settings():
    optimizer = build_optimizer([parameter()], load_control_config("recipes/a2c_cartpole.yaml").train, kind="rmsprop")
    (group,) = optimizer.param_groups
    assert isinstance(optimizer, torch.optim.RMSprop) and (group["lr"], group["alpha"], group["eps"]) == (
        7e-4,
        0.99,
        1e-5,
    )
    with pytest.raises(ValueError, match="'sgd' is not one of adamw, rmsprop"):
        build_optimizer([parameter()], load_control_config().train, kind="sgd")


def test_the_schedule_warms_up_then_decays_over_the_given_steps():
    settings = load_sft_config(None, ["data.train_path=x.jsonl", "train.warmup_steps=3"]).train  # linear
    optimizer = build_optimizer([parameter()], settings)
    schedule = build_schedule(optimizer, settings, total_steps=10)
    rates = []
    for _ in range(11):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[:4] == pytest.approx([2.5e-6, 5e-6, 7.5e-6, 1e-5]) and rates[10] == 0.0
    assert rates[6] == pytest.approx(1e-5 * 4 / 7)


def test_control_learning_rate_follows_the_same_schedule_over_environment_steps():
    from polo.control.base import OnPolicyAlgorithm

    config = load_control_config(None, ["train.lr_schedule=linear", "train.total_steps=1000"])
    algorithm = OnPolicyAlgorithm.__new__(OnPolicyAlgorithm)
    algorithm.train = config.train
    optimizer = algorithm.make_optimizer(parameter(), 1e-3)
    for env_steps in (0, 250, 999, 1000):
        progress = env_steps / 1000
        assert algorithm.set_learning_rates([optimizer], progress) == 1e-3 * max(1.0 - progress, 0.0)  # as before
    config = load_control_config(None, ["train.warmup_steps=100", "train.total_steps=1000"])
    algorithm.train = config.train
    assert algorithm.set_learning_rates([optimizer], 49 / 1000) == pytest.approx(1e-3 * 50 / 101)
