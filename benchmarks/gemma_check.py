"""Gemma 3 270M (base) on polo's own paths, checked against transformers on the real model.

    .venv/bin/python benchmarks/gemma_check.py          # fetches and converts gemma3-270m once

1. BOS: held-out greedy accuracy with the BOS polo puts in front (polo.models.family) and without
   it (how polo tokenized prompts before), on recipes/gemma_arith.yaml's few-shot prompts and on the
   demo's job (recipes/grpo_arith.yaml: two-digit addition, the plain instruction, 32 new tokens).
2. Greedy sampling: polo's sampler (preallocated KV cache, polo's attention) against transformers'
   own `model.generate`, on the recipe's prompts and on one prompt longer than Gemma's 512-token
   sliding window, token for token.
3. Log-probs of 32 completions: the fused chunked lm_head path against the full logits (now with a
   contiguous head input), largest difference and time of each.
4. The full-logits path with a frozen bf16 head (a reference, a LoRA base): contiguous head input (now)
   against the strided slice of kept positions it used to get, on a few rows (the old way copies the
   whole 262k x 640 bf16 weight per row: at 32 rows ~10.7 GB). Memory is the largest RSS
   growth during each call, sampled every 5 ms.

The last line is (on one line; bos/no_bos: the demo job)

    gemma_check bos=<acc> no_bos=<acc> greedy_equal=<k>/<n> logprob_max_diff=<x> fallback_speedup=<x>
        fallback_memory_ratio=<x>
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def recipe_prompts(tokenizer, recipe: str):
    """Return (held-out prompts, task, max_new_tokens) of a recipe, rendered for `tokenizer`."""
    from polo.config import load_config
    from polo.data import instruction_for, make_task

    config = load_config(str(ROOT / "recipes" / recipe))
    task = make_task(config)
    max_new_tokens = config.eval.max_new_tokens or config.sampling.max_new_tokens
    return task.prompts(tokenizer, task.eval_rows, instruction_for(config, task), None), task, max_new_tokens


def greedy_accuracy(model, tokenizer, recipe: str, with_bos: bool) -> float:
    from polo.generation.grouped import GroupSampling, sample_groups
    from polo.models import family

    prompts, task, max_new_tokens = recipe_prompts(tokenizer, recipe)
    original = family.prompt_prefix_ids
    if not with_bos:
        family.prompt_prefix_ids = lambda tokenizer: ()
    try:
        greedy = GroupSampling(max_new_tokens=max_new_tokens, temperature=0.0, batch_size=50)
        samples = sample_groups(model, tokenizer, prompts, greedy)
    finally:
        family.prompt_prefix_ids = original
    return sum(task.correctness(sample[0].text, row) for sample, row in zip(samples, task.eval_rows)) / len(prompts)


def greedy_matches(model, tokenizer, prompts: list[str], new_tokens: int) -> tuple[int, int]:
    """Return (rows where polo's greedy completion equals transformers' generate, rows)."""
    from polo.generation.cpu_sampler import generate
    from polo.generation.prompts import stop_token_ids, tokenize_prompts
    from polo.generation.rollouts import Decoding
    from polo.generation.stopping import Stopping
    from polo.kernels.cpu.attention import use_polo_attention

    input_ids, mask = tokenize_prompts(tokenizer, prompts)
    stop = stop_token_ids(tokenizer, model)
    with torch.no_grad():
        reference = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stop,
        )[:, input_ids.shape[1] :].tolist()
    use_polo_attention(model)
    decoding, stopping = Decoding(new_tokens, temperature=0.0), Stopping(stop, tokenizer.pad_token_id)
    ids, completion_mask, _ = generate(model, input_ids, mask, decoding, stopping)
    equal = 0
    for row, length, expected in zip(ids.tolist(), completion_mask.sum(-1).tolist(), reference):
        cut = next((index + 1 for index, token in enumerate(expected) if token in stop), len(expected))
        equal += row[: int(length)] == expected[:cut]
    return equal, len(prompts)


def scoring_batch(model, tokenizer, prompts: list[str], rows: int, completion_len: int = 8):
    from polo.generation.cpu_sampler import rollout
    from polo.generation.rollouts import Decoding

    torch.manual_seed(0)
    sampled = rollout(model, tokenizer, prompts[: rows // 4], 4, Decoding(completion_len, temperature=1.0))
    return sampled.prompt_ids, sampled.prompt_mask, sampled.completion_ids, sampled.completion_mask


@contextlib.contextmanager
def full_logits(scoring):
    scoring.FUSED_LOGPROBS = False
    try:
        yield
    finally:
        scoring.FUSED_LOGPROBS = True


def timed(function):
    """Return (result, seconds, largest RSS growth in bytes) of `function()`, run once before to warm up."""
    function()
    start_rss = current_rss()
    peak = [start_rss]
    done = threading.Event()

    def sample():
        while not done.wait(0.005):
            peak[0] = max(peak[0], current_rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    result = function()
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    return result, seconds, max(peak[0], current_rss()) - start_rss


def current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def strided_head_forward(model, batch) -> torch.Tensor:
    """The full-logits forward as polo ran it before: the head multiplies the strided slice of kept positions."""
    from polo.models.scoring import position_ids_from_mask

    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    return model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=False,
        logits_to_keep=completion_ids.shape[1] + 1,
    ).logits


def main() -> None:
    from polo.models import scoring
    from polo.models.loading import cast_parameters, load_policy

    model, tokenizer = load_policy("gemma3-270m")
    model.eval()
    accuracy = {}
    for recipe in ("gemma_arith.yaml", "grpo_arith.yaml"):
        accuracy[recipe] = [greedy_accuracy(model, tokenizer, recipe, flag) for flag in (True, False)]
        print(
            f"1. {recipe}: held-out greedy accuracy with BOS {accuracy[recipe][0]:.3f}, "
            f"without {accuracy[recipe][1]:.3f}",
            flush=True,
        )
    prompts, _, _ = recipe_prompts(tokenizer, "gemma_arith.yaml")

    long_prompt = (
        " ".join(f"Item {index} of the list is the number {index * 7 % 100}." for index in range(60))
        + "\nThe next item is"
    )
    assert len(tokenizer(long_prompt)["input_ids"]) > model.config.sliding_window, (
        "the long prompt must exceed the window"
    )
    short_equal, short_rows = greedy_matches(model, tokenizer, prompts[:16], 12)
    long_equal, long_rows = greedy_matches(model, tokenizer, [long_prompt, prompts[0]], 24)
    equal, rows = short_equal + long_equal, short_rows + long_rows
    print(
        f"2. greedy polo == transformers generate: {short_equal}/{short_rows} short prompts, "
        f"{long_equal}/{long_rows} with a prompt past the window",
        flush=True,
    )

    batch = scoring_batch(model, tokenizer, prompts, 32)
    with torch.no_grad():
        (fused, _), fused_s, fused_mem = timed(lambda: scoring.completion_logprobs(model, *batch))
        with full_logits(scoring):
            (full, _), full_s, full_mem = timed(lambda: scoring.completion_logprobs(model, *batch))
    difference = (fused - full).abs()[batch[3].bool()].max().item()
    print(
        f"3. log-probs, 32 rows (no gradient): fused {fused_s:.2f} s +{fused_mem / 2**30:.2f} GiB, "
        f"full logits {full_s:.2f} s +{full_mem / 2**30:.2f} GiB, max |difference| {difference:.1e}",
        flush=True,
    )

    # A frozen bf16 head: the reference and a LoRA base under train.precision=bf16_master. There the
    # strided input made matmul materialise the (rows, d, V) expanded weight for a bf16 bmm.
    cast_parameters(model, torch.bfloat16).requires_grad_(False)
    small = tuple(tensor[:ROWS_BEFORE] for tensor in batch)
    with torch.no_grad(), full_logits(scoring):
        _, contiguous_s, contiguous_mem = timed(lambda: scoring.completion_logprobs(model, *small))
        _, strided_s, strided_mem = timed(lambda: strided_head_forward(model, small))
    speedup = strided_s / contiguous_s
    print(
        f"4. full logits, frozen bf16 head, {ROWS_BEFORE} rows: contiguous head input {contiguous_s:.2f} s "
        f"+{contiguous_mem / 2**30:.2f} GiB, "
        f"strided as before {strided_s:.2f} s +{strided_mem / 2**30:.2f} GiB",
        flush=True,
    )
    bos, no_bos = accuracy["grpo_arith.yaml"]
    print(
        f"gemma_check bos={bos:.3f} no_bos={no_bos:.3f} greedy_equal={equal}/{rows} logprob_max_diff={difference:.1e} "
        f"fallback_speedup={speedup:.1f} fallback_memory_ratio={strided_mem / max(contiguous_mem, 1):.1f}"
    )


ROWS_BEFORE = 4  # the strided path copies the 0.34 GB bf16 head weight once per row


if __name__ == "__main__":
    main()
