"""Every option of every command, given hostile values: refused in one line with status 2 before any
work starts, or accepted because the value means something there (``ACCEPTED`` says what).

The options are found, not listed: each command's own parser is captured as its ``main`` builds it,
and walked, subcommands included. A new option that takes a senseless value without a word fails
here until it is checked, or its acceptance is written down below with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
from pathlib import Path
from unittest import mock

import pytest

COMMANDS = {
    "train": "course_lib.train.cli",
    "bench": "course_lib.tools.bench.cli",
    "diagnose": "course_lib.tools.diagnose",
    "figures": "course_lib.tools.figures",
    "gpu_record": "course_lib.tools.evidence.gpu_record",
    "jobcheck": "course_lib.tools.jobcheck",
    "lab": "course_lib.tools.lab",
    "labs": "course_lib.tools.labs",
    "notebooks": "course_lib.tools.notebooks",
    "plan": "course_lib.tools.plan",
    "slides": "course_lib.tools.slides",
    "stragglers": "course_lib.tools.stragglers",
    "study": "course_lib.tools.study",
    "system_deps": "course_lib.tools.system_deps",
    "three_d": "course_lib.tools.three_d",
}

HOSTILE = ("-1", "0", "nan", "inf", "", "1e12", "<a file>", "<a folder>", "<a png>")


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, as its ``main`` builds it (stopped at its first parse)."""
    found = {}
    real = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    try:
        for name, module in COMMANDS.items():
            try:
                importlib.import_module(module).main(["--help"])
            except _Captured as captured:
                found[name] = captured.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = real
    return found


def _options(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(subcommand words, the option's flag, its parser) for every option that takes a value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word, sub in action.choices.items():
                yield from _options(sub, (*prefix, word))
        elif action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction):
            yield prefix, action.option_strings[-1], parser


POSITIONALS = {"lab": "lab7_scaling", "names": "01_processes", "decks": "slides/01-processes.md"}
"""A valid value for a command's positional arguments, so that each option is what is tried."""


def _positionals(parser: argparse.ArgumentParser, folder: Path) -> list[str]:
    """Values for the positional arguments of the (sub)command ``parser``: each option is then the
    only thing that can be wrong."""
    values = []
    for action in parser._actions:
        if action.option_strings or isinstance(action, argparse._SubParsersAction):
            continue
        if action.choices:
            values.append(str(next(iter(action.choices))))
        else:
            values.append(
                POSITIONALS.get(
                    action.dest,
                    str(folder / "notes.txt")
                    if "report" in action.dest or "file" in action.dest
                    else str(folder),
                )
            )
    return values


def _value(hostile: str, folder: Path) -> str:
    files = {"<a file>": folder / "notes.txt", "<a folder>": folder, "<a png>": folder / "picture.png"}
    return str(files.get(hostile, hostile))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[tuple[str, str, str, str], str]:
    """Every (command, subcommand, option, hostile value): "refused" or "accepted"."""
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "notes.txt").write_text("just some words\n")
    (folder / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    seen = {}
    for name, parser in _parsers().items():
        for prefix, option, command in _options(parser):
            for hostile in HOSTILE:
                argv = [*prefix, *_positionals(command, folder), option, _value(hostile, folder)]
                errors = io.StringIO()
                try:
                    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                        parser.parse_args(argv)
                    outcome = "accepted"
                except SystemExit as stop:
                    said = errors.getvalue().strip()
                    about_it = option in said or "argument" in said and option.lstrip("-") in said
                    if stop.code != 2 or said.count("\n"):
                        outcome = f"not one line: {said!r}"
                    else:
                        outcome = "refused" if about_it else f"refused for another reason: {said}"
                seen[(name, " ".join(prefix), option, hostile)] = outcome
    return _second_looks(seen, folder)


SECOND_LOOK = {
    "train": lambda words, option, value: ["--dry-run", option, value],  # validate_config: before ranks meet
    "plan": lambda words, option, value: (
        [option, value, "--gpus", "8"]
        + (["--cluster", "alps"] if option == "--model" else ["--model", "llama3-8b"])
    ),
    "bench": lambda words, option, value: [*words, option, value],  # its sizes against the memory
}
"""Commands that check some options after parsing, before any work: run them with the value (the
trainer's dry run; the planner's names or files of models and clusters; the benchmarks' sizes),
stopped where the work would start (``WORK_STARTS``)."""

WORK_STARTS = {"bench": "course_lib.tools.bench.cli._run_benchmark"}
"""Where a command's checks end and its work begins: replaced by a function that returns 0."""


def _second_looks(seen: dict, folder: Path) -> dict:
    for key, outcome in list(seen.items()):
        name, words, option, hostile = key
        if outcome != "accepted" or name not in SECOND_LOOK:
            continue
        if name == "plan" and option not in ("--model", "--cluster"):
            continue
        errors = io.StringIO()
        main = importlib.import_module(COMMANDS[name]).main
        with contextlib.ExitStack() as stack:
            stack.enter_context(contextlib.redirect_stderr(errors))
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            if name in WORK_STARTS:
                stack.enter_context(mock.patch(WORK_STARTS[name], lambda *args: 0))
            try:
                status = main(SECOND_LOOK[name](words.split(), option, _value(hostile, folder)))
            except SystemExit as stop:
                status = stop.code
        said = errors.getvalue().strip()
        if status == 2:
            seen[key] = "refused" if said.count("\n") == 0 else f"not one line: {said!r}"
    return seen


def test_the_sweep_reaches_every_command_and_its_options():
    parsers = _parsers()
    assert set(parsers) == set(COMMANDS)
    assert sum(1 for parser in parsers.values() for _ in _options(parser)) >= 150


@pytest.mark.slow  # every command's every option, in fresh processes
def test_every_option_refuses_a_senseless_value_in_one_line(outcomes):
    wordy = sorted({key[0] for key, outcome in outcomes.items() if outcome.startswith("not one line")})
    assert wordy == [], f"these commands refuse in more than one line (use checks.CommandParser): {wordy}"
    elsewhere = sorted({o for o in outcomes.values() if o.startswith("refused for another reason")})
    assert elsewhere == [], f"give POSITIONALS a valid value for these: {elsewhere}"
    accepted = sorted(key for key, outcome in outcomes.items() if outcome == "accepted")
    unexplained = [key for key in accepted if not _explained(key)]
    assert unexplained == [], "\n".join(" ".join(filter(None, key)) for key in unexplained)


NAMES = ("-1", "0", "1e12", "inf", "nan")
"""Hostile values that are fine names for a file or folder the command creates."""
A_FOLDER_TO_WRITE = (*NAMES, "<a folder>")
"""A folder a command writes into: any name (it is created), or one that exists."""

ACCEPTED: dict[tuple[str, str], tuple[str, ...]] = {
    # folders a command creates or writes into
    **dict.fromkeys(
        [("bench", "--profile"), ("three_d", "--profile"), ("train", "--profile"), ("gpu_record", "--out"),
         ("lab", "--results-dir"), ("study", "--results"), ("train", "--checkpoint-dir"),
         ("train", "--flight-recorder")],
        A_FOLDER_TO_WRITE,
    ),
    # where the data is, or will be (on the cluster, for a submitted study)
    ("train", "--data-dir"): A_FOLDER_TO_WRITE,
    ("study", "--data-dir"): A_FOLDER_TO_WRITE,
    # a picture written over one that exists
    **dict.fromkeys([("bench", "--plot"), ("three_d", "--plot"), ("stragglers", "--plot")], ("<a png>",)),
    ("labs", "--submissions"): ("<a folder>",),  # a folder of submissions
    # zero: none (untimed steps, loader workers, checkpoints, replica checks), or the seed 0
    ("bench", "--warmup"): ("0",),
    ("train", "--workers"): ("0",),
    ("train", "--checkpoint-every"): ("0",),
    ("train", "--check-replicas"): ("0",),
    ("train", "--seed"): ("0",),
    ("three_d", "--seed"): ("0",),
    ("train", "--weight-decay"): ("0",),
    # no limit: one bucket for every gradient, no token dropped, a norm never clipped
    ("bench", "--bucket-mb"): ("1e12",),
    ("bench", "--capacity-factor"): ("1e12",),
    ("train", "--clip-grad-norm"): ("1e12",),
    ("study", "--sbatch-arg"): HOSTILE,  # passed to sbatch as it is: sbatch judges it
}  # fmt: skip
"""(command, option): the hostile values it accepts, each because it means something there."""


def _explained(key: tuple[str, str, str, str]) -> bool:
    name, _, option, hostile = key
    return hostile in ACCEPTED.get((name, option), ())
