"""The notebooks in a real JupyterLab, driven in a real Chromium: part 4 of 4 (how, and what is
checked: ``jupyterlab_run.py``; the other parts run in the other ``test_browser*.py`` files, so that
``make test``'s two workers, a file each, share them)."""

from jupyterlab_run import browser, jupyterlab, notebook_test  # noqa: F401 (fixtures)

test_the_notebook_runs_in_jupyterlab_and_shows_its_pictures = notebook_test(4)
