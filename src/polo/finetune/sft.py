"""Supervised fine-tuning (`polo sft`): learn the responses of demonstrations, never their prompts.

For demonstrations (x, y) with y = (y_1 .. y_T, EOS), the loss is the token-mean negative
log-likelihood of the response tokens over the whole optimizer batch B:

    L = − Σ_{(x,y)∈B} Σ_t log π(y_t | x, y_<t)  /  Σ_{(x,y)∈B} |y|

The prompt x is the chat template of the conversation with the assistant turn opened, exactly
the text an RL run gives the policy; its tokens carry label −100 (`TokenBatch.labels`) and
contribute nothing. The result is saved with `save_pretrained` to `<output.dir>/final`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from polo.config import config_to_dict
from polo.config.finetune import SFTConfig, load_sft_config
from polo.data.preferences import Demonstration, read_demonstrations
from polo.finetune.fit import (
    Example,
    FinetuneResult,
    collate,
    encode,
    encode_splits,
    evaluate_objective,
    finetune_run,
    finish_run,
    fit,
    prepare_model,
    prepare_run,
    response_logprobs,
    save_model,
)
from polo.generation.prompts import render_prompt
from polo.models.hub import HeldOut
from polo.runtime.device import CPU


def encode_demonstrations(
    tokenizer, demonstrations: Sequence[Demonstration], system_prompt: str | None, max_length: int
) -> list[Example]:
    """Return one single-sequence `Example` per demonstration (chat-templated prompt, response + EOS)."""
    prompts = [render_prompt(tokenizer, demo.messages, system_prompt) for demo in demonstrations]
    encoded = encode(tokenizer, prompts, [demo.response for demo in demonstrations], max_length)
    return [Example((item,)) for item in encoded]


class SFTObjective:
    """Negative log-likelihood of the response tokens; the unit is a response token."""

    def __init__(self, pad_id: int, device: torch.device = CPU.device):
        self.pad_id, self.device = pad_id, device  # batches are built on the model's device

    def units(self, example: Example) -> int:
        return len(example.sequences[0].response_ids)

    def loss(self, model, examples: Sequence[Example]) -> tuple[torch.Tensor, dict[str, float]]:
        """Return (−Σ log π over the response tokens of `examples`, {"loss": the same as a float})."""
        batch = collate([example.sequences[0] for example in examples], self.pad_id, self.device)
        logprobs = response_logprobs(model, batch)
        nll = -torch.where(batch.response_mask.bool(), logprobs, 0.0).sum()
        return nll, {"loss": float(nll.detach())}


def sft(config: SFTConfig | str | Path | dict | None = None, overrides: list[str] | None = None) -> FinetuneResult:
    """Fine-tune a causal LM on demonstrations and return the result; the model lands in `<output.dir>/final`."""
    from polo.models.loading import load_policy

    config = load_sft_config(config, overrides)
    with finetune_run(config):
        started = time.perf_counter()
        compute = prepare_run(config, config_to_dict(config))
        model, tokenizer = load_policy(config.model.name, attn_implementation=config.model.attn_implementation)
        trainee = prepare_model(model, compute, config.train.gradient_checkpointing)
        model = trainee.model
        data = config.data
        train_examples, eval_examples = encode_splits(tokenizer, data, read_demonstrations, encode_demonstrations)
        objective = SFTObjective(tokenizer.pad_token_id, compute.device)
        evaluate = (
            (lambda: evaluate_objective(model, eval_examples, objective, config.train.micro_batch_size, compute))
            if eval_examples
            else None
        )
        rows, before, after = fit(trainee, train_examples, objective, config, evaluate=evaluate, name="polo sft")
        output_dir = Path(config.output.dir)
        model_dir = save_model(trainee, tokenizer, output_dir / "final")
        description = f"Negative log-likelihood per response token on {len(eval_examples)} held-out demonstrations"
        return finish_run(config, model_dir, rows, "sft", HeldOut(description, ("loss",), before, after), started)
