"""Held-out evaluation: greedy accuracy of a policy on a task's evaluation rows."""

from __future__ import annotations

import torch

from polo.lm.rollout import generate, stop_token_ids, tokenize_prompts


@torch.no_grad()
def greedy_accuracy(
    model,
    tokenizer,
    prompts: list[str],
    rows: list[dict],
    correctness,
    *,
    max_new_tokens: int,
    batch_size: int = 64,
    precision: str = "fp32",
) -> dict:
    """Return `{"accuracy", "completion_length", "truncated", "samples"}` for greedy decoding.

    `correctness(completion, row) -> float` is the task's checker; accuracy is the mean of it
    over `rows`. "samples" keeps the first few (prompt, completion, score) triples for reports.
    """
    if len(prompts) != len(rows):
        raise ValueError(f"got {len(prompts)} prompts for {len(rows)} rows")
    scores, lengths, truncated, samples = [], [], [], []
    stop_ids = stop_token_ids(tokenizer, model)
    for start in range(0, len(prompts), batch_size):
        batch_prompts = prompts[start : start + batch_size]
        prompt_ids, prompt_mask = tokenize_prompts(tokenizer, batch_prompts)
        completion_ids, completion_mask, batch_truncated = generate(
            model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            top_p=1.0,
            stop_ids=stop_ids,
            pad_id=tokenizer.pad_token_id,
            precision=precision,
        )
        texts = tokenizer.batch_decode(
            completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id), skip_special_tokens=True
        )
        for offset, text in enumerate(texts):
            row = rows[start + offset]
            score = float(correctness(text, row))
            scores.append(score)
            if len(samples) < 8:
                samples.append({"question": row.get("question"), "answer": row.get("answer"), "completion": text, "score": score})
        lengths.extend(completion_mask.sum(-1).tolist())
        truncated.extend(batch_truncated.tolist())
    count = max(len(scores), 1)
    return {
        "accuracy": sum(scores) / count,
        "completion_length": sum(lengths) / count,
        "truncated": sum(truncated) / count,
        "samples": samples,
    }
