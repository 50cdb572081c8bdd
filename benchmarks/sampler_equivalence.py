"""Greedy equivalence on the real model: the static-cache sampler (eager), the CPU KV-cache sampler, `generate`.

16 prompts (8 GSM8K test questions when ../shared/data/gsm8k is there, arithmetic otherwise, plus 8 arithmetic
ones) through the task's instruction and SmolLM2's chat template, left-padded in one batch, greedy decoding.
A prompt counts as identical when the generated tokens, through the first stop token, are the same.

Usage:
  python benchmarks/sampler_equivalence.py                 # fp32, 128 new tokens
  python benchmarks/sampler_equivalence.py --precision bf16_weights --max-new-tokens 64
The last line printed is
  sampler_equivalence prompts=16 static_vs_cpu=<n> static_vs_hf=<n> cpu_vs_hf=<n>
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

MODEL = "smollm2-135m-instruct"
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def questions() -> tuple[list[dict], object]:
    """Return 16 task rows (8 GSM8K when its files are there, the rest arithmetic) and the arithmetic task."""
    from polo.config import load_config
    from polo.data import make_task

    arithmetic = make_task(load_config({"task": {"name": "arithmetic", "answer_in_tags": True, "num_eval": 16}}))
    rows = list(arithmetic.eval_rows[:8])
    if (GSM8K / "test.jsonl").exists():
        gsm8k = make_task(
            load_config(
                {
                    "task": {
                        "name": "gsm8k",
                        "train_path": str(GSM8K / "train.jsonl"),
                        "eval_path": str(GSM8K / "test.jsonl"),
                        "num_eval": 8,
                    }
                }
            )
        )
        rows += list(gsm8k.eval_rows[:8])
    else:
        rows += list(arithmetic.eval_rows[8:16])
    return rows, arithmetic


def until_stop(row: list[int], stop: list[int]) -> list[int]:
    """Return `row` cut after its first stop token."""
    cut = next((index + 1 for index, token in enumerate(row) if token in stop), len(row))
    return row[:cut]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16_weights"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    from polo.config import load_config
    from polo.data import instruction_for
    from polo.generation import cpu_sampler, static_sampler
    from polo.generation.grouped import load_for_sampling
    from polo.generation.prompts import stop_token_ids, tokenize_prompts
    from polo.generation.rollouts import Decoding
    from polo.generation.stopping import Stopping
    from polo.runtime.device import Compute

    compute = Compute.named(args.precision)
    model, tokenizer = load_for_sampling(MODEL, compute)
    rows, task = questions()
    config = load_config({"task": {"name": "arithmetic", "answer_in_tags": True}})
    prompts = task.prompts(tokenizer, rows, instruction_for(config, task), config.task.system_prompt)
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts)
    stop, pad = stop_token_ids(tokenizer, model), tokenizer.pad_token_id
    settings = dict(
        decoding=Decoding(args.max_new_tokens, temperature=0.0, top_p=1.0),
        stopping=Stopping(stop, pad),
        compute=compute,
    )
    print(
        f"{MODEL} ({compute}): {len(prompts)} prompts, {prompt_ids.shape[1]} prompt positions, greedy, "
        f"<= {args.max_new_tokens} new tokens"
    )

    results = {}
    for name, run in (
        ("static", lambda: static_sampler.generate(model, prompt_ids, prompt_mask, **settings)),
        ("cpu", lambda: cpu_sampler.generate(model, prompt_ids, prompt_mask, **settings)),
    ):
        started = time.perf_counter()
        ids, mask, _ = run()
        results[name] = [row[: int(length)] for row, length in zip(ids.tolist(), mask.sum(-1).tolist())]
        print(f"  {name:<6} {time.perf_counter() - started:6.1f} s")
    started = time.perf_counter()
    with torch.no_grad():
        generated = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            repetition_penalty=1.0,
            eos_token_id=stop,
            pad_token_id=pad,
        )[:, prompt_ids.shape[1] :]
    results["hf"] = [until_stop(row, stop) for row in generated.tolist()]
    print(f"  {'hf':<6} {time.perf_counter() - started:6.1f} s")

    pairs = {"static_vs_cpu": ("static", "cpu"), "static_vs_hf": ("static", "hf"), "cpu_vs_hf": ("cpu", "hf")}
    counts = {
        label: sum(results[a][i] == results[b][i] for i in range(len(prompts))) for label, (a, b) in pairs.items()
    }
    for index, row in enumerate(rows):
        same = "".join("=" if results[a][index] == results[b][index] else "x" for a, b in pairs.values())
        text = tokenizer.decode(results["static"][index], skip_special_tokens=True).replace("\n", " ")
        print(
            f"  {index:2d} [{same}] {len(results['static'][index]):3d} tokens  "
            f"{row['question'][:40]!r} -> {text[:60]!r}"
        )
    print(
        f"sampler_equivalence prompts={len(prompts)} " + " ".join(f"{label}={count}" for label, count in counts.items())
    )


if __name__ == "__main__":
    main()
