"""The notebooks in a real JupyterLab, driven in a real Chromium: the second half of them.

How, and what is checked: ``jupyterlab_run.py``. The first half runs in
``test_browser.py``, so that ``make test``'s two workers (a file each) share them.
"""

from __future__ import annotations

import pytest
from jupyterlab_run import HALF, NOTEBOOKS, browser, jupyterlab, run_and_check  # noqa: F401 (fixtures)

pytestmark = pytest.mark.browser


@pytest.mark.parametrize("notebook", NOTEBOOKS[HALF:], ids=[path.stem for path in NOTEBOOKS[HALF:]])
def test_the_notebook_runs_in_jupyterlab_and_shows_its_pictures(notebook, jupyterlab, browser):  # noqa: F811
    run_and_check(notebook, jupyterlab, browser)
