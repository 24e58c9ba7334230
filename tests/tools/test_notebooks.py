"""What the committed notebooks show: a picture wherever a cell draws, no path of the machine."""

from __future__ import annotations

import json

import pytest

from course_lib.tools import notebooks

NOTEBOOKS = notebooks.notebook_paths()


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_every_drawing_cell_shows_its_picture_and_no_output_names_a_machine_path(notebook):
    assert notebooks.problems(notebook) == []


def test_the_check_finds_a_cell_that_draws_nothing_and_a_machine_path(tmp_path):
    cell = {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": ["plots.plot_study(rows)"]}
    shown = {"output_type": "execute_result", "execution_count": 1, "metadata": {}}
    shown["data"] = {"text/plain": "PosixPath('/home/student/course/results/scaling.png')"}
    cell["outputs"] = [shown]
    path = tmp_path / "99_broken.ipynb"
    path.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    found = notebooks.problems(path)
    assert len(found) == 2
    assert "code cell 1 draws but shows no image" in found[0]
    assert "/home/student/course/results/scaling.png" in found[1]


@pytest.mark.parametrize(
    ("source", "draws"),
    [
        ("%matplotlib inline\nfigures.ring_all_reduce()", True),
        ("plt.plot([1, 2])", True),
        ("display(plots.plot_timeline(events))", True),
        ("print(figures)", False),
        ("rows = study.collect(here)", False),
    ],
)
def test_a_drawing_cell_is_one_that_calls_the_plotting_modules(source, draws):
    assert notebooks.draws(source) is draws


def test_an_unknown_notebook_name_is_refused_with_the_names_there_are():
    with pytest.raises(SystemExit, match="no notebook 99_nothing; there are: 00_processes_and_ranks"):
        notebooks.notebook_paths(["99_nothing"])


def _stream(text: str, name: str = "stdout") -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def _notebook(*cells: tuple[str, list[dict]]) -> dict:
    return {
        "cells": [
            {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": source, "outputs": outputs}
            for source, outputs in cells
        ]
    }


def _note(cores: int) -> dict:
    return _stream(f"note: 3 processes share {cores} CPU core(s), one thread each: slower\n", "stderr")


def test_a_new_execution_must_print_what_the_committed_notebook_shows():
    committed = _notebook(
        ("print(a)\nprint(b)", [_stream("a = 1\nb = 2\n")]),
        ("# NBVAL_IGNORE_OUTPUT\ntime_it()", [_stream("3.1 ms\n")]),
        ("launch(f, 3)", [_note(cores=2)]),
    )
    # the same text, printed in two pieces; other timings where they are not compared; another
    # machine's core count where the sanitizer removes it: no difference
    same = _notebook(
        ("print(a)\nprint(b)", [_stream("a = 1\n"), _stream("b = 2\n")]),
        ("# NBVAL_IGNORE_OUTPUT\ntime_it()", [_stream("9.9 ms\n")]),
        ("launch(f, 3)", [_note(cores=8)]),
    )
    assert notebooks.output_differences(executed=same, committed=committed) == []
    other = _notebook(
        ("print(a)\nprint(b)", [_stream("a = 1\nb = 3\n")]),
        *[(cell["source"], cell["outputs"]) for cell in committed["cells"][1:]],
    )
    [difference] = notebooks.output_differences(executed=other, committed=committed)
    assert difference.startswith("code cell 1: its stdout output differs") and "b = 3" in difference
    shorter = _notebook(*[(cell["source"], cell["outputs"]) for cell in committed["cells"][:2]])
    assert notebooks.output_differences(executed=shorter, committed=committed) == [
        "2 code cells were executed, the committed notebook has 3"
    ]
