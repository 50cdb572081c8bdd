"""Rejection sampling (R1's stage 3): the RL model's own correct, well-formed answers become SFT data.

For each of N training prompts the model samples K completions; a completion is *accepted* when
the task's checker says its answer (inside `<answer>`) is right AND it has the R1 layout
(`r1_format` == 1: one think block, then one answer block, nothing else). Accepted completions
are deduplicated (same text after stripping surrounding whitespace) and at most M are kept per
prompt, so no single easy prompt dominates the data. `select` is that rule as a pure function;
`rejection_sample` runs it over a model's samples and returns SFT rows plus the counts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from polo.data.base import Task
from polo.data.preferences import user_prompt
from polo.generation.grouped import GroupSampling, sample_groups
from polo.rewards.format import r1_format


@dataclass
class Selection:
    """What `select` kept of one prompt's samples, and why the others went."""

    kept: list[str]  # at most M accepted, distinct completions, in sample order
    sampled: int = 0
    correct: int = 0  # the checker's verdict > 0.5
    well_formed: int = 0  # r1_format == 1
    accepted: int = 0  # correct and well formed (duplicates included)
    duplicates: int = 0  # accepted completions dropped as a repeat of an earlier one
    over_cap: int = 0  # distinct accepted completions dropped by the cap M

    def counts(self) -> dict[str, int]:
        """Return the counts as a plain dict (for summaries)."""
        return {
            "sampled": self.sampled,
            "correct": self.correct,
            "well_formed": self.well_formed,
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "over_cap": self.over_cap,
            "kept": len(self.kept),
        }


def select(
    completions: Sequence[str],
    row: dict,
    correctness: Callable[[str, dict], float],
    max_per_prompt: int,
    well_formed: Callable[[str, dict], float] = r1_format,
) -> Selection:
    """Return one prompt's completions worth learning from: correct, well formed, distinct, at most `max_per_prompt`.

    `correctness(completion, row)` is the task's checker (> 0.5 counts as right); `well_formed`
    is `r1_format` (== 1 counts). Duplicates are compared after stripping surrounding whitespace;
    the first occurrence is kept, with its own text.
    """
    if isinstance(max_per_prompt, bool) or not isinstance(max_per_prompt, int) or max_per_prompt < 1:
        raise ValueError(f"max_per_prompt must be an integer >= 1, got {max_per_prompt!r}")
    selection = Selection(kept=[], sampled=len(completions))
    seen: set[str] = set()
    for text in completions:
        right = float(correctness(text, row)) > 0.5
        formed = float(well_formed(text, row)) == 1.0
        selection.correct += right
        selection.well_formed += formed
        if not (right and formed):
            continue
        selection.accepted += 1
        key = text.strip()
        if key in seen:
            selection.duplicates += 1
        elif len(selection.kept) >= max_per_prompt:
            selection.over_cap += 1
            seen.add(key)
        else:
            selection.kept.append(text)
            seen.add(key)
    return selection


@dataclass
class RejectionResult:
    """SFT rows from rejection sampling, and the counts behind them."""

    rows: list[dict]  # {"prompt", "response", "question", "answer"}: polo sft's demonstration format
    summary: dict = field(default_factory=dict)


def training_prompts(task: Task, num_prompts: int, seed: int) -> list[dict]:
    """Return `num_prompts` of the task's training rows (never a held-out question), shuffled with `seed`."""
    rows = task.unseen_train_rows()
    if num_prompts > len(rows):
        raise ValueError(
            f"rejection sampling asks for {num_prompts} prompts but the task's training split holds {len(rows)}"
        )
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows[:num_prompts]


@dataclass(frozen=True)
class RejectionDraw:
    """Which training prompts rejection sampling draws, how they are phrased, and how much it keeps of each."""

    num_prompts: int  # N training prompts
    max_per_prompt: int  # M: at most this many accepted completions kept per prompt
    instruction: str  # phrased exactly as the RL stage phrased them
    system_prompt: str | None = None
    seed: int = 0  # the shuffle that picks the prompts


def rejection_sample(model, tokenizer, task: Task, draw: RejectionDraw, sampling: GroupSampling) -> RejectionResult:
    """Return what `select` keeps of `sampling.samples` completions for each of `draw.num_prompts` training prompts.

    Prompts are phrased exactly as the RL stage phrased them (`draw.instruction`,
    `draw.system_prompt`), so the rows teach the model its own best answers to the prompts it will
    see again.
    """
    instruction, system_prompt, max_per_prompt = draw.instruction, draw.system_prompt, draw.max_per_prompt
    rows = training_prompts(task, draw.num_prompts, draw.seed)
    prompts = task.prompts(tokenizer, rows, instruction, system_prompt)
    completions = sample_groups(model, tokenizer, prompts, sampling)
    kept_rows, per_prompt = [], []
    totals = Selection(kept=[])
    for row, done in zip(rows, completions):
        selection = select([sample.text for sample in done], row, task.correctness, max_per_prompt)
        per_prompt.append({"question": row["question"], "answer": row["answer"], **selection.counts()})
        for name in ("sampled", "correct", "well_formed", "accepted", "duplicates", "over_cap"):
            setattr(totals, name, getattr(totals, name) + getattr(selection, name))
        prompt = user_prompt(row["question"], instruction, system_prompt, task.few_shot)
        kept_rows.extend(
            {"prompt": prompt, "response": text, "question": row["question"], "answer": row["answer"]}
            for text in selection.kept
        )
    summary = rejection_summary(totals, len(kept_rows), per_prompt, sampling.samples, max_per_prompt)
    return RejectionResult(kept_rows, summary)


def rejection_summary(totals: Selection, kept: int, per_prompt: list[dict], samples: int, max_per_prompt: int) -> dict:
    """Return the summary of a rejection-sampling pass: totals, rates and the per-prompt counts."""
    sampled = max(totals.sampled, 1)
    return {
        "prompts": len(per_prompt),
        "samples_per_prompt": samples,
        "max_per_prompt": max_per_prompt,
        **{
            name: getattr(totals, name)
            for name in ("sampled", "correct", "well_formed", "accepted", "duplicates", "over_cap")
        },
        "kept": kept,
        "correct_rate": totals.correct / sampled,
        "format_rate": totals.well_formed / sampled,
        "acceptance_rate": totals.accepted / sampled,
        "prompts_with_a_kept_sample": sum(1 for entry in per_prompt if entry["kept"]),
        "per_prompt": per_prompt,
    }
