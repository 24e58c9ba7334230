"""Two clones on one machine share the installed packages, and each runs its own course_lib.

``make setup`` keeps the 5 GB of packages in one shared environment, keyed by the dependencies,
and gives each clone a small ``.venv`` of its own. Whatever starts Python from a clone (its
``.venv/bin/python`` from any folder, its ``torchrun``, its notebook server) must import that
clone's code, never the one whose ``make`` ran last.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, clean_env

pytestmark = pytest.mark.slow  # two clones set up as a newcomer would, and their tools run

SETUP_FILES = ("Makefile", "pyproject.toml", "constraints.txt", "README.md")
WHERE = "import course_lib, pathlib; print(pathlib.Path(course_lib.__file__).resolve().parent.parent)"


def _clone(tmp: Path, name: str) -> Path:
    """A copy of what ``make setup`` reads, with this checkout's course_lib."""
    clone = tmp / name
    clone.mkdir()
    for file in SETUP_FILES:
        shutil.copy(REPO / file, clone / file)
    shutil.copytree(REPO / "course_lib", clone / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    return clone


def _setup(clone: Path) -> None:
    done = subprocess.run(
        ["make", "--no-print-directory", "setup"],
        cwd=clone,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _env_without_pythonpath() -> dict[str, str]:
    env = clean_env()
    env.pop("PYTHONPATH")  # as a student's shell has it: only the clone's .venv decides
    return env


def _where(command: list[str], cwd: Path) -> Path:
    done = subprocess.run(
        command, cwd=cwd, env=_env_without_pythonpath(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_clones(tmp_path_factory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("clones")
    first, second = _clone(tmp, "first"), _clone(tmp, "second")
    _setup(first)
    _setup(second)  # the second make must not take the first clone's imports over
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return first, second, elsewhere


def test_each_clone_imports_its_own_code_from_any_folder(two_clones):
    first, second, elsewhere = two_clones
    for clone in (first, second):
        assert not (clone / ".venv").is_symlink()  # its own, small environment
        assert _where([str(clone / ".venv/bin/python"), "-c", WHERE], elsewhere) == clone.resolve()
    # and this checkout still runs its own, although two more clones ran make since
    assert _where([str(REPO / ".venv/bin/python"), "-c", WHERE], elsewhere) == REPO.resolve()


def test_a_clones_tools_run_its_code_too(two_clones):
    first, second, elsewhere = two_clones
    script = elsewhere / "where.py"
    script.write_text(WHERE + "\n")
    for clone in (first, second):
        torchrun = [str(clone / ".venv/bin/torchrun"), "--standalone", "--nproc-per-node", "1", str(script)]
        assert _where(torchrun, elsewhere) == clone.resolve()
        assert (clone / ".venv/bin/course-train").is_file()


def test_a_notebook_run_by_a_clones_jupyter_imports_that_clones_code(two_clones):
    first, second, elsewhere = two_clones
    cell = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": WHERE}
    for clone in (first, second):
        notebook = elsewhere / f"{clone.name}.ipynb"
        notebook.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
        done = subprocess.run(
            [str(clone / ".venv/bin/jupyter"), "execute", "--inplace", str(notebook)],
            cwd=elsewhere,
            env=_env_without_pythonpath(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        [output] = json.loads(notebook.read_text())["cells"][0]["outputs"]
        assert Path("".join(output["text"]).strip()) == clone.resolve()
