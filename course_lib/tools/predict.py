"""Predict, then run: a number the student commits to before a measurement, checked after it.

Reading that an output "matches the formula" teaches less than writing the number first. So every
notebook has at least one cell where the student writes a prediction, as text with its unit,
*before* the cell that measures it. The notebooks ship without one: a student writes each in the
notebook's predictions file (``notebooks/predictions/<notebook>.toml``), ideally all of them before
opening the notebook, or in the cell itself::

    prediction = predict.yours("02_collectives", "all_reduce_bytes")  # or: prediction = "1.5 MiB"

and, after the measurement, one line compares them as the labs compare answers (a relative
tolerance, and on a miss a hint that names the idea, not the number)::

    predict.check("bytes each rank sends", prediction, measured, unit="B", hint="...")

With no prediction, ``check`` prints the measurement and the hint and says that none was made: the
notebook runs the same with or without, and the answer is in the notebook's ``<details>`` answers,
not in the cell. The predictions files are what an instructor collects
(``python -m course_lib.tools.predict FOLDER`` lists what a folder of them holds).

A prediction is text, so that it can carry its unit: ``"1.5 MiB"``, ``"2 ms"``, ``"40 %"``,
``"0.4"``. A word that is not a number, or a unit the quantity is not measured in, is named in one
line, and nothing is compared.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tomllib
from pathlib import Path

UNITS: dict[str, dict[str, float]] = {
    "B": {
        "B": 1, "bytes": 1, "kB": 1e3, "KB": 1e3, "KiB": 2**10, "MB": 1e6, "MiB": 2**20,
        "GB": 1e9, "GiB": 2**30, "TB": 1e12, "TiB": 2**40,
    },
    "s": {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "min": 60},
    "B/s": {"B/s": 1, "MB/s": 1e6, "GB/s": 1e9, "MiB/s": 2**20, "GiB/s": 2**30},
    "": {"": 1, "%": 0.01, "x": 1},
}  # fmt: skip
"""The quantities a prediction may be about (by their base unit, the one ``check`` is given), and the
units each may be written in, with their size in the base unit (``""``: a count, a ratio or a
fraction, which may be written as a percentage)."""

PREDICTED_NUMBER = re.compile(
    r"^\s*(?P<number>[-+]?(?:\d[\d_,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(?P<unit>\S*)\s*$"
)


PREDICTIONS_DIR = Path(__file__).resolve().parents[2] / "notebooks" / "predictions"
"""Where each notebook's predictions file lives: ``<notebook>.toml``, one key a prediction."""


class PredictionError(ValueError):
    """A prediction that is not a number in a unit its quantity takes."""


def read_predictions(path: Path) -> dict[str, str]:
    """The predictions a file holds, by key (an empty string is no prediction yet).

    Args:
        path: a notebook's predictions file (TOML: ``key = "1.5 MiB"``).
    """
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise PredictionError(f"cannot read {path.name}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise PredictionError(
            f'{path.name} is not TOML ({error}): write each prediction as key = "1.5 MiB"'
        ) from None
    return {key: value for key, value in table.items() if isinstance(value, (str, int, float))}


def yours(notebook: str, key: str, *, folder: Path | None = None) -> str | float | None:
    """The student's prediction ``key`` from the notebook's predictions file, or None; one line says which.

    Args:
        notebook: the notebook's name without ``.ipynb`` (``"02_collectives"``).
        key: the prediction's key in that file.
        folder: where the predictions files are (default ``notebooks/predictions``).
    """
    path = (folder or PREDICTIONS_DIR) / f"{notebook}.toml"
    try:
        value = read_predictions(path).get(key) if path.exists() else None
    except PredictionError as error:
        print(f"{key}: {error}")
        return None
    if value is None or (isinstance(value, str) and not value.strip()):
        print(
            f"{key}: no prediction yet. Write yours in predictions/{path.name} (or in this cell) "
            "before you run the next cells."
        )
        return None
    print(f"{key}: your prediction is {value} (predictions/{path.name})")
    return value


def parse(text: str | float, *, unit: str = "") -> float:
    """A prediction's value in the base ``unit``.

    Args:
        text: what the student wrote: ``"1.5 MiB"``, ``"40 %"``, ``3``.
        unit: the base unit of the quantity, one of ``UNITS``.
    """
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r}: use one of {sorted(UNITS)}")
    taken = ", ".join(repr(name) for name in UNITS[unit] if name) or "none"
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise PredictionError(
            f"a prediction is a number with its unit, e.g. '1.5 {unit or 'x'}', not a {type(text).__name__}"
        )
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        found = PREDICTED_NUMBER.match(text)
        if not found:
            raise PredictionError(
                f"{text!r} is not a number: write it with its unit, e.g. '1.5 {next(iter(UNITS[unit]))}'"
            )
        written = found["unit"]  # none: the base unit (bytes, seconds)
        if written and written not in UNITS[unit]:
            raise PredictionError(
                f"{text!r}: {written!r} is not a unit of this quantity; it takes {taken}"
                + f" (or a plain number{f', in {unit}' if unit else ''})"
            )
        value = float(found["number"].replace("_", "").replace(",", "")) * UNITS[unit].get(written, 1)
    if not math.isfinite(value):
        raise PredictionError(f"{text!r} is not a finite number")
    return value


def shown(value: float, unit: str) -> str:
    """A value in the base ``unit``, in the unit that reads best (1.5 MiB, 2.3 ms, 0.43)."""
    if unit == "B":
        for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(value) >= size:
                return f"{value / size:.3g} {name}"
        return f"{value:.3g} B"
    if unit == "s":
        for name, size in (("s", 1), ("ms", 1e-3), ("us", 1e-6)):
            if abs(value) >= size:
                return f"{value / size:.3g} {name}"
        return f"{value / 1e-9:.3g} ns"
    if unit == "B/s":
        return f"{value / 1e9:.3g} GB/s"
    if value == int(value) and abs(value) < 1e15:  # a count: every digit
        return f"{value:,.0f}"
    return f"{value:.3g}"


def check(
    what: str,
    prediction: str | float | None,
    measured: float,
    *,
    unit: str = "",
    rel_tol: float = 0.1,
    hint: str = "",
) -> bool:
    """Compare the student's prediction with the measurement, in one printed line; True on a hit.

    Args:
        what: the quantity, as the line names it ("bytes each rank sends").
        prediction: what the student wrote before the measurement ("1.5 MiB"), or None.
        measured: the measurement, in the base ``unit``.
        unit: the base unit: ``"B"``, ``"s"``, ``"B/s"``, or ``""`` for a count, ratio or fraction.
        rel_tol: how close counts as right, relative to the measurement.
        hint: shown on a miss: the idea that gives the number.
    """
    if prediction is None:
        print(
            f"NONE  {what}: no prediction was made; measured {shown(measured, unit)}"
            + (f". The idea: {hint}" if hint else "")
        )
        return False
    try:
        value = parse(prediction, unit=unit)
    except PredictionError as error:
        print(f"prediction of the {what}: {error}")
        return False
    written, got = _as_written(prediction, value, unit), _in_units_of(prediction, measured, unit)
    said = f"you said {written}, measured {got}"
    if math.isclose(value, measured, rel_tol=rel_tol, abs_tol=1e-12):
        print(f"HIT   {what}: {said} ({f'within {rel_tol:.0%}' if rel_tol else 'exactly'})")
        return True
    if value and measured and value * measured > 0:
        factor = max(value / measured, measured / value)
        how = f"{factor:.2g}x too {'high' if abs(value) > abs(measured) else 'low'}"
    else:
        how = "off"
    print(f"MISS  {what}: {said} ({how})" + (f"; hint: {hint}" if hint else ""))
    return False


def _as_written(prediction, value: float, unit: str) -> str:
    """The prediction as the student wrote it (its own unit), or shown in the best unit."""
    return prediction.strip() if isinstance(prediction, str) else shown(value, unit)


def _in_units_of(prediction, measured: float, unit: str) -> str:
    """The measurement in the unit the prediction was written in, so that the two read side by side."""
    found = PREDICTED_NUMBER.match(prediction) if isinstance(prediction, str) else None
    written = found["unit"] if found else ""
    if written and written in UNITS[unit]:
        value = measured / UNITS[unit][written]
        return f"{value:.0f} {written}" if value == int(value) else f"{value:.4g} {written}"
    return shown(measured, unit)


def main(argv: list[str] | None = None) -> int:
    """List the predictions a folder of predictions files holds (an instructor's collection)."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.tools.predict", description=main.__doc__)
    parser.add_argument(
        "folder",
        nargs="?",
        type=Path,
        default=PREDICTIONS_DIR,
        help="a folder of <notebook>.toml files (default: notebooks/predictions)",
    )
    args = parser.parse_args(argv)
    files = sorted(args.folder.glob("*.toml")) if args.folder.is_dir() else []
    if not files:
        print(
            f"no predictions files (*.toml) in {args.folder}: pass the folder a student's "
            "notebooks/predictions was copied to",
            file=sys.stderr,
        )
        return 2
    made = total = 0
    for path in files:
        try:
            table = read_predictions(path)
        except PredictionError as error:
            print(f"{path.name}: {error}", file=sys.stderr)
            return 2
        for key, value in table.items():
            total += 1
            written = str(value).strip()
            made += bool(written)
            print(f"{path.stem:<32} {key:<36} {written or '-'}")
    print(f"{made} of {total} predictions made")
    return 0


if __name__ == "__main__":
    sys.exit(main())
