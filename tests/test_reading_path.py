"""The README's syllabus and reading list point at things that exist, with the sizes they state.

The syllabus names, for each lecture, its deck, notebooks, labs and the package's files to read;
the reading list names regions of the package (``# #region NAME`` ... ``# #endregion NAME``) with
their lengths. A file moved, a region renamed or a region grown past its stated length fails here,
so the path a student follows cannot drift from the code.
"""

from __future__ import annotations

import re

import pytest

from conftest import REPO

README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every row of the markdown tables in ``text`` (header and rule left out)."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    return [row for row in cells if not set("".join(row)) <= set("-: ") and row[0] not in ("week", "region")]


def region_lengths(path: str) -> dict[str, int]:
    """Every region of a file: its name and the lines between its markers."""
    lines = (REPO / path).read_text().splitlines()
    starts, lengths = {}, {}
    for number, line in enumerate(lines):
        if match := re.fullmatch(r"\s*# #region (\S+)", line):
            assert match.group(1) not in starts, f"{path}: region {match.group(1)} opens twice"
            starts[match.group(1)] = number
        elif match := re.fullmatch(r"\s*# #endregion (\S+)", line):
            name = match.group(1)
            assert name in starts, f"{path}: region {name} closes without opening"
            lengths[name] = number - starts[name] - 1
    unclosed = set(starts) - set(lengths)
    assert not unclosed, f"{path}: regions {sorted(unclosed)} never close"
    return lengths


def reading_list() -> list[tuple[str, str, int]]:
    entries = []
    for region, lines, _ in table_rows(section("Reading list")):
        if region == "total":
            continue
        path, name = region.strip("`").split("#")
        entries.append((path, name, int(lines)))
    return entries


def test_every_region_of_the_reading_list_exists_with_the_length_it_states():
    entries = reading_list()
    assert len(entries) >= 20, "the reading list should cover the course, lecture by lecture"
    wrong = []
    for path, name, stated in entries:
        assert (REPO / path).is_file(), f"the reading list names {path}, which does not exist"
        lengths = region_lengths(path)
        if name not in lengths:
            wrong.append(f"{path} has no region {name} (it has: {', '.join(sorted(lengths)) or 'none'})")
        elif lengths[name] != stated:
            wrong.append(f"{path}#{name} is {lengths[name]} lines, the README says {stated}")
    assert wrong == [], "update the README's reading list:\n" + "\n".join(wrong)


def test_the_reading_list_adds_up_to_about_two_thousand_lines():
    total_row = next(row for row in table_rows(section("Reading list")) if row[0] == "total")
    total = sum(stated for *_, stated in reading_list())
    assert int(total_row[1]) == total, f"the total row says {total_row[1]}, the regions add up to {total}"
    assert 1500 <= total <= 2500, f"a reading path of {total} lines: aim for about 2,000"


def syllabus_reading() -> list[tuple[int, str]]:
    """(week, path) for every file or folder of the syllabus's "read" column, in order."""
    found = []
    for row in table_rows(section("Syllabus")):
        folder = ""
        for name in re.findall(r"`([^`]+)`", row[4]):  # "parallel/ddp.py", then "zero.py" in the same folder
            folder, _, _ = name.rpartition("/") if "/" in name else (folder, "", "")
            found.append(
                (int(row[0]), f"course_lib/{name}" if "/" in name else f"course_lib/{folder}/{name}")
            )
    return found


@pytest.mark.parametrize("column", ["lecture", "notebooks", "labs", "read"])
def test_everything_the_syllabus_names_exists(column):
    rows = table_rows(section("Syllabus"))
    assert [row[0] for row in rows] == [str(week) for week in range(1, len(rows) + 1)]
    where = {"lecture": (1, "slides/{}"), "notebooks": (2, "notebooks/{}.ipynb"), "labs": (3, "labs/{}")}
    if column == "read":
        paths = [(week, path) for week, path in syllabus_reading()]
    else:
        paths = [
            (int(row[0]), where[column][1].format(name))
            for row in rows
            for name in re.findall(r"`([^`]+)`", row[where[column][0]])
        ]
    missing = [f"week {week}: {path}" for week, path in paths if not (REPO / path).exists()]
    assert missing == [], "the syllabus names what does not exist:\n" + "\n".join(missing)


def week_of(path: str, reading: list[tuple[int, str]]) -> int | None:
    """The week the syllabus first names ``path``: by its own name, else by the nearest folder."""
    exact = [week for week, named in reading if named == path]
    if exact:
        return exact[0]
    folders = [(len(named), week) for week, named in reading if path.startswith(named.rstrip("/") + "/")]
    return min(folders, key=lambda found: (-found[0], found[1]))[1] if folders else None


def test_the_reading_list_follows_the_syllabus():
    reading = syllabus_reading()
    weeks = [(f"{path}#{name}", week_of(path, reading)) for path, name, _ in reading_list()]
    unplaced = [region for region, week in weeks if week is None]
    assert not unplaced, f"regions in files the syllabus never names: {unplaced}"
    backwards = [
        f"{a} (week {wa}) before {b} (week {wb})" for (a, wa), (b, wb) in zip(weeks, weeks[1:]) if wb < wa
    ]
    assert not backwards, "put the reading list in the syllabus's order:\n" + "\n".join(backwards)
    assert (
        week_of(
            "course_lib/plan/network_model.py", [(6, "course_lib/plan/layout.py"), (10, "course_lib/plan/")]
        )
        == 10
    )


def test_the_checks_above_can_fail(tmp_path):
    """A region that does not close, or opens twice, is refused by name."""
    broken = tmp_path / "lesson.py"
    broken.write_text("# #region a\nx = 1\n")
    with pytest.raises(AssertionError, match="never close"):
        region_lengths(str(broken))
    broken.write_text("# #region a\n# #endregion a\n# #region a\n# #endregion a\n")
    with pytest.raises(AssertionError, match="opens twice"):
        region_lengths(str(broken))
