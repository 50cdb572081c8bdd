"""LM environments: the registry, the one-turn and Python-tool environments, and the sampler a config asks for.

An environment (`polo.generation.episodes.Environment`) opens an episode with `reset(row)` and
answers each of the model's turns with `step(text)`. `ChatEnvironment` is the base the built-ins
share: its `reset` asks the row's question the way `Task.prompts` does (instruction, system prompt,
worked examples), and a worked example whose response holds tool calls is played through the
environment itself, so the example shows the real observations. `task.environment.name` names a
registered environment or `module:Name` (a class the module registers with `@register_environment`).
docs/tools.md has the interface, a worked custom environment and the safety model.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from polo.config import Config, ConfigError
from polo.config.plugins import resolve
from polo.config.validation import option_keywords
from polo.core.registry import ENVIRONMENTS, register_environment
from polo.generation.episodes import EnvStep, EpisodeLimits, EpisodeSampler
from polo.generation.grouped import pick_generator, pick_sampler
from polo.generation.prompts import prompt_messages
from polo.generation.rollouts import Sampler
from polo.sandbox.runner import SandboxLimits, run_python

if TYPE_CHECKING:
    from polo.data.base import Task
    from polo.runtime.device import Compute


@dataclass(frozen=True)
class EnvironmentSettings:
    """What every environment of a run is built with: how to ask the question, and the tools' limits."""

    instruction: str = "{question}"
    system_prompt: str | None = None
    few_shot: tuple[tuple[str, str], ...] = ()
    tools: bool = True  # false: every tool call is answered "the tool is off"
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    max_output_chars: int = 200


class ChatEnvironment:
    """The one-turn environment, and the base of the others: `reset` asks the question, `step` ends the episode.

    A subclass that answers mid-reply sets `stop_strings` and overrides `step`.
    """

    stop_strings: tuple[str, ...] = ()
    _examples: dict = {}  # per (class, settings): worked examples played through the environment once

    def __init__(self, settings: EnvironmentSettings | None = None):
        self.settings = settings if settings is not None else EnvironmentSettings()

    def reset(self, row: dict) -> list[dict]:
        """Return the messages that ask `row["question"]`: system prompt, the worked examples as turns, the question."""
        settings = self.settings
        messages = prompt_messages(row["question"], settings.instruction, settings.system_prompt)
        question = messages.pop()
        key = (type(self), settings)
        if key not in ChatEnvironment._examples:
            ChatEnvironment._examples[key] = [
                message for example in settings.few_shot for message in self.example_messages(*example)
            ]
        return [*messages, *ChatEnvironment._examples[key], question]

    def example_messages(self, question: str, response: str) -> list[dict]:
        """Return a worked example as turns: the question, then the response cut at each stop string.

        Each cut turn is answered by `step`, so the example shows the real observations.
        """
        messages = prompt_messages(question, self.settings.instruction)[-1:]
        rest = response
        while True:
            ends = [rest.find(stop) + len(stop) for stop in self.stop_strings if stop in rest]
            turn, rest = (rest[: min(ends)], rest[min(ends) :].lstrip("\n")) if ends else (rest, "")
            messages.append({"role": "assistant", "content": turn})
            answer = self.step(turn)
            if answer.done or not answer.observation or not rest:
                return messages
            messages.extend(answer.observation)

    def step(self, assistant_text: str) -> EnvStep:
        """Return the end of the episode: one turn, judged by the task's rewards."""
        return EnvStep(done=True)


register_environment("one_turn", help="the question, one reply, judged by the rewards")(ChatEnvironment)

TOOL_CALL = re.compile(r"<python>(.*?)</python>", re.DOTALL)


def with_last_value_printed(code: str) -> str:
    """Return `code` with its last line printed when it is a bare expression (as a REPL shows `47 * 38`).

    Parsed here, never run here; code that does not parse is returned unchanged for the sandbox to report.
    """
    try:
        body = ast.parse(code).body
        if not body or not isinstance(body[-1], ast.Expr):
            return code
        last = body[-1].value
        if isinstance(last, ast.Call) and getattr(last.func, "id", None) == "print":
            return code
        head, value = ast.unparse(ast.Module(body=body[:-1], type_ignores=[])), ast.unparse(last)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code
    return f"{head}\n__value = ({value.strip()})\nif __value is not None:\n    print(repr(__value))\n"


def tool_output(result, max_chars: int) -> tuple[str, bool]:
    """Return (the text the model is shown, whether the call failed): stdout, or the error's last line, cut short."""
    if result.ok:
        text = result.stdout.decode("utf-8", "replace").strip() or "(no output)"
    else:
        lines = [line for line in result.stderr.decode("utf-8", "replace").splitlines() if line.strip()]
        text = f"error: {lines[-1].strip() if lines and result.status == 'exit' else result.reason}"
    if len(text) > max_chars:
        text = text[:max_chars] + " ...[truncated]"
    return text, not result.ok


@register_environment("python_tool", help="<python>code</python> runs in the sandbox, its output the next turn")
class PythonToolEnvironment(ChatEnvironment):
    """The model calls Python mid-answer: `<python>code</python>` runs in the sandbox, its output is the next message.

    A turn without a call ends the episode (its text holds the final answer). Each call runs under
    the settings' `SandboxLimits` (`polo.sandbox.run_python`: no network, no file system, time,
    memory, process and output limits); whatever the code does, the model gets an observation.
    """

    stop_strings = ("</python>",)

    def step(self, assistant_text: str) -> EnvStep:
        """Return the call's output as a `tool` message, or the end of the episode when the turn makes no call."""
        calls = TOOL_CALL.findall(assistant_text)
        if not calls:
            return EnvStep(done=True)
        if not self.settings.tools:
            return EnvStep(
                [{"role": "tool", "content": "error: the python tool is off"}], tool_calls=1, tool_failures=1
            )
        result = run_python(with_last_value_printed(calls[-1]), self.settings.limits)
        text, failed = tool_output(result, self.settings.max_output_chars)
        return EnvStep(
            [{"role": "tool", "content": text}],
            tool_calls=1,
            tool_failures=int(failed),
            tool_seconds=result.duration_s,
        )


def environment_class(name: str) -> type:
    """Return the environment class `name` names (a registered name or module:Name); ConfigError when there is none."""
    return resolve("task.environment.name", name, ENVIRONMENTS).value


def make_environment(config: Config, instruction: str, few_shot: tuple) -> Callable[[], object] | None:
    """Return a function making a fresh environment of `task.environment`, or None when it names none (one turn).

    One environment is made here, so a bad `task.environment.options` is a ConfigError before any model loads.
    """
    settings = config.task.environment
    if settings.name is None:
        return None
    entry = resolve("task.environment.name", settings.name, ENVIRONMENTS)
    cls = entry.value
    built = EnvironmentSettings(
        instruction=instruction,
        system_prompt=config.task.system_prompt,
        few_shot=tuple(few_shot),
        tools=settings.tools,
        limits=SandboxLimits(timeout_s=settings.timeout_s, memory_bytes=settings.memory_mb * 2**20),
        max_output_chars=settings.max_output_chars,
    )
    options = option_keywords("task.environment.options", entry, settings.options, positional=1)

    def make() -> object:
        return cls(built, **options)

    try:
        make()
    except TypeError as error:
        raise ConfigError(f"task.environment.options: {settings.name} does not take {options}: {error}") from error
    return make


def sampler_for(config: Config, task: Task, compute: Compute) -> Sampler:
    """Return the sampler a run uses: the episode sampler over the task's environment, else the one-turn sampler."""
    if task.environment is None:
        return pick_sampler(config.sampling.sampler, compute)
    limits = EpisodeLimits(config.sampling.max_turns, config.sampling.max_episode_tokens)
    return EpisodeSampler(task.environment, pick_generator(config.sampling.sampler, compute), limits)
