"""Sampling a finished stage's model many times per prompt, as cheaply as the RL stage samples it.

`polo eval`'s `sample_completions` gives every sample its own row and its own prompt pass; here a
prompt's K samples are one group of the KV-cache sampler (`polo.generation.cpu_sampler.rollout`):
one prefill shared by the K rows, the way GRPO samples a group. The model is loaded in bf16 where
the CPU has bf16 (as the RL stage's weights are under `bf16_master`) and runs polo's attention,
so the stage-end evaluation and rejection sampling cost what RL sampling costs. The result has
`sample_completions`' form, so `polo.evaluation.evaluate` scores it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from polo.evaluation.evaluate import answer_key_for, default_ks, score_problem, summarize
from polo.generation.cpu_sampler import rollout
from polo.models.family import encode_prompts


def load_sampling_model(name: str, precision: str) -> tuple:
    """Return `(model, tokenizer)` ready to sample: weights in bf16 when `precision` is bf16, polo's attention, eval mode."""
    from polo.kernels.cpu.attention import use_polo_attention
    from polo.models.loading import load_policy

    model, tokenizer = load_policy(name, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    model.eval()
    use_polo_attention(model)
    return model, tokenizer


@torch.no_grad()
def grouped_completions(
    model, tokenizer, prompts: list[str], samples_per_prompt: int, *, max_new_tokens: int, temperature: float,
    top_p: float = 1.0, batch_size: int = 64, precision: str = "fp32", progress: bool = False,
) -> list[list[dict]]:
    """Return, per prompt, `samples_per_prompt` dicts `{"text", "length", "truncated"}` (as `sample_completions`).

    Prompts go shortest first, `batch_size // samples_per_prompt` of them (at least one) at a time,
    each sampled as one group.
    """
    if samples_per_prompt < 1 or batch_size < 1:
        raise ValueError(f"samples_per_prompt and batch_size must be >= 1, got {samples_per_prompt} and {batch_size}")
    from tqdm.auto import tqdm

    lengths = [len(ids) for ids in encode_prompts(tokenizer, prompts)]
    order = sorted(range(len(prompts)), key=lambda index: lengths[index])
    per_batch = max(1, batch_size // samples_per_prompt)
    results: list[list[dict]] = [[] for _ in prompts]
    with tqdm(total=len(prompts) * samples_per_prompt, desc="polo pipeline", unit="sample", disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(order), per_batch):
            chunk = order[start : start + per_batch]
            sampled = rollout(
                model, tokenizer, [prompts[index] for index in chunk], samples_per_prompt,
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, precision=precision,
            )
            counts, cut = sampled.completion_mask.sum(-1).tolist(), sampled.truncated.tolist()
            for row, text in enumerate(sampled.texts):
                results[chunk[row // samples_per_prompt]].append({"text": text, "length": int(counts[row]), "truncated": bool(cut[row])})
            bar.update(len(sampled.texts))
    return results


def evaluate_grouped(
    model, tokenizer, prompts: list[str], rows: list[dict], correctness: Callable[[str, dict], float], *, samples: int,
    max_new_tokens: int, temperature: float, top_p: float = 1.0, batch_size: int = 64, precision: str = "fp32", progress: bool = False,
) -> dict:
    """Return `{"summary", "problems"}` as `polo.evaluation.evaluate.evaluate_policy` does, sampling prompt by prompt in groups."""
    completions = grouped_completions(
        model, tokenizer, prompts, samples, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        batch_size=batch_size, precision=precision, progress=progress,
    )
    answer_key, ks = answer_key_for(correctness), default_ks(samples)
    problems = [score_problem(row, done, correctness, answer_key, ks) for row, done in zip(rows, completions)]
    for prompt, problem in zip(prompts, problems):
        problem["prompt"] = prompt
    return {"summary": summarize(problems), "problems": problems}
