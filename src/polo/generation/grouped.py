"""The one way polo samples many completions per prompt outside an RL step: `polo eval`, the pipeline's stage
evaluations, rejection sampling and sampled preference data all call `sample_groups`.

A prompt's K samples are one group of a `Sampler` (one prefill shared by the K rows, as GRPO samples
a group); prompts go shortest first, so a batch holds prompts of similar length (little left
padding), and a batch always holds whole groups. `pick_sampler` is the one place that chooses the
sampler for a `Compute`; `load_for_sampling` loads a model the way these jobs sample it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from polo.core.registry import SAMPLERS, register_sampler
from polo.generation import cpu_sampler, static_sampler
from polo.generation.rollouts import Decoding, EpisodeRecord, Sampler
from polo.models.family import encode_prompts
from polo.runtime.device import CPU, Compute
from polo.runtime.metrics import on_terminal


# `sampling.sampler`: each registered sampler is the function giving the sampler module for a Compute.
@register_sampler("auto", help="the static sampler on CUDA (a captured decode step), the KV-cache one elsewhere")
def auto_sampler(compute: Compute) -> ModuleType:
    """Return the static-cache sampler on CUDA; elsewhere the KV-cache one, which drops finished rows (a
    fixed-shape decode cannot)."""
    return static_sampler if compute.is_cuda else cpu_sampler


@register_sampler("kv_cache", help="a growing KV cache, finished rows dropped (polo.generation.cpu_sampler)")
def kv_cache_sampler(compute: Compute) -> ModuleType:
    """Return the KV-cache sampler, whatever the device."""
    return cpu_sampler


@register_sampler(
    "static", help="a preallocated cache of fixed shapes, a CUDA graph on a GPU (polo.generation.static_sampler)"
)
def static_cache_sampler(compute: Compute) -> ModuleType:
    """Return the static-cache sampler, whatever the device."""
    return static_sampler


@dataclass(frozen=True)
class GroupSampling:
    """How `sample_groups` samples: completions per prompt, decoding, batch size, device and sampler."""

    samples: int = 1  # completions per prompt, sampled as one group
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 is greedy decoding (then one sample: the others would be copies)
    top_p: float = 1.0
    batch_size: int = 64  # sequences per sampler call: batch_size // samples prompts (at least one)
    compute: Compute = CPU
    sampler: Sampler | None = None  # None: pick_sampler("auto", compute)
    progress: bool = False  # a progress bar
    description: str = "polo sample"  # the progress bar's label

    @property
    def decoding(self) -> Decoding:
        """Return how each completion is drawn: `max_new_tokens`, `temperature` and `top_p`."""
        return Decoding(self.max_new_tokens, self.temperature, self.top_p)


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its text (special tokens removed), its generated tokens (the end token included), and
    whether max_new_tokens cut it."""

    text: str
    length: int
    truncated: bool
    episode: EpisodeRecord | None = None  # a multi-turn episode's turns and tool use (None: one turn)


def pick_sampler(name: str, compute: Compute) -> Sampler:
    """Return the sampler `name` (auto | kv_cache | static) names for `compute`.

    auto is the static-cache sampler on CUDA (a captured decode step) and the KV-cache sampler elsewhere
    (on the CPU it drops finished rows, which a fixed-shape decode cannot).
    """
    return sampler_module(name, compute).rollout


def pick_generator(name: str, compute: Compute) -> Callable:
    """Return the `generate` (token ids in, one turn out) of the sampler `name` picks for `compute`.

    The episode sampler (`polo.generation.episodes`) samples every turn with it.
    """
    return sampler_module(name, compute).generate


def sampler_module(name: str, compute: Compute) -> ModuleType:
    """Return the sampler module `name` (auto | kv_cache | static) names for `compute` (see `pick_sampler`)."""
    if name not in SAMPLERS:
        raise ValueError(f"sampling.sampler: {SAMPLERS.unknown(name)}")
    return SAMPLERS[name](compute)


def load_for_sampling(name: str, compute: Compute) -> tuple:
    """Return `(model, tokenizer)` ready to sample: weights in `compute.param_dtype` on `compute.device`, eval mode,
    the device's fast attention (`polo.kernels.use_fast_attention`)."""
    from polo.kernels import use_fast_attention, use_lean_layers
    from polo.models.loading import load_policy

    model, tokenizer = load_policy(name, dtype=compute.param_dtype)
    model.to(compute.device).eval()
    use_fast_attention(model, compute)
    use_lean_layers(model)
    return model, tokenizer


def group_batches(lengths: list[int], samples_per_prompt: int, batch_size: int) -> list[list[int]]:
    """Return the prompt indices of each batch: shortest first, `batch_size // samples_per_prompt` (>= 1) a batch."""
    if samples_per_prompt < 1 or batch_size < 1:
        raise ValueError(f"samples_per_prompt and batch_size must be >= 1, got {samples_per_prompt} and {batch_size}")
    order = sorted(range(len(lengths)), key=lambda index: lengths[index])
    per_batch = max(1, batch_size // samples_per_prompt)
    return [order[start : start + per_batch] for start in range(0, len(order), per_batch)]


@torch.no_grad()
def sample_groups(
    model, tokenizer, prompts: list[str], settings: GroupSampling, rows: Sequence[dict] | None = None
) -> list[list[Completion]]:
    """Return, per prompt in the given order, its `settings.samples` completions, each prompt sampled as one group.

    `settings.batch_size` counts sequences: a batch holds `batch_size // samples` prompts (at least
    one). The sampler defaults to `pick_sampler("auto", compute)`. Temperature 0 is greedy.
    `rows` (the task rows behind the prompts) go to the sampler: an episode sampler starts from them.
    """
    from tqdm.auto import tqdm

    samples_per_prompt, compute, decoding = settings.samples, settings.compute, settings.decoding
    sampler = pick_sampler("auto", compute) if settings.sampler is None else settings.sampler
    lengths = [len(ids) for ids in encode_prompts(tokenizer, prompts)]  # as the sampler tokenizes them (BOS included)
    results: list[list[Completion]] = [[] for _ in prompts]
    total = len(prompts) * samples_per_prompt
    # a bar only on a terminal: in a log file its redraws are one long line that other lines are glued to
    progress = {"desc": settings.description, "disable": not settings.progress or not on_terminal()}
    with tqdm(total=total, unit="sample", dynamic_ncols=True, **progress) as bar:
        for chunk in group_batches(lengths, samples_per_prompt, settings.batch_size):
            sampled = sampler(
                model,
                tokenizer,
                [prompts[index] for index in chunk],
                samples_per_prompt,
                decoding,
                compute=compute,
                rows=None if rows is None else [rows[index] for index in chunk],
            )
            counts, cut = sampled.model_token_mask.sum(-1).tolist(), sampled.truncated.tolist()
            episodes = sampled.episodes or [None] * len(sampled.texts)
            for row, text in enumerate(sampled.texts):
                done = Completion(text, int(counts[row]), bool(cut[row]), episodes[row])
                results[chunk[row // samples_per_prompt]].append(done)
            bar.update(len(sampled.texts))
    return results
