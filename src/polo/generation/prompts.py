"""From a question to the prompt text and token ids a model samples from.

The instruction templates (R1-Zero tags or a plain final-answer line), the chat template, and
left-padded tokenisation; shared by training, evaluation, reward models and preference data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from polo.models.family import encode_prompts
from polo.runtime.device import CPU


def tokenize_prompts(
    tokenizer, prompts: list[str], device: torch.device = CPU.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return left-padded `(input_ids, attention_mask)`, (prompts, longest), on `device`, for formatted prompt strings.

    Each prompt starts with the tokenizer's BOS exactly once when the tokenizer adds one (a chat
    template that already wrote it gets no second one; `polo.models.family.encode_prompts`).
    The rows are laid out on the host; a sampler moves the batch to its device in one copy.
    """
    rows = encode_prompts(tokenizer, prompts)
    length = max((len(row) for row in rows), default=0)
    pad_id = tokenizer.pad_token_id
    if pad_id is None and any(len(row) != length for row in rows):
        raise ValueError("the tokenizer has no pad token; prompts of different lengths cannot be batched")
    input_ids = torch.full((len(rows), length), pad_id if pad_id is not None else 0, dtype=torch.long, device=device)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long, device=device)
    for index, row in enumerate(rows):
        if row:
            input_ids[index, length - len(row) :] = torch.tensor(row, dtype=torch.long, device=device)
            attention_mask[index, length - len(row) :] = 1
    return input_ids, attention_mask


def stop_token_ids(tokenizer, model) -> list[int]:
    """Return the token ids that end a completion (the tokenizer's and the model config's EOS)."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    if not ids:
        raise ValueError("the tokenizer and model define no EOS token; completions could never stop")
    return sorted(ids)


QUESTION_PLACEHOLDER = "{question}"

# The row key of a conversational prompt: the dataset's list of {role, content} messages, sent through the chat
# template as it stands (TRL's conversational format). A row without it is asked its "question".
PROMPT_MESSAGES = "prompt_messages"
# The row key of a prompt read from TRL's "prompt" column: the column's value as it stands (text or messages), the
# whole prompt rather than a question to phrase, and what TRL-form reward functions get as ``prompts``.
TRL_PROMPT = "trl_prompt"


# R1-Zero style: reasoning and answer in separate tags, so the format reward and the
# answer extraction have something unambiguous to look for.
DEFAULT_INSTRUCTION = (
    "{question}\n\n"
    "First think through the problem step by step inside <think> </think> tags. "
    "Then give only the final answer inside <answer> </answer> tags, "
    "for example <answer>42</answer>."
)


# For tasks whose correctness looks at the last number in the text rather than a tag.
PLAIN_INSTRUCTION = "{question}\n\nAnswer briefly, and end your reply with the final number."


def default_instruction(answer_in_tags: bool) -> str:
    """Return the instruction template that matches how a task's correctness reads answers."""
    return DEFAULT_INSTRUCTION if answer_in_tags else PLAIN_INSTRUCTION


def fill_instruction(instruction: str, question: str) -> str:
    """Return ``instruction`` with its ``{question}`` placeholder replaced by ``question``."""
    if QUESTION_PLACEHOLDER not in instruction:
        raise ValueError(
            f"instruction template {instruction!r} has no {QUESTION_PLACEHOLDER!r} placeholder; "
            f"a template must contain {QUESTION_PLACEHOLDER!r} exactly where the question goes"
        )
    # str.replace rather than str.format: templates and questions may contain literal braces
    # (LaTeX, JSON examples) that format() would try to interpret.
    return instruction.replace(QUESTION_PLACEHOLDER, question)


def prompt_messages(
    question: str,
    instruction: str = DEFAULT_INSTRUCTION,
    system_prompt: str | None = None,
    few_shot: Sequence[tuple[str, str]] = (),
) -> list[dict]:
    """Return the chat messages that ask `question`: [system], then each worked example, then the question.

    `few_shot` holds `(question, response)` pairs shown as earlier turns: the example question
    through the same instruction as a user message, its response as the assistant's reply. A
    worked example is how a small instruct model learns a layout it never writes on its own
    (`docs/r1.md`: SmolLM2-135M writes the R1 tags only after seeing one).
    """
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    for example_question, response in few_shot:
        messages.append({"role": "user", "content": fill_instruction(instruction, example_question)})
        messages.append({"role": "assistant", "content": response})
    messages.append({"role": "user", "content": fill_instruction(instruction, question)})
    return messages


def render_messages(tokenizer: Any, messages: Sequence[dict]) -> str:
    """Return the text before the model's reply: the chat template with the assistant turn opened.

    Without a chat template (base models) the contents are joined by blank lines and followed by
    a newline, so a system prompt or an example is never silently dropped.
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return "\n\n".join(message["content"] for message in messages) + "\n"


def format_prompt(
    tokenizer: Any,
    question: str,
    instruction: str = DEFAULT_INSTRUCTION,
    system_prompt: str | None = None,
    few_shot: Sequence[tuple[str, str]] = (),
) -> str:
    """Return the prompt text for one question, through the chat template when there is one.

    With a chat template the filled instruction becomes the user message (after an optional
    system message and the `few_shot` example turns) and the assistant turn is opened
    (``add_generation_prompt=True``), so the completion is exactly the assistant's reply.
    Without one (base models) the messages are joined as plain text (`render_messages`).
    """
    return render_messages(tokenizer, prompt_messages(question, instruction, system_prompt, few_shot))


def render_prompt(tokenizer: Any, messages: Sequence[dict], system_prompt: str | None = None) -> str:
    """Return the text the model sees before its reply: the chat template with the assistant turn opened.

    A lone user message renders exactly as `format_prompt` renders the same message and system
    prompt, so SFT and RL prompts match. `system_prompt` is used only when the messages bring no
    system message of their own.
    """
    messages = list(messages)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return render_messages(tokenizer, messages)
