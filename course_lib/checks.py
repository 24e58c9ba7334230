"""Checking what a user passes at the front door, before any process starts or meets.

A value that makes no sense fails far from where it was typed if nobody checks it: a NaN
learning rate trains to a NaN loss and exits 0, a negative timeout reaches the rendezvous and
ends in a C++ stack dump, a file given where a folder is expected ends in a Python traceback
after minutes of training. Checked here, each ends at once in one line that names the flag, the
value and what a valid value looks like, and exits with status 2.

Each check is a function ``check_*(flag, value, ...)`` that returns the value (converted) or
raises ``UserError``. The training command runs them in ``trainer.validate_config`` (so a
``TrainConfig`` built in Python is checked the same way); the other commands turn them into
argparse types with ``argument_type``, so argparse reports the mistake in its usual way.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
import tempfile
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import EXIT_USER_ERROR, UserError

MAX_SEED = 2**32 - 1
"""The largest seed: numpy and Python's ``random`` take seeds up to this, and torch's generator too."""
MAX_LEARNING_RATE = 1e6
"""Far above any learning rate that trains; a larger one is a typo (a missing minus in 1e-3)."""


def launched_rank() -> str:
    """This process's rank as its launcher set it (torchrun's RANK, else srun's), before any rendezvous."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


class CommandParser(argparse.ArgumentParser):
    """argparse that reports a mistake in one line, once (not once per rank), with exit status 2."""

    def error(self, message: str):
        if launched_rank() == "0":
            print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)


def _shown(flag: str | None) -> str:
    return f"{flag} " if flag else ""


def check_int(flag: str | None, value: Any, *, minimum: int, maximum: int | None = None) -> int:
    """A whole number in ``minimum .. maximum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{_shown(flag)}must be a whole number, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f"from {minimum} to {maximum}" if maximum is not None else f"{minimum} or more"
        raise UserError(f"{_shown(flag)}must be a whole number, {allowed}, got {value}")
    return value


def check_number(
    flag: str | None,
    value: Any,
    *,
    above: float | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float:
    """A finite real number: ``> above``, ``>= minimum``, ``<= maximum`` (each bound optional)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{_shown(flag)}must be a number, got {value!r}")
    rules = [f"above {above:g}"] if above is not None else []
    rules += [f"at least {minimum:g}"] if minimum is not None else []
    rules += [f"at most {maximum:g}"] if maximum is not None else []
    wanted = "a finite number" + (" " + " and ".join(rules) if rules else "")
    if (
        not math.isfinite(value)
        or (above is not None and not value > above)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        raise UserError(f"{_shown(flag)}must be {wanted}, got {value}")
    return float(value)


def check_flag(name: str, value: Any) -> bool:
    """True or False. A string is never read as one: ``"false"`` is truthy, and would turn a
    feature on that its user meant to turn off."""
    if not isinstance(value, bool):
        raise UserError(f"{name} must be True or False, got {value!r}")
    return value


def check_instance(name: str, value: Any, kind: type) -> Any:
    """An instance of ``kind`` (a ``Layout`` where a layout is expected, not its name or a dict)."""
    if not isinstance(value, kind):
        raise UserError(f"{name} must be a {kind.__name__}, got {type(value).__name__} {value!r:.60}")
    return value


def _fits(value: Any, annotation: Any) -> bool:
    """Whether ``value`` is of the type ``annotation`` names (bool is not a number; a float is finite)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_fits(value, member) for member in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    origin = typing.get_origin(annotation) or annotation
    return isinstance(value, origin) if isinstance(origin, type) else True


def _kind(annotation: Any) -> str:
    """What a value of the type ``annotation`` names is called in a message."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_kind(member) for member in typing.get_args(annotation))
    names = {type(None): "None", bool: "True or False", int: "a whole number", float: "a finite number"}
    if annotation in names:
        return names[annotation]
    origin = typing.get_origin(annotation) or annotation
    return f"a {origin.__name__}" if isinstance(origin, type) else str(annotation)


def check_fields(
    instance: Any, *, minimum: dict[str, float] | None = None, above: dict[str, float] | None = None
) -> None:
    """Every field of a dataclass held to its annotation and bounds, or one ``UserError`` naming
    the class, the field, the value and a valid example: the one type check of every public
    dataclass (``Layout``, ``ModelSpec``, ``ClusterSpec``...), rather than a copy per class.

    Args:
        instance: the dataclass just built (called from its ``__post_init__``).
        minimum: fields that must be at least a value (``{"data": 1}``).
        above: fields that must be more than a value (``{"bandwidth": 0}``).
    """
    cls = type(instance)
    hints = typing.get_type_hints(cls)
    minimum, above = minimum or {}, above or {}
    for field in dataclasses.fields(instance):
        value, annotation = getattr(instance, field.name), hints[field.name]
        low, strictly = (above[field.name], True) if field.name in above else (minimum.get(field.name), False)
        wrong_type = not _fits(value, annotation)
        out_of_bounds = (
            not wrong_type
            and low is not None
            and value is not None
            and (value <= low if strictly else value < low)
        )
        if not (wrong_type or out_of_bounds):
            continue
        kind = _kind(annotation)
        if low is not None and annotation is int:  # the words of check_int
            kind += f", {low:g} or more"
        elif low is not None:
            kind += f", {'above' if strictly else 'at least'} {low:g}"
        example = field.default if field.default is not dataclasses.MISSING else None
        if example is None or not _fits(example, annotation):
            example = {bool: True, str: field.name}.get(annotation, low + 1 if strictly else low)
        shown = f" (e.g. {cls.__name__}(..., {field.name}={example!r}))" if example is not None else ""
        raise UserError(f"{cls.__name__} {field.name} must be {kind}, got {value!r}{shown}")


def _exists(path: Path) -> bool:
    """``path.exists()``, where a name too long for the file system is a path that does not exist."""
    try:
        return path.exists()
    except OSError:  # ENAMETOOLONG: the write checks below name the limit
        return False


def _nearest_existing(path: Path) -> Path:
    while not _exists(path) and path != path.parent:
        path = path.parent
    return path


def _given(flag: str | None, path: str | os.PathLike) -> Path:
    """A path that is not empty ("" would mean the current folder, never what was meant)."""
    if not str(path).strip():
        raise UserError(f"{_shown(flag)}is empty: name a path")
    return Path(path)


def check_folder_to_read(flag: str | None, path: str | os.PathLike) -> Path:
    """A path that, if it exists, is a folder (whether it must exist is the caller's business)."""
    path = _given(flag, path)
    if _exists(path) and not path.is_dir():
        raise UserError(f"{_shown(flag)}{path} is a file, but a folder is expected: name a folder instead")
    return path


def check_existing_folder(flag: str | None, path: str | os.PathLike) -> Path:
    """A folder that exists."""
    path = check_folder_to_read(flag, path)
    if not path.is_dir():
        raise UserError(f"{_shown(flag)}{path} does not exist: check the path")
    return path


def check_file_to_read(flag: str | None, path: str | os.PathLike) -> Path:
    """A file that exists."""
    path = _given(flag, path)
    if _exists(path) and path.is_dir():
        raise UserError(f"{_shown(flag)}{path} is a folder, but a file is expected: name the file inside it")
    if not _exists(path) or not path.is_file():
        raise UserError(f"{_shown(flag)}{path} does not exist: check the path")
    return path


INSIDE_A_FOLDER = 64
"""Room kept for the names a command writes inside a folder it is given (``step-00000120.<run>.tmp/
__0_0.distcp``), so that the file system's limit on a whole path is met by them too."""


def _short(path: Path | str) -> str:
    text = str(path)
    return text if len(text) <= 80 else f"{text[:40]}...{text[-20:]}"


def _check_name_lengths(flag: str | None, path: Path, existing: Path, room: int) -> None:
    """Refuse names the file system would refuse (ENAMETOOLONG), before anything is written."""
    name_max = os.pathconf(existing, "PC_NAME_MAX")
    path_max = os.pathconf(existing, "PC_PATH_MAX")
    for part in path.absolute().parts[len(existing.parts) :]:
        size = len(os.fsencode(part))
        if size > name_max:
            raise UserError(
                f"{_shown(flag)}{_short(path)} cannot be created: the name {_short(part[:24])}... is {size} "
                f"bytes long, more than the {name_max} this file system allows; choose a shorter name"
            )
    length = len(os.fsencode(str(path.absolute())))
    if length + room > path_max:
        raise UserError(
            f"{_shown(flag)}{_short(path)} cannot be created: its path is {length} bytes long"
            f"{' (plus the names written inside it)' if room else ''}, more than the {path_max} this file "
            "system allows; choose a shorter path"
        )


def _check_can_write_in(flag: str | None, path: Path, what: str, folder: Path, room: int = 0) -> None:
    """Can this process write ``path`` in ``folder``? Asks the nearest existing folder; leaves nothing."""
    existing = _nearest_existing(folder.absolute())
    if not existing.is_dir():
        raise UserError(
            f"{_shown(flag)}{path} cannot be {what}: {existing} is a file; choose another location"
        )
    _check_name_lengths(flag, path, existing, room)
    try:
        # Permission bits do not stop root, but a read-only file system or /proc does: the only
        # honest test of "can I write here" is to write (a temporary file, removed at once).
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-test-"):
            pass
    except OSError as error:
        raise UserError(
            f"{_shown(flag)}{path} cannot be written ({error.strerror} in {existing}): choose a location you "
            "can write to"
        ) from None


def check_folder_to_write(flag: str | None, path: str | os.PathLike) -> Path:
    """A folder this process can write into, or create (the command creates it when it writes)."""
    path = check_folder_to_read(flag, path)
    _check_can_write_in(flag, path, "a folder", folder=path, room=INSIDE_A_FOLDER)
    return path


def check_file_to_write(flag: str | None, path: str | os.PathLike) -> Path:
    """A file this process can create or append to; its folder is created here, so that every
    writer may write it as it is (``plan --json new-folder/out.json``)."""
    path = _given(flag, path)
    if _exists(path) and path.is_dir():
        raise UserError(f"{_shown(flag)}{path} is a folder, but a file is expected: name a file inside it")
    _check_can_write_in(flag, path, "a file", folder=path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"{_shown(flag)}cannot create the folder of {path}: {error.strerror}") from None
    return path


def check_suffix(flag: str | None, path: str | os.PathLike, suffixes: tuple[str, ...], what: str) -> Path:
    """A file name ending as its writer writes it (``.png`` for a picture, ``.json`` for data)."""
    path = Path(path)
    if path.suffix.lower() not in suffixes:
        named = " or ".join(suffixes[:4]) + (" ..." if len(suffixes) > 4 else "")
        raise UserError(f"{_shown(flag)}{path} must end in {named}: the name says what {what} it holds")
    return path


def check_not_binary(flag: str | None, path: str | os.PathLike, what: str) -> Path:
    """A file to read whose first bytes are text, not a picture or an archive given by mistake."""
    path = check_file_to_read(flag, path)
    with open(path, "rb") as file:
        head = file.read(512)
    if b"\0" in head or head.startswith((b"\x89PNG", b"%PDF", b"PK\x03\x04", b"\xff\xd8\xff")):
        raise UserError(f"{_shown(flag)}{path} is not {what}: its first bytes are binary (a picture?)")
    return path


def argument_type(
    check: Callable[..., Any], convert: Callable[[str], Any] = str, **limits: Any
) -> Callable[[str], Any]:
    """``check`` as an argparse ``type=``: argparse then says ``argument --flag: must be ..., got ...``."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            kind = {int: "a whole number", float: "a number"}.get(convert, "a value")
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
        try:
            return check(None, value, **limits)
        except UserError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def learning_rate(text: str) -> float:
    """argparse type: a learning rate, finite, above 0 and at most ``MAX_LEARNING_RATE``."""
    return argument_type(check_number, float, above=0, maximum=MAX_LEARNING_RATE)(text)


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """argparse type: a whole number in ``minimum .. maximum``."""
    return argument_type(check_int, int, minimum=minimum, maximum=maximum)


def number_above(bound: float) -> Callable[[str], float]:
    """argparse type: a finite number strictly above ``bound``."""
    return argument_type(check_number, float, above=bound)


folder_to_write = argument_type(check_folder_to_write)
folder_to_read = argument_type(check_folder_to_read)
file_to_write = argument_type(check_file_to_write)
file_to_read = argument_type(check_file_to_read)
existing_folder = argument_type(check_existing_folder)


def named_file(suffixes: tuple[str, ...], what: str, *, to_write: bool) -> Callable[[str], Path]:
    """argparse type: a file whose name ends in one of ``suffixes`` (``what`` it holds), to write, or
    to read (then its first bytes must be text)."""

    def check(flag: str | None, path: str | os.PathLike) -> Path:
        path = check_file_to_write(flag, path) if to_write else check_not_binary(flag, path, what)
        return check_suffix(flag, path, suffixes, what)

    return argument_type(check)


json_to_write = named_file((".json",), "data", to_write=True)
json_to_read = named_file((".json",), "data", to_write=False)


def read_csv_rows(path: str | os.PathLike, *, what: str, columns: tuple[str, ...]) -> list[tuple[int, dict]]:
    """The rows of a CSV a user gave, each with its line number, once the file reads and has ``columns``.

    Args:
        path: the CSV file.
        what: what its rows are, for the messages (``"layouts"``).
        columns: the columns it must have (it may have more).
    """
    try:  # utf-8-sig: a spreadsheet's CSV starts with a byte-order mark, which is not a column's name
        with open(path, newline="", encoding="utf-8-sig") as file:
            rows = list(csv.DictReader(file))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise UserError(f"cannot read the {what} {path}: {error}") from error
    if not rows:
        raise UserError(f"{path} has no {what}")
    missing = [column for column in columns if column not in rows[0]]
    if missing:
        raise UserError(f"{path} has no column {', '.join(missing)}")
    numbered = list(enumerate(rows, start=2))  # line 1 holds the column names
    for line, row in numbered:
        short = [column for column, value in row.items() if value is None]
        if short:
            raise UserError(f"{path} line {line} is cut short: it has no {', '.join(short)}")
        if None in row:  # DictReader keeps the fields beyond the header under None
            raise UserError(
                f"{path} line {line} has {len(row[None])} more fields than the header's columns: "
                "quote a field that holds a comma"
            )
    return numbered


def exit_with(main: Callable[[], int | None]) -> None:
    """Run a command's ``main`` and exit with its status: a ``UserError`` it raises is one line and
    status 2. A reader that stops early (``| head``) closes the pipe: the command then ends
    quietly, with status 1, rather than with a traceback.

    Args:
        main: the command's main function, which returns its exit status.
    """
    try:
        try:
            status = main()
        except SystemExit as stop:  # argparse exits from inside main (--help, a refused flag)
            status = stop.code
        except UserError as error:  # a mistake a command did not catch itself: still one line
            print(f"error: {error}", file=sys.stderr, flush=True)
            status = EXIT_USER_ERROR
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's own flush at exit
    except BrokenPipeError:
        # Python's advice (the signal module's note on SIGPIPE): stdout to devnull, so that the
        # flush at exit cannot fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 1
    sys.exit(status)


def check_choice(name: str, value: Any, choices: tuple | list) -> Any:
    """One of ``choices``, or one line naming them all: the one check of every choice the course offers.

    Args:
        name: what is chosen, as the caller knows it (``"schedule"``, ``"--sharding-strategy"``).
        value: the choice made.
        choices: the values allowed.
    """
    if value not in choices:
        raise UserError(f"unknown {name} {value!r}: choose one of {', '.join(map(str, choices))}")
    return value


def check_module(name: str, value: Any) -> Any:
    """A ``torch.nn.Module`` (the model to wrap, a stage, a layer to split)."""
    from torch import nn

    if not isinstance(value, nn.Module):
        raise UserError(
            f"{name} must be a torch.nn.Module, got {type(value).__name__}: pass the model itself (built on "
            "every rank), not its output or its parameters"
        )
    return value


def check_group(name: str, group: Any) -> Any:
    """A process group this rank belongs to (None: every rank), inside an initialised world."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UserError(
            f"{name}: no process group exists yet: call course_lib.distributed.runtime.init() first "
            "(torchrun jobs), or "
            "run the code through course_lib.distributed.launch.launch(), which does it for you"
        )
    if group is None:
        return group
    # new_group() hands ranks outside the group a marker instead of a group
    outside = group is dist.GroupMember.NON_GROUP_MEMBER
    if outside or (isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0):
        raise UserError(
            f"{name} does not contain this rank (global rank {dist.get_rank()}): call this only on the ranks "
            "of the group, or pass a group that holds every rank that calls it"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise UserError(
            f"{name} must be a process group (dist.new_group, or mesh.get_group()), got "
            f"{type(group).__name__}"
        )
    return group
