"""One rank of the data-parallel tests, started by `torchrun` from test_data_parallel.py.

update  BATCH CONFIGS OUT   one `rl_step` per config on this rank's share of a saved batch;
                            rank 0 saves the updated weights to OUT/<name>.pt
train   CONFIG [--interrupt-at N]   `polo.rl.train.train` on a JSON config; with
                            --interrupt-at, rank 0 receives Ctrl-C during step N
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import torch


def rank_share_batch(batch, group_size: int):
    from polo.rl.batching import Batch
    from polo.runtime import parallel

    groups = len(batch.rollouts) // group_size
    mine = parallel.rank_share(list(range(groups)), "groups")
    rows = torch.tensor([group * group_size + member for group in mine for member in range(group_size)])
    return Batch(batch.rollouts.select(rows), batch.rewards[rows], [batch.prompts[group] for group in mine])


def one_update(batch, config_dict: dict, model_dir: str):
    """Return the weights after one `rl_step` over `batch` (this rank's share of it under torchrun)."""
    from polo.config import load_config
    from polo.models.loading import frozen_copy, load_policy
    from polo.rl import step as rl_step_module
    from polo.rl.critic import build_critic
    from polo.rl.setup import Run, optimizer_steps
    from polo.rl.update import update_modules
    from polo.runtime import parallel
    from polo.runtime.device import CPU

    config = load_config(config_dict)
    torch.manual_seed(0)
    model, tokenizer = load_policy(model_dir)
    model.train()
    reference = frozen_copy(model) if config.algorithm.beta > 0 else None
    if config.train.data_parallel == "fsdp" and parallel.is_distributed():
        parallel.shard_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.learning_rate)
    critic = build_critic(config, model, optimizer, optimizer_steps(config))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    modules = update_modules(model, critic)
    run = Run(
        config=config,
        compute=CPU,
        task=None,
        reward_set=SimpleNamespace(weights={}),  # the batch comes scored: no reward function is called
        instruction="",
        model=model,
        tokenizer=tokenizer,
        reference=reference,
        optimizer=optimizer,
        scheduler=scheduler,
        critic=critic,
        modules=modules,
        masters=None,
        checkpointer=None,
        output_dir=None,
    )
    share = rank_share_batch(batch, config.algorithm.group_size)
    original = rl_step_module.collect_batch
    sampled = rl_step_module.SampledStep(share, {"reward/mean": float(share.rewards.mean())}, [])
    rl_step_module.collect_batch = lambda *args, **kwargs: sampled
    try:
        metrics = rl_step_module.rl_step(run, 1).metrics
    finally:
        rl_step_module.collect_batch = original
    model_state, _ = parallel.full_state_dicts(model, optimizer)  # gathered whole under FSDP
    weights = {name: value.detach().clone() for name, value in (model_state or model.state_dict()).items()}
    if critic is not None:
        weights.update({f"critic.{name}": value.detach().clone() for name, value in critic.module.state_dict().items()})
    return weights, metrics


def main(argv: list[str]) -> None:
    from polo.runtime import parallel

    mode = argv[0]
    if mode == "update":
        batch_path, configs_path, out_dir, model_dir = argv[1:5]
        parallel.init_from_environment()
        batch = torch.load(batch_path, weights_only=False)
        for name, config_dict in json.loads(Path(configs_path).read_text()).items():
            weights, metrics = one_update(batch, config_dict, model_dir)
            if parallel.rank() == 0:
                torch.save({"weights": weights, "metrics": metrics}, f"{out_dir}/{name}.pt")
        parallel.leave_process_group(finished=True)
    elif mode == "train":
        from polo.rl import train as trainer

        config = json.loads(Path(argv[1]).read_text())
        if "--interrupt-at" in argv:
            interrupt_at, calls, real_step = int(argv[argv.index("--interrupt-at") + 1]), [], trainer.rl_step

            def interrupt(*args, **kwargs):
                calls.append(1)
                if len(calls) == interrupt_at and parallel.rank() == 0:
                    signal.raise_signal(signal.SIGINT)  # Ctrl-C reaches one rank only
                return real_step(*args, **kwargs)

            trainer.rl_step = interrupt
        try:
            trainer.train(config)
        except KeyboardInterrupt:
            sys.exit(130)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
