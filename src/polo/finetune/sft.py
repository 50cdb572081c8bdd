"""Supervised fine-tuning (`polo sft`): learn the responses of demonstrations, never their prompts.

For demonstrations (x, y) with y = (y_1 .. y_T, EOS), the loss is the token-mean negative
log-likelihood of the response tokens over the whole optimizer batch B:

    L = − Σ_{(x,y)∈B} Σ_t log π(y_t | x, y_<t)  /  Σ_{(x,y)∈B} |y|

The prompt x is the chat template of the conversation with the assistant turn opened, exactly
the text an RL run gives the policy; its tokens carry label −100 (`TokenBatch.labels`) and
contribute nothing. The result is saved with `save_pretrained` to `<output.dir>/final`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from polo.config.finetune import SFTConfig
from polo.config.finetune import load_sft_config as load_sft_config  # callers load the recipe from here
from polo.data.preferences import Demonstration, demonstration_from_row
from polo.finetune.fit import (
    Example,
    FinetuneResult,
    FitTrainer,
    PassedRows,
    collate,
    encode,
    encode_splits,
    finetune,
    response_logprobs,
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


class SFTTrainer(FitTrainer):
    """`polo sft`: the response tokens' negative log-likelihood on demonstrations."""

    name, method = "polo sft", "sft"

    def load(self, source: str) -> tuple[torch.nn.Module, Any]:
        from polo.models.loading import load_policy

        return load_policy(source, attn_implementation=self.config.model.attn_implementation)

    def examples(self, state: dict | None) -> tuple[list[Example], list[Example]]:
        return encode_splits(self.tokenizer, self.config.data, demonstration_from_row, encode_demonstrations, self.rows)

    def make_objective(self) -> SFTObjective:
        return SFTObjective(self.tokenizer.pad_token_id, self.compute.device)

    def held_out(self, before: dict | None, after: dict | None) -> HeldOut:
        description = f"Negative log-likelihood per response token on {len(self.eval_examples)} held-out demonstrations"
        return HeldOut(description, ("loss",), before, after)


def sft(
    config: SFTConfig | str | Path | dict | None = None,
    overrides: list[str] | None = None,
    *,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    callbacks: list | None = None,
) -> FinetuneResult:
    """Fine-tune a causal LM on demonstrations and return the result; the model lands in `<output.dir>/final`.

    With `output.resume=true` a stopped run continues from its newest checkpoint, exactly;
    `callbacks` follow `polo.runtime.callbacks`. `train_dataset` / `eval_dataset` (a `datasets.Dataset` or a
    list of dicts, rows as in the jsonl files) stand in for data.train_path / data.eval_path.
    """
    rows = PassedRows(train_dataset, eval_dataset)
    return finetune(SFTTrainer, SFTConfig, config, overrides, callbacks, rows)
