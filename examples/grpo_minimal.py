"""GRPO on a causal language model, in one file: teach SmolLM2-135M-Instruct two-digit addition.

The policy-optimization maths comes from `polo.core`; everything else is plain torch and
transformers, so the whole algorithm reads top to bottom:

    every step:
        draw P addition problems, sample G completions for each         (model.generate)
        reward 1.0 when a completion's last number is the right sum
        advantage = reward standardised within its group of G           (group_advantages)
        update_epochs times: PPO-clipped loss (+ beta * KL to a frozen reference), one AdamW step

Run it after `make model` (which puts the default model in ~/.cache/polo/models/):
    .venv/bin/python examples/grpo_minimal.py                   # the defaults of recipes/grpo_arith.yaml
    .venv/bin/python examples/grpo_minimal.py --steps 5 --beta 0.04 --update-epochs 2
A step takes under a minute on a 2-core CPU (64 completions; the update is most of it). `polo train
recipes/grpo_arith.yaml` runs the same algorithm several times faster (bf16 where it pays, the prompt's
forward shared by its group, tiled log-probs; recorded runs: docs/benchmarks.md) and adds checkpoints,
logging, LoRA and other algorithms;
tests/examples/test_grpo_minimal.py checks that on one fixed batch this file's loss and update
are `polo train`'s, to fp32 tolerance.
"""

import argparse
import copy
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from polo.core import (
    LossNormalisers,
    expand_to_tokens,
    group_advantages,
    kl_estimate,
    masked_mean,
    ppo_clip_loss,
    seq_mean_token_mean,
)

POLO_CACHE = Path(os.environ.get("POLO_CACHE", Path.home() / ".cache" / "polo")).expanduser()
DEFAULT_MODEL = POLO_CACHE / "models" / "smollm2-135m-instruct"


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    model: str = arg(str(DEFAULT_MODEL), "a transformers model directory (`make model` fetches the default)")
    steps: int = arg(40, "training steps; each samples one batch and makes update_epochs optimizer steps on it")
    prompts_per_step: int = arg(8, "P: distinct problems per step")
    group_size: int = arg(8, "G: completions per problem; each is judged against its own group")
    max_new_tokens: int = arg(32, "longest completion; a longer one is cut and usually scores 0")
    learning_rate: float = arg(5e-6, "AdamW learning rate (reached after warmup_steps)")
    warmup_steps: int = arg(2, "optimizer steps of linear learning-rate warm-up")
    beta: float = arg(0.0, "weight of the k3 KL to the initial model; 0 keeps no reference copy at all")
    clip_eps: float = arg(0.2, "PPO clip range: the probability ratio is held within [1 - eps, 1 + eps]")
    update_epochs: int = arg(
        1, "mu: optimizer steps per sampled batch; >1 reuses the samples, which clipping makes safe"
    )
    temperature: float = arg(1.0, "sampling temperature (the log-probs are of the same tempered policy)")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 samples from the full distribution")
    micro_batch_size: int = arg(16, "sequences per forward/backward; gradients add up to the full batch's")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    seed: int = arg(0, "seeds the problems, the sampling and torch")
    num_eval: int = arg(100, "held-out problems scored greedily before and after training")
    threads: int = arg(0, "torch CPU threads; 0 keeps torch's default")


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(Args):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(parser.parse_args()))


# ---- the task: two-digit addition, scored by the last number in the reply ----

INSTRUCTION = "What is {a} + {b}?\n\nAnswer briefly, and end your reply with the final number."
NUMBER = re.compile(r"-?\d+")


def split_problems(seed: int, num_eval: int) -> tuple[list, list]:
    """Return (train, eval) lists of (a, b) pairs; the two never share a problem."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]  # all 8100 two-digit sums
    random.Random(seed).shuffle(pairs)
    return pairs[num_eval:], pairs[:num_eval]


def prompt_text(tokenizer, a: int, b: int) -> str:
    question = INSTRUCTION.format(a=a, b=b)
    if tokenizer.chat_template:  # instruct models: the completion is then exactly the assistant's turn
        messages = [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return question + "\n"


def correctness(completion: str, answer: int) -> float:
    numbers = NUMBER.findall(completion)
    return 1.0 if numbers and int(numbers[-1]) == answer else 0.0


def encode_prompts(tokenizer, problems, device):
    # Left padding lines up every prompt's last token, so all completions start in the same column.
    texts = [prompt_text(tokenizer, a, b) for a, b in problems]
    # The chat template already wrote any special tokens the model expects.
    return tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False).to(device)


# ---- the model side: sampling and log-probabilities ----


def completion_mask_from(completion_ids: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """1 up to and including each row's first EOS, 0 after it (generate pads finished rows)."""
    is_eos = torch.isin(completion_ids, eos_ids).long()  # (batch, completion_len)
    # The EOS itself stays in: stopping is an action the model must be rewarded for too.
    eos_before = is_eos.cumsum(dim=1) - is_eos
    return (eos_before == 0).long()


def completion_logprobs(model, input_ids, attention_mask, completion_len: int, temperature: float) -> torch.Tensor:
    """log π(y_t | prompt, y_<t) of each completion token, (batch, completion_len).

    input_ids and attention_mask are (batch, prompt_len + completion_len): [left-padded prompt | completion].
    """
    # Count positions over real tokens only, as generate() did; otherwise left padding shifts them.
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    # The logits at position t predict token t + 1, so the last completion_len + 1 positions cover the
    # completion (the very last one predicts past it); skipping the prompt's logits saves memory.
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=completion_len + 1
    ).logits[:, :-1]  # (batch, completion_len, vocab)
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    completion_ids = input_ids[:, -completion_len:]
    return logprobs.gather(dim=-1, index=completion_ids.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems, max_new_tokens: int, batch_size: int = 50) -> float:
    correct = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        prompts = encode_prompts(tokenizer, chunk, model.device)
        sequences = model.generate(
            **prompts, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
        )
        texts = tokenizer.batch_decode(sequences[:, prompts.input_ids.shape[1] :], skip_special_tokens=True)
        correct += sum(correctness(text, a + b) for text, (a, b) in zip(texts, chunk))
    return correct / max(len(problems), 1)


# ---- one step: sample, then update ----


@dataclass
class Rollout:
    """One step's samples: P prompts x G completions, each prompt's G completions in adjacent rows."""

    sequences: torch.Tensor  # (B, prompt_len + completion_len): [left-padded prompt | completion]
    attention_mask: torch.Tensor  # (B, prompt_len + completion_len): 0 on padding and after each EOS
    completion_mask: torch.Tensor  # (B, completion_len): 1 up to and including each row's first EOS


def rollout_from(prompts, completion_ids: torch.Tensor, eos_ids: torch.Tensor, group_size: int) -> Rollout:
    """The Rollout of G completions per prompt; `prompts` holds each prompt once, completion_ids (B, completion_len)."""
    completion_mask = completion_mask_from(completion_ids, eos_ids)
    prompt_ids = prompts.input_ids.repeat_interleave(group_size, dim=0)
    prompt_mask = prompts.attention_mask.repeat_interleave(group_size, dim=0)
    return Rollout(
        torch.cat([prompt_ids, completion_ids], dim=1),
        torch.cat([prompt_mask, completion_mask], dim=1),
        completion_mask,
    )


@torch.no_grad()
def sample(model, tokenizer, problems, args: Args, eos_ids: torch.Tensor) -> Rollout:
    # num_return_sequences keeps each prompt's G samples next to each other, which is the
    # contiguous-group layout group_advantages expects.
    prompts = encode_prompts(tokenizer, problems, model.device)
    sequences = model.generate(
        **prompts,
        do_sample=True,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        max_new_tokens=args.max_new_tokens,
        num_return_sequences=args.group_size,
        pad_token_id=tokenizer.pad_token_id,
    )  # (B, prompt_len + completion_len)
    return rollout_from(prompts, sequences[:, prompts.input_ids.shape[1] :], eos_ids, args.group_size)


def build_optimizer(model, args: Args):
    """AdamW and its schedule: linear warm-up over warmup_steps optimizer steps, then constant."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.99), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / (args.warmup_steps + 1)))
    return optimizer, scheduler


def update(model, ref_model, optimizer, scheduler, rollout: Rollout, advantages: torch.Tensor, args: Args):
    """update_epochs optimizer steps on one batch; returns (loss, kl), each averaged over the epochs.

    advantages: (B,), one per completion. kl is the mean over sequences of each one's mean k3 KL.
    """
    batch_size, completion_len = rollout.completion_mask.shape
    token_advantages = expand_to_tokens(advantages, rollout.completion_mask)  # (B, completion_len)
    micro_batches = [slice(i, i + args.micro_batch_size) for i in range(0, batch_size, args.micro_batch_size)]

    def logprobs_of(policy, rows):  # (micro, completion_len)
        return completion_logprobs(
            policy, rollout.sequences[rows], rollout.attention_mask[rows], completion_len, args.temperature
        )

    # Log-probs that stay fixed during the update. With a single epoch the policy that sampled is the
    # policy being trained, so its old log-probs are just the current ones detached (no extra forward).
    with torch.no_grad():
        old_logprobs, ref_logprobs = None, None  # each (B, completion_len) when needed
        if args.update_epochs > 1:
            old_logprobs = torch.cat([logprobs_of(model, rows) for rows in micro_batches])
        if args.beta > 0:
            ref_logprobs = torch.cat([logprobs_of(ref_model, rows) for rows in micro_batches])

    num_tokens = rollout.completion_mask.sum().item()
    loss_sum, kl_sum = 0.0, 0.0
    for _ in range(args.update_epochs):
        optimizer.zero_grad(set_to_none=True)
        for rows in micro_batches:
            mask = rollout.completion_mask[rows]
            logprobs = logprobs_of(model, rows)  # with gradients
            old = old_logprobs[rows] if old_logprobs is not None else logprobs.detach()
            per_token, _ = ppo_clip_loss(logprobs, old, token_advantages[rows], mask, args.clip_eps, args.clip_eps)
            if args.beta > 0:
                kl = kl_estimate(logprobs, ref_logprobs[rows], "k3")  # (micro, completion_len), >= 0
                per_token = per_token + args.beta * kl
                kl_sum += masked_mean(kl, mask, dim=1).sum().item()
            # GRPO's mean over each sequence's tokens, then over sequences; dividing by the whole batch's
            # sequence count (not the micro-batch's) makes the micro-batch gradients add up to the batch's.
            # (seq_mean_token_sum_norm or token_mean here would give Dr. GRPO's or DAPO's averaging instead)
            normalisers = LossNormalisers(batch_size, num_tokens, args.max_new_tokens)
            loss = seq_mean_token_mean(per_token, mask, normalisers)
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
    return loss_sum / args.update_epochs, kl_sum / (batch_size * args.update_epochs)


# ---- the script ----


def main() -> None:
    args = parse_args()
    if not Path(args.model).is_dir():
        print(
            f"no model at {args.model}: run `make model` to fetch the default one (or pass --model DIR)",
            file=sys.stderr,
        )
        sys.exit(2)
    transformers_logging.disable_progress_bar()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # the sampling
    rng = random.Random(args.seed)  # which problems each step draws
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    # float32 keeps this file free of mixed-precision care; `polo train` gets much of its speed from bf16.
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    # from_pretrained leaves the model in eval mode; it stays there, so sampling and training see the same
    # network (no dropout) and the first epoch's probability ratio is exactly 1.
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    eos_ids = torch.tensor(eos if isinstance(eos, list) else [eos], device=device)
    # The reference is the starting policy, frozen; it costs a second model, so only keep one if it is used.
    ref_model = copy.deepcopy(model).requires_grad_(False) if args.beta > 0 else None
    optimizer, scheduler = build_optimizer(model, args)

    train_problems, eval_problems = split_problems(args.seed, args.num_eval)
    accuracy_before = greedy_accuracy(model, tokenizer, eval_problems, args.max_new_tokens)

    for step in range(1, args.steps + 1):
        step_start = time.time()
        # 1. Rollout: G samples of each of P prompts, B = P * G sequences.
        problems = rng.sample(train_problems, args.prompts_per_step)
        rollout = sample(model, tokenizer, problems, args, eos_ids)

        # 2. Rewards and group-relative advantages.
        completion_ids = rollout.sequences[:, -rollout.completion_mask.shape[1] :]
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        answers = [a + b for a, b in problems for _ in range(args.group_size)]
        rewards = torch.tensor([correctness(text, answer) for text, answer in zip(texts, answers)], device=device)
        # Each completion is compared only with its own group, so prompt difficulty cancels out;
        # a group that is all right or all wrong gets advantage 0 and teaches nothing.
        advantages = group_advantages(rewards, args.group_size)  # (B,)

        # 3. The update: PPO-clipped loss (+ beta * KL), update_epochs optimizer steps on this one batch.
        loss, kl = update(model, ref_model, optimizer, scheduler, rollout, advantages, args)

        # With one epoch the printed loss is ~0 by construction (advantages average to zero in every group,
        # and the ratio is 1); its gradient is not. Reward and accuracy coincide for this 0/1 reward.
        kl_text = f"{kl:.4f}" if args.beta > 0 else "-"
        accuracy = (rewards == 1.0).float().mean().item()
        mean_length = rollout.completion_mask.sum(dim=1).float().mean().item()
        print(
            f"step {step:3d} | reward {rewards.mean().item():.3f} | accuracy {accuracy:.3f} | "
            f"length {mean_length:5.1f} | loss {loss:+.4f} | kl {kl_text} | {time.time() - step_start:.1f} s",
            flush=True,
        )

    accuracy_after = greedy_accuracy(model, tokenizer, eval_problems, args.max_new_tokens)
    print(
        f"greedy accuracy on {len(eval_problems)} held-out problems: "
        f"{accuracy_before:.3f} before -> {accuracy_after:.3f} after"
    )


if __name__ == "__main__":
    main()
