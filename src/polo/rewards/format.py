"""Format rewards for the R1 layout ``<think>reasoning</think> <answer>final answer</answer>``.

Both look only at the completion: if a prompt pre-opens ``<think>`` for the model, the
completion lacks it and ``r1_format`` scores 0.0 on purpose. Prompts made by
``polo.data.format_prompt`` never do that, so the model has to write both blocks itself.
"""

from __future__ import annotations

import re

from polo.core.registry import register_reward

# Block content may not contain any of the four tags, so repeated or nested blocks fail.
_NO_TAGS = r"(?:(?!</?think>|</?answer>).)*"
_R1_LAYOUT = re.compile(rf"<think>{_NO_TAGS}</think>\s*<answer>{_NO_TAGS}</answer>", re.DOTALL)

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


@register_reward("r1_format", help="the R1 format: reasoning in <think>, the answer in <answer> (DeepSeek-AI 2025)")
def r1_format(completion: str, row: dict) -> float:
    """Return 1.0 if the completion is exactly one think block then one answer block, else 0.0.

    Only whitespace may surround or separate the blocks; any text before ``<think>``, between
    the blocks or after ``</answer>`` gives 0.0, as does a second block of either kind.
    """
    return float(_R1_LAYOUT.fullmatch(completion.strip()) is not None)


@register_reward("tag_count", help="0.25 for each of the four R1 tags written exactly once")
def tag_count(completion: str, row: dict) -> float:
    """Return partial format credit in [0, 1]: 0.25 per tag that occurs exactly once.

    The four tags are ``<think>``, ``</think>``, ``<answer>``, ``</answer>``. Order and
    surrounding text are ignored, which makes this a denser, gentler signal than ``r1_format``
    early in training, when a model writes some of the tags but not the full layout.
    """
    return float(sum(0.25 for tag in _TAGS if completion.count(tag) == 1))
