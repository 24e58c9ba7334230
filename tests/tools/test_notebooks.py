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
