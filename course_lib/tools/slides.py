"""The lecture slides, checked against the code: every image exists, every snippet still runs.

The decks in ``slides/`` are Slidev markdown, and they quote the package: code blocks that call
it, excerpts imported from its files, command lines of its tools, figures it draws. Rename a
function, drop a flag or move a file, and a slide would go on showing the old code, silently.
This module reads the decks the way Slidev does, so that slide numbers are the slide show's, and
checks, slide by slide:

1. **images**: every image a slide shows (``![..](/images/x.png)``, ``<img src=..>``, or an
   ``image:``/``background:`` in its frontmatter) exists under ``slides/public``, and none is
   fetched from the internet (the decks must work offline);
2. **code imports**: every ``<<< @/course_lib/distributed/ring.py#ring-steps`` names a file that exists and a
   ``#region`` that exists in it (for a missing region Slidev silently shows the whole file);
3. **python blocks** run: a deck's blocks run in order, in one namespace, in a fresh process
   started from the repository root, like the cells of a notebook;
4. **shell blocks**: every ``python -m course_lib.X ...`` line is accepted by that tool's own
   argument parser (nothing is run), and every repository path a line names exists.

A failure names the deck, the slide number and the line::

    python -m course_lib.tools.slides check                            # every deck in slides/
    python -m course_lib.tools.slides check slides/04-zero-fsdp.md     # one deck

Cost: the python blocks start processes (``launch``), about 5 to 20 seconds per deck.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

from . import REPOSITORY

SLIDES_DIR = REPOSITORY / "slides"
PUBLIC_DIR = SLIDES_DIR / "public"
SNIPPET_TIMEOUT_S = 600

# Slidev's own rules (its parser and its ``<<<`` snippet syntax), written again in Python.
SNIPPET_IMPORT = re.compile(r"^<<<[ \t]*(\S.*?)(#[\w-]+)?[ \t]*(?:[ \t](\S+?))?[ \t]*(\{.*)?$")
REGION_MARKERS = [  # (start, end) comment forms a file may mark a region with
    (re.compile(r"^\s*#\s*#?region\b\s*(.*?)\s*$"), re.compile(r"^\s*#\s*#?endregion\b\s*(.*?)\s*$")),
    (re.compile(r"^\s*//\s*#?region\b\s*(.*?)\s*$"), re.compile(r"^\s*//\s*#?endregion\b\s*(.*?)\s*$")),
    (
        re.compile(r"^\s*<!--\s*#?region\b\s*(.*?)\s*-->"),
        re.compile(r"^\s*<!--\s*#?endregion\b\s*(.*?)\s*-->"),
    ),
]
MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)")
HTML_IMAGE = re.compile(r"<img\b[^>]*\bsrc\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
FRONTMATTER_IMAGE = re.compile(r"^\s*(?:image|background)\s*:\s*[\"']?([^\"'\s#]+)")
REPOSITORY_PATH = re.compile(r"^(?:course_lib|labs|notebooks|slides|slurm|tests)/[\w./-]+$")
PYTHON_LANGUAGES = {"python", "py"}
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}


@dataclass
class Block:
    """A fenced code block: its language and its lines, with the file line number of the first."""

    language: str
    first_line: int
    lines: list[str]


@dataclass
class Slide:
    """One slide as the slide show numbers it (from 1), with its frontmatter and content lines."""

    number: int
    first_line: int  # line number in the deck file (from 1) of the slide's first line
    frontmatter: list[str]
    content: list[tuple[int, str]]  # (line number, text)
    blocks: list[Block] = field(default_factory=list)


class SlideProblem(Exception):
    """One thing wrong with a slide, already phrased with its deck and slide number."""


def _html_comment_continues(line: str, inside: bool) -> bool:
    """Whether an HTML comment is still open after ``line`` (Slidev ignores ``---`` inside one)."""
    cursor = 0
    while cursor < len(line):
        if inside:
            end = line.find("-->", cursor)
            if end < 0:
                return True
            inside, cursor = False, end + 3
        else:
            start = line.find("<!--", cursor)
            if start < 0:
                return False
            end = line.find("-->", start + 4)
            if end < 0:
                return True
            cursor = end + 3
    return inside


def split_slides(text: str) -> list[Slide]:
    """Cut a deck into slides exactly where Slidev does.

    A line starting with ``---`` ends a slide. If the next line is not blank, the lines up to the
    next ``---`` are the new slide's frontmatter (the first one is the deck's headmatter). Lines
    inside fenced code blocks and HTML comments never cut.
    """
    lines = re.split(r"\r?\n", text)
    slides: list[Slide] = []
    start = content_start = 0

    def cut(end: int) -> None:
        nonlocal start, content_start
        if start == end:
            return
        frontmatter = lines[start + 1 : content_start - 1] if content_start > start else []
        content = [(number + 1, lines[number]) for number in range(content_start, end)]
        slides.append(Slide(len(slides) + 1, start + 1, frontmatter, content, _fenced_blocks(content)))
        start = content_start = end + 1

    in_comment = False
    i = 0
    while i < len(lines):
        raw = lines[i]
        line = raw.rstrip()
        if in_comment:
            in_comment = _html_comment_continues(raw, True)
        elif line.startswith("---"):
            cut(i)
            following = lines[i + 1] if i + 1 < len(lines) else None
            if line[3:4] != "-" and following is not None and following.strip():
                start = i
                i += 1
                while i < len(lines) and lines[i].rstrip() != "---":
                    i += 1
                content_start = i + 1
        elif line.lstrip().startswith("```"):
            fence = re.match(r"^\s*`+", line).group(0)
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence)), None)
            if end is not None:
                i = end
        else:
            in_comment = _html_comment_continues(raw, False)
        i += 1
    if start <= len(lines) - 1:
        cut(len(lines))
    return slides


def _fenced_blocks(content: list[tuple[int, str]]) -> list[Block]:
    blocks, open_block, fence = [], None, ""
    for number, line in content:
        if open_block is None:
            match = re.match(r"^(\s*`{3,})\s*([\w+-]*)", line)
            if match:
                fence, open_block = match.group(1), Block(match.group(2).lower(), number + 1, [])
        elif line.startswith(fence) and not line.strip().strip("`"):
            blocks.append(open_block)
            open_block = None
        else:
            open_block.lines.append(line)
    return blocks


def _outside_code(slide: Slide) -> list[tuple[int, str]]:
    inside_ranges = [(b.first_line - 1, b.first_line + len(b.lines)) for b in slide.blocks]
    return [(n, text) for n, text in slide.content if not any(a <= n <= b for a, b in inside_ranges)]


# -- the checks ----------------------------------------------------------------------------------
def referenced_images(slide: Slide) -> list[str]:
    """Every image path a slide shows, in order."""
    found = [m.group(1) for line in slide.frontmatter for m in [FRONTMATTER_IMAGE.match(line)] if m]
    for _, text in _outside_code(slide):
        found += MARKDOWN_IMAGE.findall(text) + HTML_IMAGE.findall(text)
    return found


def check_images(deck: Path, slide: Slide) -> list[str]:
    problems = []
    for image in referenced_images(slide):
        if re.match(r"^[a-z]+://|^//", image):
            problems.append(
                f"image {image} comes from the internet: the decks must work offline; save it under "
                "slides/public/images (or draw it in course_lib/tools/figures.py)"
            )
            continue
        path = PUBLIC_DIR / image.lstrip("/") if image.startswith("/") else deck.parent / image
        if not path.is_file():
            problems.append(
                f"image {image} does not exist ({_relative(path)}): draw it with `python -m "
                "course_lib.tools.figures slides/public/images` or fix the name"
            )
    return problems


def find_region(lines: list[str], name: str) -> tuple[int, int] | None:
    """(first, last) line index of region ``name``'s body, or None, with Slidev's marker forms."""
    for start_marker, end_marker in REGION_MARKERS:
        starts = [i for i, line in enumerate(lines) if (m := start_marker.match(line)) and m.group(1) == name]
        if not starts:
            continue
        depth = 1
        for i in range(starts[0] + 1, len(lines)):
            if (m := start_marker.match(lines[i])) and m.group(1) == name:
                depth += 1
            elif (m := end_marker.match(lines[i])) and m.group(1) in (name, ""):
                depth -= 1
                if depth == 0:
                    return starts[0] + 1, i - 1
    return None


def check_code_imports(deck: Path, slide: Slide) -> list[str]:
    problems = []
    for _, text in _outside_code(slide):
        match = SNIPPET_IMPORT.match(text.strip())
        if not match:
            continue
        source, region = match.group(1), (match.group(2) or "")[1:]
        path = SLIDES_DIR / source[2:] if source.startswith("@/") else deck.parent / source
        if not path.is_file():
            problems.append(f"code import {source} names no file ({_relative(path)})")
        elif region and find_region(path.read_text().splitlines(), region) is None:
            problems.append(
                f"code import {source}#{region}: {_relative(path)} has no region '{region}' (mark it with `# "
                f"#region {region}` and `# #endregion {region}`)"
            )
    return problems


def _shell_commands(block: Block) -> list[tuple[int, str]]:
    """(line number, command) for each command of a shell block, continuation lines joined."""
    commands, pending, first = [], "", 0
    for offset, line in enumerate(block.lines):
        if not pending:
            first = block.first_line + offset
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        commands.append((first, pending + stripped))
        pending = ""
    if pending:
        commands.append((first, pending))
    return commands


def check_command_line(module_name: str, argv: list[str]) -> str | None:
    """Parse ``argv`` with the command-line parser of ``python -m module_name``: None if accepted.

    The tool's ``main`` is called with its argument parser made to stop right after parsing, so
    nothing is run; what argparse would print for a bad flag is returned.
    """
    try:
        module = importlib.import_module(module_name)
        if hasattr(module, "__path__") and not hasattr(module, "main"):  # `python -m` runs its __main__
            module = importlib.import_module(module_name + ".__main__")
    except ImportError:
        return f"there is no module {module_name}"
    if not callable(getattr(module, "main", None)):
        return f"{module_name} has no command line (no main function)"

    class Parsed(Exception):
        pass

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        original(parser, args, namespace)
        raise Parsed

    errors = io.StringIO()
    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
        contextlib.redirect_stderr(errors),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            module.main(argv)
        except Parsed:
            return None
        except SystemExit as stop:
            if stop.code in (0, None):  # --help
                return None
            lines = errors.getvalue().strip().splitlines()
            return lines[-1] if lines else f"exit {stop.code}"
    return f"{module_name}.main returned without parsing its arguments"


def check_shell_block(block: Block) -> list[tuple[int, str]]:
    problems = []
    for line_number, command in _shell_commands(block):
        try:
            words = shlex.split(command, comments=True)
        except ValueError as error:
            problems.append((line_number, f"cannot read the command `{command.strip()}`: {error}"))
            continue
        for word in words:
            if REPOSITORY_PATH.match(word) and not (REPOSITORY / word).exists():
                problems.append((line_number, f"{word} does not exist in the repository"))
        for i, word in enumerate(words[:-1]):
            if word == "-m" and words[i + 1].startswith("course_lib"):
                error = check_command_line(words[i + 1], words[i + 2 :])
                if error:
                    problems.append(
                        (line_number, f"`python -m {words[i + 1]}` refuses this command line: {error}")
                    )
                break
    return problems


def run_python_blocks(deck: Path, slides: list[Slide], timeout_s: float = SNIPPET_TIMEOUT_S) -> list[str]:
    """Run the deck's python blocks in order, in a fresh process; the failure, if any, as one problem."""
    if not any(block.language in PYTHON_LANGUAGES for slide in slides for block in slide.blocks):
        return []
    # A session of its own, so that a snippet that hangs is stopped with every process it started.
    child = subprocess.Popen(
        [sys.executable, "-m", "course_lib.tools.slides", "_run-python", str(deck)],
        cwd=REPOSITORY,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, errors = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        return [
            f"{_relative(deck)}: its python blocks did not finish within {timeout_s:g} s: does a snippet "
            "wait forever?"
        ]
    if child.returncode == 0:
        return []
    return [errors.strip() or f"the python blocks of {_relative(deck)} exited with status {child.returncode}"]


def _run_python_here(deck: Path) -> int:
    """The child of ``run_python_blocks``: exec each block with its deck line numbers kept."""
    import traceback

    namespace: dict = {"__name__": "__slides__"}
    for slide in split_slides(deck.read_text()):
        for block in slide.blocks:
            if block.language not in PYTHON_LANGUAGES:
                continue
            # Blank lines in front, so a traceback's line numbers are the deck file's own.
            source = "\n" * (block.first_line - 1) + "\n".join(block.lines) + "\n"
            try:
                exec(compile(source, str(deck), "exec"), namespace)
            except BaseException as error:  # noqa: BLE001 - any failure of a snippet is the finding
                details = "".join(traceback.format_exception(error)[-6:]).rstrip()
                print(
                    f"{_relative(deck)}, slide {slide.number}: the python block at line {block.first_line} "
                    f"failed: {type(error).__name__}: {error}\n{details}",
                    file=sys.stderr,
                )
                return 1
    return 0


def check_deck(deck: Path, run_python: bool = True) -> list[str]:
    """Every problem of one deck, each naming the deck file and the slide number."""
    deck = Path(deck).resolve()
    slides = split_slides(deck.read_text())
    problems = []
    for slide in slides:
        where = f"{_relative(deck)}, slide {slide.number}"
        problems += [f"{where}: {p}" for p in check_images(deck, slide) + check_code_imports(deck, slide)]
        for block in slide.blocks:
            if block.language in SHELL_LANGUAGES:
                problems += [f"{where}, line {line}: {p}" for line, p in check_shell_block(block)]
    if run_python:
        problems += run_python_blocks(deck, slides)
    return problems


def decks(directory: Path = SLIDES_DIR) -> list[Path]:
    """The lecture decks: the numbered markdown files of ``slides/``, in order."""
    return sorted(Path(directory).glob("[0-9]*.md"))


def _relative(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(REPOSITORY)) if path.is_relative_to(REPOSITORY) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.tools.slides", description="Check the lecture decks against the code."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{check,count}")
    check = commands.add_parser(
        "check", help="images, code imports, python blocks and command lines of the decks"
    )
    check.add_argument("decks", nargs="*", type=Path, help="deck files (default: every slides/[0-9]*.md)")
    check.add_argument("--no-python", action="store_true", help="do not run the python blocks")
    count = commands.add_parser("count", help="print each deck's number of slides")
    count.add_argument("decks", nargs="*", type=Path)
    run_here = commands.add_parser("_run-python")  # internal: the fresh process of run_python_blocks
    run_here.add_argument("deck", type=Path)
    args = parser.parse_args(argv)

    if args.command == "_run-python":
        return _run_python_here(args.deck)
    chosen = args.decks or decks()
    missing = [str(deck) for deck in chosen if not deck.is_file()]
    if missing:
        print(f"error: no such deck: {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.command == "count":
        for deck in chosen:
            print(f"{len(split_slides(deck.read_text()))} {deck}")
        return 0
    failed = 0
    for deck in chosen:
        problems = check_deck(deck, run_python=not args.no_python)
        failed += bool(problems)
        print(f"{'FAIL' if problems else 'ok  '} {_relative(deck)}", flush=True)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
    if failed:
        print(f"error: {failed} of {len(chosen)} decks have problems (above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
