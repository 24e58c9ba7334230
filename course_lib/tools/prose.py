"""No number in a notebook's prose that the output beside it can contradict.

Text written for one run and left beside another run's output is the commonest wrong statement a
course makes ("the first step takes over a second", beside an output of 455 ms). So a quantity a
markdown cell states (a number with a unit of time, rate, size, a percentage or a ratio such as
``1.3x``) must be held by the code beside it, the code cell just before or just after the
markdown cell:

- its number is a literal of that code: a setting the code uses (``bucket_mb=4``) or the bound
  of an assertion that guards a measured claim (``assert first_step > 100 * warm``); or
- its number is printed by that code, in an output nbval compares on every run (not one marked
  ``# NBVAL_IGNORE_OUTPUT``, whose numbers change from run to run), as written or to more
  digits (the prose's "49 s" holds the output's 49.08): the prose then repeats a number the
  tests hold equal to the output.

A measured time or speed that changes from run to run is therefore either printed by the code in a
sentence the code writes (the prose speaks of it without restating it) or guarded by an
assertion. Numbers that no run can contradict (a formula, a paper, a datasheet, a question's
hypothetical) live in cells tagged ``from-sources`` (JupyterLab: the property inspector's cell
tags), which this check leaves alone; such a cell states nothing measured here.

The check is a heuristic, and says so: a number in the code that means something else also holds
the prose. What it catches is the drift the course's reviews found, at no cost to a run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

SOURCES_TAG = "from-sources"
"""The cell tag of a markdown cell whose numbers come from theory, papers or datasheets."""
IGNORE_OUTPUT = "# NBVAL_IGNORE_OUTPUT"
"""A cell with this line must run without error; its output is not compared (nbval's marker)."""

UNIT = (
    r"(?:[kKMGT]i?B/s|[kKMGT]?b/s|samples/s|tokens/s|tok/s|steps/s|[TGP]FLOP/s|"
    r"[kKMGT]i?B|bytes|ns|us|µs|ms|s|seconds?|minutes?|min|hours?|%)"
)
QUANTITY = re.compile(
    r"(?<![\w.^/-])(?P<number>\d[\d,]*(?:\.\d+)?)"
    r"(?:\s?(?P<unit>" + UNIT + r")(?![\w/])|(?P<ratio>[x×])(?![\w]))"
)
"""A number with a unit of time, rate, size or a percentage ("60 ms", "16.8 MB", "40 %"), or a
ratio written against its number ("1.3x", "0.94×"). "2 x 2" (a product) is not one."""
NUMBER = re.compile(r"(?<![\w.])\d[\d_,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
NOT_PROSE = re.compile(r"```.*?```|`[^`\n]*`|\$\$.*?\$\$|\$[^$\n]*\$|<!--.*?-->|\(https?://[^)]*\)", re.S)
"""Code, formulas, comments and link targets: not sentences about an output."""


def _value(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("_", ""))
    except ValueError:
        return None


def _held(written: str, held: set[float]) -> bool:
    """Whether a number as the prose writes it is one of ``held``, or one of them rounded to the
    prose's digits (half a unit of its last digit either way)."""
    value = _value(written)
    if value is None:
        return False
    digits = len(written.partition(".")[2])
    return any(abs(number - value) <= 0.5 * 10**-digits + 1e-12 for number in held)


def _numbers(text: str) -> set[float]:
    return {value for value in map(_value, NUMBER.findall(text)) if value is not None}


def _cell_text(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def output_text(output: dict) -> str:
    """Everything an output shows as text: streams, results, errors."""
    parts = [output.get("text", "")]
    parts += [value for key, value in output.get("data", {}).items() if key.startswith("text/")]
    parts += output.get("traceback", [])
    return "".join("".join(part) if isinstance(part, list) else part for part in parts)


def _holders(cells: list[dict], index: int) -> set[float]:
    """The numbers the code cells beside markdown cell ``index`` hold: their literals, and what
    they print where nbval compares it."""
    held: set[float] = set()
    before = next((cells[i] for i in range(index - 1, -1, -1) if cells[i]["cell_type"] == "code"), None)
    after = next((cells[i] for i in range(index + 1, len(cells)) if cells[i]["cell_type"] == "code"), None)
    for cell in (before, after):
        if cell is None:
            continue
        source = _cell_text(cell)
        held |= _numbers(source)
        if IGNORE_OUTPUT not in (line.strip() for line in source.splitlines()):
            held |= _numbers("".join(output_text(output) for output in cell.get("outputs", [])))
    return held


def unguarded(cells: list[dict]) -> list[tuple[int, str, str]]:
    """Each quantity stated in a markdown cell that no code beside it holds: (the cell's index in
    the notebook, the quantity as written, the sentence around it).

    Args:
        cells: a notebook's cells, as ``nbformat`` stores them.
    """
    found = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown" or SOURCES_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        text = NOT_PROSE.sub(" ", _cell_text(cell))
        held = None
        for match in QUANTITY.finditer(text):
            held = _holders(cells, index) if held is None else held
            if _held(match["number"], held):
                continue
            start = max(text.rfind(". ", 0, match.start()) + 2, text.rfind("\n", 0, match.start()) + 1, 0)
            end = min(
                (i for i in (text.find(". ", match.end()), text.find("\n", match.end())) if i >= 0),
                default=len(text),
            )
            found.append((index, match.group(0), " ".join(text[start:end].split())))
    return found


def problems(path: Path) -> list[str]:
    """One line per quantity in a notebook's prose that no code beside it holds.

    Args:
        path: the ``.ipynb`` file.
    """
    cells = json.loads(path.read_text())["cells"]
    return [
        f"{path.name} cell {index + 1} states {quantity!r} with nothing beside it to hold it "
        f'("{sentence[:100]}"): '
        f"print it from the code (and speak of it without the number), guard it with an assert in the next "
        f"cell, or, where it comes from theory, a paper or a datasheet, tag the cell {SOURCES_TAG!r}"
        for index, quantity, sentence in unguarded(cells)
    ]
