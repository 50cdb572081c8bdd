"""Every key of a recipe, with its type, default, accepted values and help, read from the fields' metadata.

`polo config` prints it (`text`), docs/config.md is it as Markdown (`markdown`); both come from
`sections(config)`, which walks a config instance, so a command's own defaults (DPO's learning
rate, each output directory) are the ones shown.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

import yaml

from polo.config.fields import choice_names
from polo.core.registry import Registry


@dataclass(frozen=True)
class Key:
    """One recipe key as the documentation shows it."""

    key: str  # dotted, e.g. algorithm.clip_eps_high
    type: str
    default: str  # as YAML would write it
    accepts: str  # the range or the choices ("" when any value of the type is accepted)
    help: str


@dataclass(frozen=True)
class Section:
    """A recipe section: its dotted prefix ("" for a recipe's top level), what it is, and its keys."""

    key: str
    summary: str
    keys: list[Key]


def sections(config: Any, prefix: str = "") -> list[Section]:
    """Return the sections of a config instance depth first: its own keys, then each nested dataclass section.

    A list of dataclasses (`task.few_shot`) is one key, and its items' fields a section `key[]`.
    """
    hints = typing.get_type_hints(type(config))
    own: list[Key] = []
    nested: list[Section] = []
    for spec in dataclasses.fields(config):
        key, value = f"{prefix}{spec.name}", getattr(config, spec.name)
        if dataclasses.is_dataclass(value):
            nested += sections(value, f"{key}.")
            continue
        own.append(describe_key(key, hints[spec.name], value, spec.metadata))
        if isinstance(spec.metadata.get("options_of"), Registry):
            nested += entry_sections(key, spec.metadata["options_of"])
        item_type = typing.get_args(hints[spec.name])[0] if typing.get_origin(hints[spec.name]) is list else None
        if dataclasses.is_dataclass(item_type):
            nested += sections(item_type(), f"{key}[].")
    return [Section(prefix.removesuffix("."), summary(type(config)), own), *nested]


def entry_sections(key: str, registry: Registry) -> list[Section]:
    """Return the sections of the registered entries' own settings, each under `key` (their options' key)."""
    found = []
    for entry in registry.entries():
        if entry.settings is None:
            continue
        for section in sections(entry.settings(), f"{key}."):
            found.append(Section(section.key, f"({registry.kind} {entry.name}) {section.summary}", section.keys))
    return found


def describe_key(key: str, annotation: Any, value: Any, metadata: Any) -> Key:
    """Return the documentation of one key from its annotation, default value and field metadata.

    A registry's names are read from it, with what each entry registered as its help; a key used
    by some builders of a registry (`used_by`) says which.
    """
    choices, bounds, help = metadata.get("choices"), metadata.get("range"), metadata.get("help", "")
    if choices is not None:
        user_entries = isinstance(choices, Registry) and choices.user_entries
        forms = [*choice_names(choices), *(["module:name"] if user_entries else []), metadata.get("others")]
        accepts = " | ".join(form for form in forms if form)
    else:
        accepts = bounds or ""
    if isinstance(choices, Registry):
        described = [f"{entry.name}: {entry.help}" for entry in choices.entries() if entry.help]
        help = f"{help}. {'; '.join(described)}" if described else help
    if isinstance(metadata.get("used_by"), Registry):
        users = builders_taking(key.rpartition(".")[2], metadata["used_by"])
        help = f"{metadata['used_by'].kind} {', '.join(users)}: {help}" if users else help
    return Key(key, type_name(annotation), yaml_text(value), accepts, help)


def builders_taking(parameter: str, registry: Registry) -> list[str]:
    """Return the entries of `registry` whose builder takes `parameter`, or a dataclass default with that field."""
    users = []
    for entry in registry.entries():
        try:
            parameters = inspect.signature(entry.value).parameters.values()
        except (TypeError, ValueError):
            continue
        for candidate in parameters:
            default = candidate.default
            nested = dataclasses.is_dataclass(default) and not isinstance(default, type)
            if candidate.name == parameter or (
                nested and parameter in {spec.name for spec in dataclasses.fields(default)}
            ):
                users.append(entry.name)
                break
    return users


def summary(cls: type) -> str:
    """Return a dataclass's docstring as one paragraph."""
    return " ".join((cls.__doc__ or "").split())


def type_name(annotation: Any) -> str:
    """Return an annotation as a reader writes it: `int | None`, `list[str]`, `dict[str, float]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(arg) for arg in args)}]"
    if annotation is type(None):
        return "None"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def yaml_text(value: Any) -> str:
    """Return `value` as YAML writes it on one line (null, true, 1.0e-06, [tensorboard])."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, allow_unicode=True).strip()
    return text.removesuffix("...").strip()


def find(all_sections: list[Section], wanted: str) -> list[Section]:
    """Return the sections a `polo config` argument names: a section and those under it, or the section holding a key.

    An empty argument names every section; a key comes back as a section holding that key alone.
    """
    wanted = wanted.strip().rstrip(".")
    if not wanted:
        return all_sections
    under = [section for section in all_sections if section.key == wanted or section.key.startswith(f"{wanted}.")]
    if under:
        return under
    for section in all_sections:
        for key in section.keys:
            if key.key == wanted:
                return [Section(section.key, section.summary, [key])]
    return []


def text(all_sections: list[Section], width: int = 100) -> str:
    """Return sections as plain text: a heading per section, then each key, its default, range and help."""
    lines: list[str] = []
    for section in all_sections:
        if not section.keys and section.key:
            continue
        heading = f"[{section.key}] " if section.key else ""
        lines += ["", *textwrap.wrap(f"{heading}{section.summary}", width, subsequent_indent="  ")]
        for key in section.keys:
            accepts = f"  ({key.accepts})" if key.accepts else ""
            lines.append(f"  {key.key}: {key.type} = {key.default}{accepts}")
            lines += textwrap.wrap(key.help, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines).strip("\n")


def markdown(title: str, all_sections: list[Section]) -> str:
    """Return sections as Markdown: a heading per section, its summary, and a table of its keys."""
    lines = [f"## {title}", ""]
    for section in all_sections:
        if not section.keys and section.key:
            continue
        if section.key:
            lines += [f"### `{section.key}`", ""]
        lines += [section.summary, ""]
        if not section.keys:
            continue
        lines += ["| key | type | default | accepts | help |", "|---|---|---|---|---|"]
        lines += [
            f"| `{key.key}` | {cell(key.type)} | `{cell(key.default)}` | {cell(key.accepts)} | {cell(key.help)} |"
            for key in section.keys
        ]
        lines.append("")
    return "\n".join(lines)


def cell(value: str) -> str:
    """Return `value` safe inside a Markdown table cell (pipes and tag openings escaped)."""
    return value.replace("|", "\\|").replace("<", "\\<")
