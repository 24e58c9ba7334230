"""Command lines made from dataclasses: one flag per field, its ``Args:`` entry the help.

A command that has a configuration dataclass (the trainer's ``TrainConfig``, the 3-D run's
``RunShape``) writes no flag by hand: ``add_fields`` makes ``--global-batch-size`` from the field
``global_batch_size``, with the field's default, its type read from the annotation, its choices
from the owner of the vocabulary, and its help from the class docstring's ``Args:`` entry. A
field added to the class is a flag at once, documented where the field is. What no dataclass
describes (``--dry-run``, ``--plot``) stays the command's own. tyro and simple-parsing do the
same from a dataclass; this one keeps ``checks.CommandParser``'s one-line refusal (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

TYPES = {int: int, float: float, str: str}
"""What argparse turns a flag's text into, by the field's annotation (``X | None`` reads as X)."""


class DefaultsWhereTheyHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, but not for on/off switches ("--no-progress (default: True)" misleads),
    for options that are unset by default, or where the help already states the default."""

    def _get_help_string(self, action):
        if action.nargs == 0 or action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's entry in the class docstring's ``Args:`` section, on one line.

    Args:
        cls: a dataclass whose docstring has an ``Args:`` section.
    """
    docs, name = {}, None
    for line in inspect.getdoc(cls).split("Args:", 1)[1].splitlines():
        entry = re.match(r"    (\w+): (.*)", line)
        if entry:
            name, docs[entry.group(1)] = entry.group(1), entry.group(2)
        elif name and line.startswith("        "):
            docs[name] += " " + line.strip()
    return {key: text.replace("``", "") for key, text in docs.items()}


def _parser_type(annotation: Any) -> Callable[[str], Any] | None:
    """argparse's type for an annotation: int, float or str, alone or with None."""
    if annotation in TYPES:
        return TYPES[annotation]
    inside = [a for a in typing.get_args(annotation) if a is not type(None)]
    return TYPES.get(inside[0]) if len(inside) == 1 else None


def add_fields(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    groups: dict[str, str] | None = None,
    choices: dict[str, tuple] | None = None,
    options: dict[str, dict[str, Any]] | None = None,
) -> None:
    """One flag per field of ``cls``, in the order the class declares them.

    A field ``name: bool = True`` becomes ``--no-name``, one ``= False`` becomes ``--name``; any
    other field ``--name VALUE`` with the field's default.

    Args:
        parser: the command's parser.
        cls: the configuration dataclass; every field needs an ``Args:`` entry (its help).
        groups: the ``--help`` sections, each title with the first field it holds: a section
            runs until the next one starts (None: no sections).
        choices: the allowed values of some fields, from the vocabularies' owners.
        options: argparse's keywords for some fields, over what the field says: a ``type`` the
            annotation says too little about (a bounded whole number: ``checks.int_at_least``),
            a ``metavar``, ``nargs``.
    """
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    starts = {first: title for title, first in (groups or {}).items()}
    section = parser
    for field in dataclasses.fields(cls):
        name = field.name
        if name in starts:
            section = parser.add_argument_group(starts[name])
        if name not in docs:
            raise TypeError(f"{cls.__name__}.{name} has no Args: entry: its flag would have no help")
        if hints[name] is bool:  # a switch: its flag says the other way
            flag = f"--no-{name}" if field.default else f"--{name}"
            action = "store_false" if field.default else "store_true"
            section.add_argument(flag.replace("_", "-"), dest=name, action=action, help=docs[name])
            continue
        given = {
            "default": field.default,
            "help": docs[name],
            "type": _parser_type(hints[name]),
            "choices": (choices or {}).get(name),
            **(options or {}).get(name, {}),
        }
        flag = "--" + name.replace("_", "-")
        section.add_argument(flag, **{key: value for key, value in given.items() if value is not None})


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass the parsed flags describe (flags that are not its fields are left out).

    Args:
        cls: the configuration dataclass ``add_fields`` made the flags from.
        args: what the parser returned.
    """
    names = {field.name for field in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in vars(args).items() if name in names})
