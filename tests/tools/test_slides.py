"""The lecture slides: checked against the code, numbered as Slidev numbers them, built and looked at.

The first part needs only Python: every deck passes ``course_lib.tools.slides check`` (images, code
imports, python blocks run, command lines parse), and each kind of breakage is reported with its
deck and slide number. The second part (marker ``slides``) builds and exports the decks with the
pinned Slidev and Chromium, with no network, and looks at the result.
"""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from course_lib.tools import figures, slides

from conftest import REPO

DECKS = slides.decks()
LECTURES = [
    "why-distributed",
    "communication",
    "data-parallel",
    "zero-fsdp",
    "tensor-pipeline-3d",
    "slurm",
    "lab",
    "sequence-context-experts",
    "choosing-a-layout",
    "overlap-float8-compile",
]


def test_there_is_one_deck_per_lecture_in_order():
    assert [deck.stem.split("-", 1)[1] for deck in DECKS] == LECTURES


@pytest.mark.parametrize("deck", DECKS, ids=[deck.stem for deck in DECKS])
def test_every_deck_passes_the_check(deck):
    assert slides.check_deck(deck) == []


@pytest.mark.parametrize("deck", DECKS, ids=[deck.stem for deck in DECKS])
def test_every_deck_is_configured_to_work_offline(deck):
    headmatter = "\n".join(slides.split_slides(deck.read_text())[0].frontmatter)
    for setting in ("provider: none", "favicon: /favicon.svg", "routerMode: hash", "theme: default"):
        assert setting in headmatter, f"{deck.name}: the headmatter lacks `{setting}`"
    assert (slides.PUBLIC_DIR / "favicon.svg").is_file()


def test_the_decks_show_every_figure_the_code_draws_and_nothing_else():
    shown = {
        Path(image).name
        for deck in DECKS
        for slide in slides.split_slides(deck.read_text())
        for image in slides.referenced_images(slide)
    }
    drawn = {f"{name}.png" for name in figures.FIGURES}
    assert shown == drawn, (
        f"shown but not drawn: {sorted(shown - drawn)}, drawn but not shown: {sorted(drawn - shown)}"
    )


def test_the_decks_quote_real_code_regions():
    imports = [
        text
        for deck in DECKS
        for slide in slides.split_slides(deck.read_text())
        for _, text in slide.content
        if text.startswith("<<< @/course_lib/")
    ]
    assert len(imports) >= 5


# -- slide numbers as Slidev counts them --------------------------------------------------------
TRICKY_DECK = """\
---
theme: default
title: headmatter, also the first slide's frontmatter
---

# one

```python
x = 1
---
```

---
layout: two-cols
---

# two

<!--
---
-->

---

# three
----
four: four dashes cut too, but never start frontmatter
"""


def test_slides_are_cut_where_slidev_cuts_them():
    cut = slides.split_slides(TRICKY_DECK)
    assert [slide.number for slide in cut] == [1, 2, 3, 4]
    assert cut[0].frontmatter[0] == "theme: default"
    assert [b.lines for b in cut[0].blocks] == [["x = 1", "---"]]  # a --- inside code does not cut
    assert cut[1].frontmatter == ["layout: two-cols"]
    assert any(text == "# two" for _, text in cut[1].content)
    assert any(text == "# three" for _, text in cut[2].content)
    assert cut[3].content[0][1].startswith("four:")
    assert cut[2].first_line == 24  # the line after its ---


# -- what breakage looks like -------------------------------------------------------------------
def _deck(tmp_path, body: str) -> Path:
    deck = tmp_path / "09-broken.md"
    deck.write_text("---\ntheme: default\n---\n\n# fine\n\n---\n\n" + textwrap.dedent(body))
    return deck


def test_a_missing_image_is_named_with_its_slide(tmp_path):
    deck = _deck(tmp_path, "# two\n\n![gone](/images/renamed_figure.png)\n")
    [problem] = slides.check_deck(deck)
    assert "09-broken.md, slide 2" in problem and "/images/renamed_figure.png does not exist" in problem
    assert "python -m course_lib.tools.figures" in problem


def test_an_image_from_the_internet_is_refused(tmp_path):
    deck = _deck(tmp_path, '# two\n\n<img src="https://example.com/photo.png">\n')
    [problem] = slides.check_deck(deck)
    assert "slide 2" in problem and "comes from the internet" in problem


def test_a_snippet_that_no_longer_runs_fails_with_its_slide_and_line(tmp_path):
    deck = _deck(
        tmp_path,
        """\
        # two

        ```python
        from course_lib.parallel import memory
        ```

        ---

        # three

        ```python
        memory.model_state_bytes(1e9, world_size=4, sharding="zero4")
        ```
        """,
    )
    [problem] = slides.check_deck(deck)
    assert "09-broken.md, slide 3: the python block at line 20 failed: UserError" in problem
    assert "unknown sharding 'zero4'" in problem
    assert f'File "{deck}", line 20' in problem  # the traceback points into the deck itself


@pytest.mark.slow
def test_a_snippet_that_hangs_is_stopped_with_the_processes_it_started(tmp_path):
    deck = _deck(
        tmp_path,
        """\
        # two

        ```python
        import time
        from course_lib.distributed.launch import launch

        launch(time.sleep, 2, 600)
        ```
        """,
    )
    started = time.monotonic()
    [problem] = slides.run_python_blocks(deck, slides.split_slides(deck.read_text()), timeout_s=8)
    assert time.monotonic() - started < 60
    assert "09-broken.md: its python blocks did not finish within 8 s" in problem
    leftovers = subprocess.run(["pgrep", "-f", f"_run-python {deck}"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


def test_a_code_import_of_a_missing_region_or_file_is_named(tmp_path):
    deck = _deck(
        tmp_path,
        """\
        # two

        <<< @/course_lib/distributed/comm.py#no-such-region python

        <<< @/course_lib/no_such_file.py python
        """,
    )
    problems = slides.check_deck(deck)
    assert len(problems) == 2
    assert "slide 2: code import @/course_lib/distributed/comm.py#no-such-region" in problems[0]
    assert "has no region 'no-such-region'" in problems[0]
    assert "slide 2: code import @/course_lib/no_such_file.py names no file" in problems[1]


def test_a_command_line_the_tool_refuses_is_named_with_slide_and_line(tmp_path):
    deck = _deck(
        tmp_path,
        """\
        # two

        ```bash
        torchrun --nproc-per-node 2 -m course_lib.train --sharding ddp \\
            --global-batch-sise 64
        sbatch slurm/no_such_job.sbatch
        python -m course_lib.tools.study submit --gpus 1 2 --shardings ddp
        ```
        """,
    )
    problems = slides.check_deck(deck)
    assert len(problems) == 2, problems
    assert (
        "09-broken.md, slide 2, line 12: `python -m course_lib.train` refuses this command line"
        in problems[0]
    )
    assert "--global-batch-sise" in problems[0]
    assert "slide 2, line 14: slurm/no_such_job.sbatch does not exist" in problems[1]


def test_the_check_command_exits_non_zero_and_names_the_problem(tmp_path):
    deck = _deck(tmp_path, "# two\n\n![gone](/images/gone.png)\n")
    shown = subprocess.run(
        [sys.executable, "-m", "course_lib.tools.slides", "check", str(deck)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 1
    assert "FAIL" in shown.stdout and "slide 2: image /images/gone.png does not exist" in shown.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "course_lib.tools.slides", "check", "slides/99-nothing.md"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "no such deck" in missing.stderr


# -- built, exported, looked at (Slidev + Chromium) ---------------------------------------------
def _offline_prefix() -> list[str]:
    """A command prefix that runs with no network but loopback (a new network namespace)."""
    prefix = ["unshare", "--net", "--map-root-user", "sh", "-c", 'ip link set lo up && exec "$@"', "offline"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    assert probe.returncode == 0, (
        "the slides are built in a network namespace to prove they need no network, and this machine cannot "
        f"create one ({probe.stderr.strip()}); run `make test-fast` to leave the slides out"
    )
    return prefix


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every deck built and exported (PDF and PNG) by `make slides-build`, with no network."""
    setup = subprocess.run(
        ["make", "--no-print-directory", "slides-setup"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert setup.returncode == 0, setup.stdout + setup.stderr
    out = tmp_path_factory.mktemp("slides")
    build = subprocess.run(
        # pages drawn 640 pixels wide: enough to see ink and figures, in a fraction of the time
        [
            *_offline_prefix(),
            "make",
            "--no-print-directory",
            "slides-build",
            f"SLIDES_OUT={out}",
            "SLIDES_PNG_WIDTH=640",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return out


def _slide_count(deck: Path) -> int:
    return len(slides.split_slides(deck.read_text()))


@pytest.mark.slides
def test_every_deck_builds_offline_into_a_static_site(built):
    for deck in DECKS:
        page = built / "site" / deck.stem / "index.html"
        assert page.is_file(), f"{deck.name} was not built"
        assert "./assets/" in page.read_text()  # relative links: the folder can be served from anywhere
    index = (built / "site" / "index.html").read_text()
    for deck in DECKS:
        title = next(
            line for line in slides.split_slides(deck.read_text())[0].frontmatter if line.startswith("title:")
        )
        assert f'<a href="{deck.stem}/">{title.split(":", 1)[1].strip().strip(chr(34))}</a>' in index


@pytest.mark.slides
def test_the_export_has_one_page_per_slide(built):
    assert shutil.which("pdfinfo"), "counting PDF pages needs pdfinfo: apt-get install poppler-utils"
    for deck in DECKS:
        info = subprocess.run(
            ["pdfinfo", str(built / "pdf" / f"{deck.stem}.pdf")], capture_output=True, text=True
        )
        pages = int(next(line.split()[-1] for line in info.stdout.splitlines() if line.startswith("Pages:")))
        pngs = list((built / "png" / deck.stem).glob("*.png"))
        assert pages == len(pngs) == _slide_count(deck), deck.name


@pytest.mark.slides
def test_rendered_pages_are_not_blank(built):
    from PIL import Image

    looked_at = 0
    for deck in DECKS:
        with_images = {
            slide.number for slide in slides.split_slides(deck.read_text()) if slides.referenced_images(slide)
        }
        for number in {1} | with_images:
            page = Image.open(built / "png" / deck.stem / f"{number}.png").convert("L")
            histogram = page.histogram()
            dark = sum(histogram[:200]) / sum(histogram)  # ink: anything clearly darker than the background
            assert dark > 0.005, f"{deck.name} slide {number} looks blank ({dark:.2%} ink)"
            if number in with_images:  # a figure brings many shades, text alone a few
                assert sum(1 for count in histogram if count) > 100, (
                    f"{deck.name} slide {number}: no figure drawn"
                )
            looked_at += 1
    assert looked_at >= len(DECKS) + len(figures.FIGURES)


@pytest.fixture
def served(built):
    """The built site on a loopback HTTP server."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(built / "site"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.slides
def test_the_built_decks_request_nothing_outside_the_machine_and_every_slide_fits(served):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    for deck in DECKS:
        shown = subprocess.run(
            ["node", "check-built-decks.mjs", chromium, f"{served}/{deck.stem}/", str(_slide_count(deck))],
            cwd=REPO / "slides",
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert shown.returncode == 0, shown.stderr
        report = json.loads(shown.stdout)
        assert report["requests"] == [], f"{deck.name} fetched from outside: {report['requests']}"
        assert report["brokenImages"] == [], f"{deck.name}: {report['brokenImages']}"
        assert report["overflows"] == [], f"{deck.name}: content cut off: {report['overflows']}"
        expected = sorted(
            (slide.number, Path(image).name)
            for slide in slides.split_slides(deck.read_text())
            for image in slides.referenced_images(slide)
        )
        assert (
            sorted((image["slide"], Path(image["src"]).name) for image in report["loadedImages"]) == expected
        )
