"""One rank of test_cuda_nccl.py, started by torchrun: one RL step on this rank's half of a fixed batch, on its GPU.

nccl_worker.py BATCH CONFIG OUT    rank 0 saves {"weights", "metrics"} to OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch


def main(batch_path: str, config_path: str, out_path: str) -> None:
    from cuda_helpers import GROUP_SIZE, one_step

    from polo.rl.batching import Batch
    from polo.runtime import parallel
    from polo.runtime.device import resolve_device

    device = resolve_device("cuda")  # this rank's GPU, from LOCAL_RANK
    parallel.init_from_environment(device)
    print(f"rank {parallel.rank()} on {device}, backend {torch.distributed.get_backend()}", flush=True)
    batch = torch.load(batch_path, weights_only=False)
    groups = parallel.rank_share(list(range(len(batch.rollouts) // GROUP_SIZE)), "groups")
    rows = torch.tensor([group * GROUP_SIZE + member for group in groups for member in range(GROUP_SIZE)])
    share = Batch(batch.rollouts.select(rows), batch.rewards[rows], [batch.prompts[group] for group in groups])
    monkeypatch = pytest.MonkeyPatch()
    metrics, weights = one_step(json.loads(Path(config_path).read_text()), share, monkeypatch)
    if parallel.rank() == 0:
        torch.save({"weights": weights, "metrics": metrics}, out_path)
    parallel.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
