"""The notebooks in a real JupyterLab, driven in a real Chromium: part 2 of 4.

How, and what is checked: ``jupyterlab_run.py``. The other parts run in the other
``test_browser*.py`` files, so that ``make test``'s two workers (a file each) share them.
"""

from __future__ import annotations

import pytest

from jupyterlab_run import browser, jupyterlab, part, run_and_check  # noqa: F401 (fixtures)

pytestmark = pytest.mark.browser
NOTEBOOKS = part(2)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_the_notebook_runs_in_jupyterlab_and_shows_its_pictures(notebook, jupyterlab, browser):  # noqa: F811
    run_and_check(notebook, jupyterlab, browser)
