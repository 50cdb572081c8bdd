"""The one all-reduce: a passthrough in one process, a true sum across ranks."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polo.core import LossNormalisers, aggregate_loss, all_reduce_sum, global_count, whiten

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [-2.0, 5.0, 0.0], [7.0, 1.0, 1.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])


def test_single_process_is_a_passthrough():
    value = torch.tensor([1.0, 2.0])
    assert all_reduce_sum(value) is value
    assert global_count(3) == 3.0
    assert global_count(torch.tensor(2)) == 2.0


def _rank_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        rows = slice(2 * rank, 2 * rank + 2)  # rank 0 holds sequences 0–1, rank 1 holds 2–3
        num_tokens = global_count(MASK[rows].sum())
        loss = aggregate_loss(VALUES[rows], MASK[rows], "token_mean", LossNormalisers(4, num_tokens, 3))
        torch.save(
            {"whitened": whiten(VALUES[rows], MASK[rows]), "num_tokens": num_tokens, "loss": loss},
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_two_ranks_see_the_global_batch(tmp_path):
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert [result["num_tokens"] for result in results] == [9.0, 9.0]
    # Whitening with the all-reduced statistics equals whitening the whole batch in one process.
    torch.testing.assert_close(torch.cat([result["whitened"] for result in results]), whiten(VALUES, MASK))
    # Per-rank losses with global normalisers add up to the single-process loss.
    single = aggregate_loss(VALUES, MASK, "token_mean", LossNormalisers(4, 9, 3))
    torch.testing.assert_close(results[0]["loss"] + results[1]["loss"], single)
