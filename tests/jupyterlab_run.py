"""The notebooks as a student meets them: a real JupyterLab, driven in a real Chromium.

(The machinery of ``test_browser.py`` and ``test_browser_part2.py`` to ``_part4.py``: each runs a
part of the notebooks, so that ``make test``'s two workers, a file each, share them.)

JupyterLab runs headless on this machine's loopback with a token, over a copy of ``notebooks/``
(so that JupyterLab's autosave never writes into the committed notebooks). For each notebook,
Playwright opens it, picks Run > Run All Cells from JupyterLab's own menu, and waits until every
code cell has run. Then it checks what is on the screen: no error output, an image in every cell
that draws, and the time the notebook took against its budget. A screenshot of each notebook's
last cells is saved under ``test-artifacts/notebooks/`` (or ``$COURSE_TEST_ARTIFACTS``).

This is also where the notebooks' text is checked, so that each runs once per ``make test``: the
test saves the notebook from JupyterLab (File > Save) and compares its outputs with the committed
ones by nbval's rules (``course_lib.tools.notebooks.output_differences``): cells marked
``# NBVAL_IGNORE_OUTPUT`` only have to run, the others must print what the committed notebook
shows. ``pytest --nbval notebooks/`` does the same comparison without a browser.

Chromium is Debian's (``make system-deps`` installs it); Playwright downloads no browser.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from course_lib.distributed.launch import free_port
from course_lib.tools import notebooks

from conftest import REPO, clean_env

NOTEBOOKS = notebooks.notebook_paths()
# Seconds each notebook may take from Run All to its last cell, on a 2-core machine that is also
# running the rest of the test suite. A student's laptop takes a fraction of it.
BUDGET_S = {"05_strong_scaling": 300}
DEFAULT_BUDGET_S = 180
ARTIFACTS = Path(os.environ.get("COURSE_TEST_ARTIFACTS", REPO / "test-artifacts")) / "notebooks"


def _chromium() -> str:
    found = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    assert found, "the browser test needs Chromium: run `make system-deps` (apt-get install chromium)"
    return found


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """A JupyterLab server over a copy of the notebooks; yields (base URL, token)."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(REPO / "notebooks", root / "notebooks")
    # Every cell in the page at once (no windowing), so that each output can be looked at.
    settings = root / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = free_port(), secrets.token_hex(16)
    log = open(root / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root / 'notebooks'}",
            f"--LabApp.user_settings_dir={root / 'settings'}",
            f"--LabApp.workspaces_dir={root / 'workspaces'}",
            "--LabApp.news_url=",
            "--LabServerApp.announcements_url=",
        ],
        env=clean_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                    break
            except OSError:
                assert server.poll() is None, (root / "jupyterlab.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "JupyterLab did not start within 2 minutes"
                time.sleep(0.5)
        yield base, token, root / "notebooks"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        yield chromium
        chromium.close()


def _kernels(base: str, token: str) -> list[dict]:
    """The kernels the server runs, as its REST API describes them."""
    with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=10) as answer:
        return json.load(answer)


def _shut_down_kernels(base: str, token: str) -> None:
    """Stop the kernels the notebook started: the next notebook gets the machine's cores."""
    for kernel in _kernels(base, token):
        request = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(request, timeout=30).close()


def _wait_for_an_idle_kernel(base: str, token: str, timeout_s: float = 120) -> None:
    deadline, last_error = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            states = [kernel["execution_state"] for kernel in _kernels(base, token)]
        except urllib.error.HTTPError as error:
            # While the previous notebook's kernel is being shut down, the server can answer its
            # kernel list with a 500 for a moment (a kernel between two states): ask again.
            if error.code < 500:
                raise
            last_error, states = error, []
        if states == ["idle"]:
            return
        time.sleep(0.5)
    raise AssertionError(
        f"the notebook's kernel was not ready within {timeout_s} s (last error: {last_error})"
    )


def _save(page, path: Path, timeout_s: float = 60) -> dict:
    """Save the notebook with JupyterLab's File > Save; the saved file once every code cell is in it."""
    before = path.stat().st_mtime_ns
    page.click(".lm-MenuBar-item:has-text('File')")
    page.click(".lm-Menu-item[data-command='docmanager:save']")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.stat().st_mtime_ns != before:
            try:
                saved = json.loads(path.read_text())
            except json.JSONDecodeError:  # caught while being written
                saved = None
            code = [cell for cell in saved["cells"] if cell["cell_type"] == "code"] if saved else []
            if code and all(cell["execution_count"] is not None for cell in code):
                return saved
        time.sleep(0.2)
    raise AssertionError(f"JupyterLab did not save {path.name} within {timeout_s} s")


# The notebook's cells, read back from the page: what each shows, as JupyterLab rendered it.
READ_CELLS = """() => [...document.querySelectorAll('.jp-Notebook .jp-Cell.jp-CodeCell')].map((cell) => ({
    prompt: cell.querySelector('.jp-InputPrompt')?.textContent.trim() ?? '',
    images: [...cell.querySelectorAll('.jp-OutputArea-output img')].filter((image) => image.complete
        && image.naturalWidth > 0).length,
    errors: [...cell.querySelectorAll('.jp-OutputArea-output')]
        .filter((output) => output.dataset.mimeType === 'application/vnd.jupyter.stderr')
        .map((output) => output.innerText).filter((text) => /Traceback|Error\\b/.test(text)),
}))"""


PART_STARTS = ("00", "05", "08", "12")
"""The notebooks run in four test files, each from the notebook numbered here to the next one: about
two minutes each on 2 cores (notebook 05, the scaling study, takes one and a half alone)."""


def part(number: int) -> list[Path]:
    """The notebooks of test file ``number`` (1 to 4), in order."""
    first = PART_STARTS[number - 1]
    after = PART_STARTS[number] if number < len(PART_STARTS) else None
    return [path for path in NOTEBOOKS if path.stem[:2] >= first and (after is None or path.stem[:2] < after)]


def notebook_test(number: int):
    """The test of test file ``number`` (1 to 4): each notebook of its part run and checked.

    Each file assigns it to ``test_the_notebook_runs_in_jupyterlab_and_shows_its_pictures`` and
    imports the fixtures ``jupyterlab`` and ``browser`` (a JupyterLab server for each file)."""
    mine = part(number)

    @pytest.mark.browser
    @pytest.mark.parametrize("notebook", mine, ids=[path.stem for path in mine])
    def test(notebook, jupyterlab, browser):
        run_and_check(notebook, jupyterlab, browser)

    return test


def run_and_check(notebook: Path, jupyterlab, browser) -> None:
    """Run ``notebook`` in JupyterLab (Run All Cells), then check the page and the saved outputs."""
    base, token, folder = jupyterlab
    budget = BUDGET_S.get(notebook.stem, DEFAULT_BUDGET_S)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{base}/lab/tree/{notebook.name}?reset&token={token}", timeout=120_000)
        page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=120_000)
        _wait_for_an_idle_kernel(base, token)
        page.click(".lm-MenuBar-item:has-text('Run')")
        page.click(".lm-Menu-item[data-command='runmenu:run-all']")
        started = time.monotonic()
        cells = []
        while time.monotonic() - started < budget:
            cells = page.evaluate(READ_CELLS)
            if any(cell["errors"] for cell in cells):
                break
            if all(cell["prompt"][1:2].isdigit() for cell in cells):
                break
            page.wait_for_timeout(400)
        took = time.monotonic() - started
        page.wait_for_timeout(500)  # the last image decoded and laid out
        cells = page.evaluate(READ_CELLS)
        finished = all(cell["prompt"][1:2].isdigit() and not cell["errors"] for cell in cells)
        saved = _save(page, folder / notebook.name) if finished else None
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.locator(".jp-Notebook .jp-Cell").last.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / f"{notebook.stem}.png"))
    finally:
        page.close()
        _shut_down_kernels(base, token)

    where = f"{notebook.name} (screenshot: {ARTIFACTS / (notebook.stem + '.png')})"
    for number, cell in enumerate(cells, start=1):
        assert not cell["errors"], f"{where} code cell {number} failed:\n{cell['errors'][0][-2000:]}"
    not_run = [number for number, cell in enumerate(cells, start=1) if not cell["prompt"][1:2].isdigit()]
    assert not not_run, f"{where}: code cells {not_run} had not run after {budget} s (its budget)"
    # The code comes from the file: CodeMirror renders only the lines of a long cell that are in view.
    committed = json.loads(notebook.read_text())
    sources = ["".join(cell["source"]) for cell in committed["cells"] if cell["cell_type"] == "code"]
    assert len(sources) == len(cells), f"{where}: {len(cells)} code cells shown, {len(sources)} in the file"
    for number, (cell, source) in enumerate(zip(cells, sources, strict=True), start=1):
        if notebooks.draws(source):
            assert cell["images"] > 0, f"{where} code cell {number} draws, but no picture is on the page"
    differences = notebooks.output_differences(executed=saved, committed=committed)
    assert not differences, f"{where}: " + "\n".join(differences)
    print(f"{notebook.stem}: {took:.0f} s in JupyterLab (budget {budget} s)")
