"""Registries: every pluggable kind of part by name, so a recipe is data and the code never branches on it.

One mechanism, `Registry`, holds each kind:

    ADVANTAGE_ESTIMATORS  (AdvantageInputs, settings) -> (advantages (batch, seq), returns | None)
    POLICY_LOSSES         (PolicyLossInputs, settings) -> (per_token (batch, seq), stats)
    LOSS_AGGREGATIONS     (per_token, mask, LossNormalisers) -> scalar
    KL_ESTIMATORS         (logprobs, ref_logprobs) -> (batch, seq)
    TASKS                 builder (**options) -> polo.data.Task
    REWARDS               task -> reward function (completion, row) -> float
    CHECKERS              (completion, row, answer_in_tags) -> 1.0 | 0.0
    MODELS                the built-in models polo fetches itself (polo.models.loading.BuiltinModel)
    SAMPLERS              compute -> the sampler module (rollout, generate) for that device
    ENVIRONMENTS          LM environment classes (polo.data.environments)
    CONTROL_ALGORITHMS    OnPolicyAlgorithm classes (polo.control)
    COMMANDS              the `polo` command line's commands (polo.cli)

`settings` is the recipe's `algorithm` section (`polo.config.AlgorithmConfig`), so a new estimator
or loss reads its knobs from there and the loop that calls it does not change.

An entry may own a settings dataclass (`register(name, settings=...)`, its fields declared with
`polo.config.setting`): a recipe gives its values as options beside the name (`algorithm.policy_loss`
+ `algorithm.policy_loss_options`, `task.name` + `task.options`), they are checked like every other
key, `polo config` shows them, and the entry is called with the built dataclass as `options=`.
An entry without one takes its options as keyword arguments, checked against its signature.

A user adds one with a decorator in their own module::

    from polo.core import register_advantage

    @register_advantage("centered")
    def centered(inputs, settings):
        advantages = inputs.rewards - inputs.rewards.mean()
        return advantages[:, None] * inputs.mask, None

and names it in a recipe as ``algorithm.advantage_estimator: my_module:centered`` (polo imports
``my_module`` first, which runs the decorator). Tasks and rewards may also be named as a module's
attribute without registering (``task.name: my_tasks:Reverse``). Built-in parts register themselves
where they are defined; a registry whose built-ins live above `polo.core` names the package that
defines them (`home`) and imports it the first time it is read, so `polo.config` can list and check
the names without importing the layers above it.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return " (did you mean 'X'?)" for the candidate closest to `word` (difflib's ratio >= 0.75), else ""."""
    close = difflib.get_close_matches(word, [str(candidate) for candidate in candidates], n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True)
class Registered:
    """One registered part (a function, a class or data) and what the code around it must know of it."""

    name: str
    value: Any
    needs_critic: bool = False  # the estimator reads critic values (PPO's GAE): the loop builds a critic
    token_level: bool = False  # the estimator takes per-token rewards, so the KL can be folded into them
    settings: type | None = None  # the entry's own options, a dataclass of `polo.config.setting` fields
    help: str = ""  # what it is, in a few words (and the paper it comes from), for `polo config` and docs

    @property
    def function(self) -> Any:
        """Return the registered part (the name predates registries of classes and data)."""
        return self.value


class Registry:
    """A name -> part table of one kind; an unknown name gets an error naming the closest and the registered ones.

    `home` is the package whose import registers the built-in entries (None: they register where the
    registry is defined); it is imported the first time the registry is read. `by_attribute`: a
    recipe's ``module:Name`` may name any attribute of the module, registered or not (tasks, rewards);
    otherwise the module must register `Name`. `user_entries`: whether a recipe may name a user's
    ``module:name`` at all (no for built-in models and samplers).
    """

    def __init__(self, kind: str, *, home: str | None = None, by_attribute: bool = False, user_entries: bool = True):
        self.kind = kind
        self.home = home
        self.by_attribute = by_attribute
        self.user_entries = user_entries
        self._entries: dict[str, Registered] = {}
        self._home_loaded = home is None

    def register(
        self, name: str, *, settings: type | None = None, help: str = "", **flags: bool
    ) -> Callable[[Any], Any]:
        """Return a decorator that registers its function (or class, or object) under `name`; re-registering
        replaces it."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"a {self.kind} needs a non-empty name without ':', got {name!r}")

        def decorate(value: Any) -> Any:
            self._entries[name] = Registered(name, value, settings=settings, help=help, **flags)
            return value

        return decorate

    def _entries_loaded(self) -> dict[str, Registered]:
        """Return the entries, the home package imported first (once: a registry read during that import sees the
        entries registered so far)."""
        if not self._home_loaded:
            self._home_loaded = True
            try:
                importlib.import_module(self.home)
            except BaseException:
                self._home_loaded = False  # read again, it fails again, rather than seeming empty
                raise
        return self._entries

    def entry(self, name: str) -> Registered:
        """Return the registration of `name` (or of "module:name"), or raise ValueError naming the registered ones.

        A "module:name" reference is looked up by its name alone: importing the module, which
        registers it, is the configuration's job (`polo.config.plugins`).
        """
        short = self._short(name)
        entries = self._entries_loaded()
        if short not in entries:
            raise ValueError(self.unknown(name))
        return entries[short]

    def unknown(self, name: str) -> str:
        """Return the one line an unknown `name` gets: the closest registered name, then all of them."""
        own = " (or module:name for your own)" if self.user_entries else ""
        return (
            f"{name!r} is not a registered {self.kind}{did_you_mean(name, self.names())}; "
            f"registered: {', '.join(self.names())}{own}"
        )

    def __getitem__(self, name: str) -> Any:
        return self.entry(name).value

    def __setitem__(self, name: str, value: Any) -> None:
        self.register(name)(value)

    def __delitem__(self, name: str) -> None:
        del self._entries_loaded()[name]

    def get(self, name: str, default: Any = None) -> Any:
        """Return the part registered as `name`, or `default` (a registry reads like a mapping of name -> part)."""
        entries = self._entries_loaded()
        return entries[self._short(name)].value if name in self else default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._short(name) in self._entries_loaded()

    def _short(self, name: str) -> str:
        """Return the name a reference is registered under: "module:name" -> name, where user entries exist."""
        return name.rpartition(":")[2] if self.user_entries else name

    def __iter__(self):
        return iter(list(self._entries_loaded()))

    def __len__(self) -> int:
        return len(self._entries_loaded())

    def names(self) -> list[str]:
        """Return the registered names in the order they were registered (built-ins first)."""
        return list(self._entries_loaded())

    def entries(self) -> list[Registered]:
        """Return the registrations in the order they were made."""
        return list(self._entries_loaded().values())


ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
LOSS_AGGREGATIONS = Registry("loss aggregation")
KL_ESTIMATORS = Registry("KL estimator")
TASKS = Registry("task", home="polo.data", by_attribute=True)
REWARDS = Registry("reward", home="polo.rewards", by_attribute=True)
CHECKERS = Registry("answer checker", home="polo.rewards")
MODELS = Registry("built-in model", home="polo.models.loading", user_entries=False)
SAMPLERS = Registry("sampler", home="polo.generation.grouped", user_entries=False)
ENVIRONMENTS = Registry("LM environment", home="polo.data")
CONTROL_ALGORITHMS = Registry("control algorithm", home="polo.control")
COMMANDS = Registry("command", home="polo.cli", user_entries=False)


def register_advantage(
    name: str, *, needs_critic: bool = False, token_level: bool = False, settings: type | None = None, help: str = ""
) -> Callable[[Callable], Callable]:
    """Register an advantage estimator `(AdvantageInputs, settings) -> (advantages, returns | None)`."""
    return ADVANTAGE_ESTIMATORS.register(
        name, needs_critic=needs_critic, token_level=token_level, settings=settings, help=help
    )


def register_policy_loss(name: str, *, settings: type | None = None, help: str = "") -> Callable[[Callable], Callable]:
    """Register a policy loss `(PolicyLossInputs, settings) -> (per_token (batch, seq), stats)`.

    `per_token` is 0 at padding. `stats` holds detached float sums the loop adds up over
    micro-batches and ranks; it reports `clip_low_count` and `clip_high_count` (tokens clipped
    below and above) as `clip_fraction/low` and `/high` when the loss gives them. A loss with
    `settings` (a dataclass) is called `(inputs, settings, options=<that dataclass>)`, its values
    from `algorithm.policy_loss_options`; a loss without takes those options as keyword arguments.
    """
    return POLICY_LOSSES.register(name, settings=settings, help=help)


def register_aggregation(name: str, *, help: str = "") -> Callable[[Callable], Callable]:
    """Register a loss aggregation `(per_token, mask, LossNormalisers) -> scalar`."""
    return LOSS_AGGREGATIONS.register(name, help=help)


def register_kl(name: str, *, help: str = "") -> Callable[[Callable], Callable]:
    """Register a per-token KL estimator `(logprobs, ref_logprobs) -> (batch, seq)`."""
    return KL_ESTIMATORS.register(name, help=help)


def register_task(name: str, *, settings: type | None = None, help: str = "") -> Callable[[Any], Any]:
    """Register a task builder (a function or a `polo.data.Task` subclass) returning a `Task`.

    Its parameters are filled from the `task` section's keys of the same name (`num_train`,
    `train_path`, ...; a parameter whose default is a dataclass is built from the keys named like its
    fields) and from `task.options`; a parameter without a default is a key the task needs.
    """
    return TASKS.register(name, settings=settings, help=help)


def register_reward(name: str, *, per_task: bool = False, help: str = "") -> Callable[[Any], Any]:
    """Register a reward function `(completion, row) -> float` (per_task: a factory `task -> reward function`,
    as the task's own correctness is); returns the function unchanged."""

    def decorate(function: Any) -> Any:
        REWARDS.register(name, help=help)(function if per_task else _ignoring_task(function))
        return function

    return decorate


def _ignoring_task(reward: Any) -> Callable[[Any], Any]:
    """Return a factory that gives `reward` whatever the task."""
    return lambda task: reward


def register_sampler(name: str, *, help: str = "") -> Callable[[Callable], Callable]:
    """Register a sampler: a function `compute -> the sampler module` (its `rollout` and `generate`) for a device."""
    return SAMPLERS.register(name, help=help)


def register_environment(name: str, *, settings: type | None = None, help: str = "") -> Callable[[type], type]:
    """Return a class decorator that registers an LM environment class under `name` (`task.environment.name`).

    The class is built `(EnvironmentSettings, **options)`, or with `options=` its settings dataclass.
    """
    return ENVIRONMENTS.register(name, settings=settings, help=help)


def register_control_algorithm(name: str, *, help: str = "") -> Callable[[type], type]:
    """Return a class decorator that registers an `OnPolicyAlgorithm` as `polo control`'s `algorithm.name: name`."""
    return CONTROL_ALGORITHMS.register(name, help=help)


def register_command(name: str, *, help: str = "") -> Callable[[Any], Any]:
    """Register a `polo` command (what it registers is the command line's business, `polo.cli`)."""
    return COMMANDS.register(name, help=help)


def register_checker(name: str, *, help: str) -> Callable[[Callable], Callable]:
    """Register an answer checker `(completion, row, answer_in_tags=False) -> 1.0 | 0.0`; `help` says what it
    accepts as the same answer."""
    return CHECKERS.register(name, help=help)


@dataclass
class AdvantageInputs:
    """What the loop hands every advantage estimator for one batch of whole groups.

    rewards (batch,) total reward per completion; mask (batch, seq) 1 on completion tokens;
    groups of `group_size` rows are contiguous. `kl` (batch, seq) is the per-token KL to the
    reference when `algorithm.kl_in_reward` folds it into the rewards (else None); `values`
    (batch, seq) are the critic's values before the update (None without a critic). `scored`
    (batch,) bool is False for a completion no reward applied to (every TRL-form reward returned
    None), None when every completion was scored; `grpo` leaves those out of its group statistics.
    `reward_columns` (batch, K) are the K terms `rewards` sums, each unweighted (NaN where a reward did not
    apply), and `reward_weights` (K,) their weights, for estimators that treat the rewards apart (`gdpo`).
    """

    rewards: torch.Tensor
    mask: torch.Tensor
    group_size: int
    kl: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scored: torch.Tensor | None = None
    reward_columns: torch.Tensor | None = None
    reward_weights: torch.Tensor | None = None


@dataclass
class PolicyLossInputs:
    """What the loop hands every policy loss for one micro-batch.

    logprobs (batch, seq) under the policy being trained, with gradient; old_logprobs (batch, seq)
    under the policy that sampled, without (the same values as logprobs when the update is
    on-policy); advantages (batch,) per sequence or (batch, seq) per token; mask (batch, seq) 1 on
    the tokens the loss counts.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class LossNormalisers:
    """The counts a loss aggregation divides by, each for the whole optimizer step: every micro-batch of gradient
    accumulation on every rank (`polo.core.distributed.global_count`)."""

    num_sequences: float
    num_tokens: float  # valid tokens
    max_completion_length: int  # sampling.max_new_tokens
    num_micro_batches: float = 1.0
