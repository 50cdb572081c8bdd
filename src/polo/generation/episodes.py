"""Multi-turn episodes: the model writes, an environment answers (a tool's output), the model goes on.

An LM environment is Gymnasium's shape for a chat: `reset(row) -> messages` starts an episode,
`step(assistant_text) -> EnvStep(observation, reward, done)` answers one of the model's turns.
The environments themselves (the Python tool, the registry, `module:Name` loading) live in
`polo.data.environments`; this module only drives them.

`EpisodeSampler` is a `Sampler` (`polo.generation.rollouts`): each turn it samples the next turn of
every live episode in one batch with a per-turn sampler (`cpu_sampler.generate` or
`static_sampler.generate`: its own logic never asks for a device), stopping at EOS or at the
environment's stop strings; it hands each finished turn to its episode's environment, appends the
observation through the chat template, and goes on until the environment says done or a limit
(`max_turns`, `max_episode_tokens`, a turn's `max_new_tokens`) is reached. Finished episodes leave
the batch. The result keeps the one-turn layout (see `Rollouts`): everything after the first prompt
is the completion, and `loss_mask` marks what the model wrote.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from polo.generation.prompts import render_messages, stop_token_ids
from polo.generation.rollouts import Decoding, EpisodeRecord, Rollouts
from polo.generation.stopping import Stopping, StopStrings
from polo.models.family import encode_prompts
from polo.runtime.device import CPU, Compute

TEMPLATE_SENTINEL = "\u2063polo-turn-end\u2063"  # marks where the model's text ends in a rendered chat
CONTENT_MARK = "\u2063polo-content-{}\u2063"  # stands for an observation's content in a rendered chat
CONTENT_MARKS = re.compile("\u2063polo-content-([0-9]+)\u2063")


@dataclass
class EnvStep:
    """What an environment answers to one of the model's turns (Gymnasium's step, for a chat).

    `observation` is the messages to show the model next (a tool's output, as `{"role": "tool",
    "content": ...}`), None when there is nothing to show; `reward` an environment's own reward for
    the turn (None: the task's rewards judge the episode); `done` ends the episode. The tool fields
    count what the step ran, for the metrics.
    """

    observation: list[dict] | None = None
    reward: float | None = None
    done: bool = False
    tool_calls: int = 0
    tool_failures: int = 0
    tool_seconds: float = 0.0


class Environment(Protocol):
    """An LM environment: one instance runs one episode at a time.

    `stop_strings` end a turn besides EOS (a tool call's closing tag), so the environment can
    answer mid-reply.
    """

    stop_strings: Sequence[str]

    def reset(self, row: dict) -> list[dict]:
        """Return the chat messages that open the episode for task row `row`."""
        ...

    def step(self, assistant_text: str) -> EnvStep:
        """Return the environment's answer to the model's turn `assistant_text` (cut after its stop string)."""
        ...


@dataclass(frozen=True)
class EpisodeLimits:
    """How long an episode may run: model turns, and tokens after the first prompt (turns and observations)."""

    max_turns: int = 4
    max_episode_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_episode_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sampling.{name} must be an integer >= 1, got {value!r}")


@dataclass
class Episode:
    """One episode in flight: its environment, its ids after the prompt and which of them the model wrote."""

    environment: Environment
    prompt_ids: list[int]
    record: EpisodeRecord = field(default_factory=EpisodeRecord)
    ids: list[int] = field(default_factory=list)
    written: list[int] = field(default_factory=list)  # 1 where the model wrote the token
    live: bool = True
    truncated: bool = False

    def extend(self, ids: Sequence[int], written: int) -> None:
        """Append `ids` to the episode, marked as written by the model (1) or not (0)."""
        self.ids.extend(ids)
        self.written.extend([written] * len(ids))


def record_step(record: EpisodeRecord, answer: EnvStep) -> None:
    """Add one step's reward and tool counts to the episode's record."""
    if answer.reward is not None:
        record.reward = (record.reward or 0.0) + float(answer.reward)
    record.tool_calls += answer.tool_calls
    record.tool_failures += answer.tool_failures
    record.tool_seconds += answer.tool_seconds


def environment_steps(episodes: Sequence[Episode]) -> list[EnvStep]:
    """Return each episode's environment's answer to its last turn, the environments stepped concurrently.

    A tool call is a sandboxed subprocess that the trainer only waits for (about 0.12 s each on a
    2-core CPU, 64 of them in a step of the tool recipe), so running one per core overlaps them.
    Each episode has its own environment instance; an environment's `step` is never run twice at once.
    """
    if len(episodes) < 2:
        return [episode.environment.step(episode.record.turns[-1]) for episode in episodes]
    workers = min(len(episodes), os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="polo-env") as pool:
        return list(pool.map(lambda episode: episode.environment.step(episode.record.turns[-1]), episodes))


def special_spellings(tokenizer) -> list[str]:
    """Return the texts the tokenizer reads as its special tokens (`<|im_end|>`, `<|im_start|>`, EOS, ...)."""
    return [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]


def spells_a_special_token(tokenizer, content: object) -> bool:
    """Return True when `content` is text that holds the spelling of one of the tokenizer's special tokens."""
    return isinstance(content, str) and any(spelling in content for spelling in special_spellings(tokenizer))


def observation_ids(tokenizer, observation: list[dict], after_eos: bool, eos_ids: Sequence[int]) -> list[int]:
    """Return the token ids that follow a model's turn: the template's turn end, `observation`, the next turn's opening.

    Rendered through the chat template (`render_messages`) after a sentinel assistant turn and cut
    at the sentinel, so the text is the template's own. When the model's turn already ended with an
    EOS token (`after_eos`), the template's closing EOS is not written twice.

    An observation is text from outside (a tool's output, a page an environment fetched), and the
    chat's control tokens must stay the template's: a tool printing `<|im_end|>` then
    `<|im_start|>user` would otherwise write a user turn. So a message whose content spells a
    special token is tokenised in pieces: the template's text around it with its control tokens,
    the content as plain text (`split_special_tokens`). Any other observation is tokenised whole,
    as the chat template's text, its ids unchanged.
    """
    forged = {
        index for index, message in enumerate(observation) if spells_a_special_token(tokenizer, message.get("content"))
    }
    shown = [
        {**message, "content": CONTENT_MARK.format(index)} if index in forged else message
        for index, message in enumerate(observation)
    ]
    messages = [{"role": "user", "content": "."}, {"role": "assistant", "content": TEMPLATE_SENTINEL}, *shown]
    text = render_messages(tokenizer, messages).split(TEMPLATE_SENTINEL, 1)[1]
    ids = []
    # split with its group: the template's text at even positions, a marked content's index at odd ones
    for position, piece in enumerate(CONTENT_MARKS.split(text) if forged else [text]):
        if position % 2:
            content = observation[int(piece)]["content"]
            ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    if after_eos and ids and ids[0] in eos_ids:
        ids = ids[1:]
    return ids


def left_padded(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(ids, mask)` (rows, longest) left-padded with `pad_id` (mask 0) on `device`."""
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, length - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[index, length - len(row) :] = 1
    return ids.to(device), mask.to(device)


@dataclass(frozen=True)
class TurnSettings:
    """How one turn is sampled: the per-turn sampler's `generate` and the arguments every turn shares."""

    generate: Callable
    decoding: Decoding  # its max_new_tokens is a turn's (an episode's token budget may cut it shorter)
    stopping: Stopping
    compute: Compute


class EpisodeSampler:
    """A `Sampler` that runs `group_size` episodes of an environment per task row (see the module doc).

    `make_environment()` returns a fresh environment (one per episode); `generate` is a per-turn
    sampler's `generate` (`polo.generation.grouped.pick_generator`).
    """

    def __init__(self, make_environment: Callable[[], Environment], generate: Callable, limits: EpisodeLimits):
        self.make_environment, self.generate, self.limits = make_environment, generate, limits

    @torch.no_grad()
    def __call__(
        self,
        model,
        tokenizer,
        prompts: list[str],
        group_size: int,
        decoding: Decoding,
        *,
        compute: Compute = CPU,
        rows: Sequence[dict] | None = None,
    ) -> Rollouts:
        """Return the episodes, `group_size` per row of `rows`, in the one-turn layout (`prompts` are not read).

        Each episode's prompt is its environment's `reset(row)` through the chat template.
        """
        if rows is None or len(rows) != len(prompts):
            raise ValueError("the episode sampler starts every episode from its task row: pass rows, one per prompt")
        episodes = []
        for row in rows:
            for _ in range(group_size):
                environment = self.make_environment()
                rendered = render_messages(tokenizer, environment.reset(row))
                episodes.append(Episode(environment, encode_prompts(tokenizer, [rendered])[0]))
        strings = episodes[0].environment.stop_strings if episodes else ()
        stops = StopStrings(tokenizer, strings) if strings else None
        turn = TurnSettings(self.generate, decoding, Stopping.of(tokenizer, model, stops), compute)
        eos_ids = stop_token_ids(tokenizer, model)
        for turn_index in range(self.limits.max_turns):
            live = [episode for episode in episodes if episode.live]
            if not live:
                break
            self.run_turn(model, tokenizer, live, turn, group_size if turn_index == 0 else 1)
            answering = [episode for episode in live if episode.live]
            for episode, reply in zip(answering, environment_steps(answering)):
                self.answer(tokenizer, episode, reply, eos_ids)
        for episode in episodes:
            episode.truncated = episode.truncated or episode.live  # still going when the turns ran out
        return self.rollouts(tokenizer, episodes, group_size, compute.device)

    def run_turn(self, model, tokenizer, live: list[Episode], turn: TurnSettings, shared: int) -> None:
        """Sample one turn for every live episode in one batch and append it (cut at its first stop string).

        `shared` > 1 (the first turn) runs each group's common prompt once for its `shared` episodes.
        """
        contexts = [episode.prompt_ids + episode.ids for episode in live[::shared]]
        budget = max(self.limits.max_episode_tokens - len(episode.ids) for episode in live)
        ids, mask = left_padded(contexts, tokenizer.pad_token_id, turn.compute.device)
        decoding = replace(turn.decoding, max_new_tokens=min(turn.decoding.max_new_tokens, budget))
        drawn, drawn_mask, _ = turn.generate(
            model, ids, mask, decoding, turn.stopping, compute=turn.compute, samples_per_prompt=shared
        )
        stops = turn.stopping.strings
        eos_ids = set(turn.stopping.stop_ids)
        for episode, row_ids, row_mask in zip(live, drawn.tolist(), drawn_mask.tolist()):
            written = [token for token, keep in zip(row_ids, row_mask) if keep]
            cut = stops.cut_length(written) if stops is not None else None
            written = written[:cut] if cut is not None else written
            room = self.limits.max_episode_tokens - len(episode.ids)
            ended = bool(written) and (cut is not None or written[-1] in eos_ids)
            if len(written) > room or not ended:  # a length limit, not the model, ended the turn
                episode.truncated, episode.live = True, False
                written = written[:room]
            episode.extend(written, 1)
            episode.record.turns.append(self.turn_text(tokenizer, written, stops))

    @staticmethod
    def turn_text(tokenizer, ids: list[int], stops: StopStrings | None) -> str:
        """Return the text of a turn's ids, special tokens removed, nothing after its first stop string."""
        text = tokenizer.decode(ids, skip_special_tokens=True)
        end = stops.text_end(text) if stops is not None else None
        return text if end is None else text[:end]

    def answer(self, tokenizer, episode: Episode, reply: EnvStep, eos_ids: list[int]) -> None:
        """Append the environment's `reply` to the episode's last turn (its observation), or end the episode."""
        record_step(episode.record, reply)
        if reply.done or not reply.observation:
            episode.live, episode.record.done = False, reply.done
            episode.truncated = not reply.done  # nothing to show and not done: the model has nothing to answer
            return
        after_eos = bool(episode.ids) and episode.ids[-1] in eos_ids
        observed = observation_ids(tokenizer, reply.observation, after_eos, eos_ids)
        episode.record.observations.append("\n".join(str(message["content"]) for message in reply.observation))
        if len(episode.ids) + len(observed) >= self.limits.max_episode_tokens:  # no room left for the model to reply
            episode.truncated, episode.live = True, False
            return
        episode.extend(observed, 0)

    @staticmethod
    def rollouts(tokenizer, episodes: list[Episode], group_size: int, device: torch.device) -> Rollouts:
        """Return the episodes as `Rollouts`: first prompt left-padded, the rest right-padded, `loss_mask` set."""
        prompt_ids, prompt_mask = left_padded(
            [episode.prompt_ids for episode in episodes], tokenizer.pad_token_id, device
        )
        length = max(len(episode.ids) for episode in episodes)
        completion_ids = torch.full((len(episodes), length), tokenizer.pad_token_id, dtype=torch.long)
        completion_mask = torch.zeros((len(episodes), length), dtype=torch.long)
        loss_mask = torch.zeros((len(episodes), length), dtype=torch.long)
        for index, episode in enumerate(episodes):
            size = len(episode.ids)
            completion_ids[index, :size] = torch.tensor(episode.ids, dtype=torch.long)
            completion_mask[index, :size] = 1
            loss_mask[index, :size] = torch.tensor(episode.written, dtype=torch.long)
        return Rollouts(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids.to(device),
            completion_mask=completion_mask.to(device),
            truncated=torch.tensor([episode.truncated for episode in episodes], dtype=torch.bool, device=device),
            texts=[episode.record.answer for episode in episodes],
            group_size=group_size,
            loss_mask=loss_mask.to(device),
            episodes=[episode.record for episode in episodes],
        )


def episode_metrics(episodes: Sequence[EpisodeRecord], correct: Sequence[float], prefix: str = "tool/") -> dict:
    """Return the tool-use metrics of `episodes` (graded `correct`, one value per episode) under `prefix`.

    calls_per_episode, call_success_rate (of all calls; 0 when none was made), turns (the model's,
    per episode), seconds (tool time, summed), failures (summed), used_by_correct (the share of
    correct answers whose episode made a call; 0 when none was correct), episodes_with_calls.
    """
    count = max(len(episodes), 1)
    calls = sum(episode.tool_calls for episode in episodes)
    failures = sum(episode.tool_failures for episode in episodes)
    right = [episode for episode, value in zip(episodes, correct) if float(value) > 0.5]
    return {
        f"{prefix}calls_per_episode": calls / count,
        f"{prefix}call_success_rate": (calls - failures) / calls if calls else 0.0,
        f"{prefix}calls": float(calls),
        f"{prefix}failures": float(failures),
        f"{prefix}seconds": sum(episode.tool_seconds for episode in episodes),
        f"{prefix}turns": sum(len(episode.turns) for episode in episodes) / count,
        f"{prefix}episodes_with_calls": sum(episode.tool_calls > 0 for episode in episodes) / count,
        f"{prefix}used_by_correct": sum(episode.tool_calls > 0 for episode in right) / len(right) if right else 0.0,
    }
