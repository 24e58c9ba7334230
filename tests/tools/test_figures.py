"""The slides' figures are drawn by `python -m course_lib.tools.figures`; the committed ones are current."""

from __future__ import annotations

import io
import statistics

import numpy as np
from PIL import Image

from course_lib.distributed import ring
from course_lib.tools import figures

from conftest import REPO

IMAGES = REPO / "slides" / "public" / "images"


def _same_picture(drawn: bytes, committed: bytes) -> bool:
    """The same pixels, but for antialiasing one level off: numpy's vectorised logarithm can differ in
    the last bit between processors (AVX-512 against AVX2), which moves a line on a log axis by a
    fraction of a pixel (measured: 11 pixels one level apart of 255). A changed label, line or
    colour moves pixels by tens of levels."""
    if drawn == committed:
        return True
    pixels = [
        np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"), dtype=np.int16) for png in (drawn, committed)
    ]
    return pixels[0].shape == pixels[1].shape and int(np.abs(pixels[0] - pixels[1]).max()) <= 2


def test_every_committed_figure_is_what_the_command_draws_now(tmp_path):
    fresh = {path.name: path.read_bytes() for path in figures.draw_all(tmp_path)}
    committed = {path.name: path.read_bytes() for path in IMAGES.glob("*.png")}
    missing = sorted(set(fresh) - set(committed))
    orphans = sorted(set(committed) - set(fresh))
    stale = sorted(
        name for name in set(fresh) & set(committed) if not _same_picture(fresh[name], committed[name])
    )
    assert not (missing or orphans or stale), (
        f"missing {missing}, drawn by nothing {orphans}, stale {stale}: run `python -m "
        "course_lib.tools.figures slides/public/images` and commit the images"
    )


def test_the_ring_counts_end_with_every_chunk_complete_on_every_rank():
    frames = ring.ring_all_reduce_counts(4)
    assert len(frames) == 1 + 2 * 3
    assert frames[3] == [[1, 4, 3, 2], [2, 1, 4, 3], [3, 2, 1, 4], [4, 3, 2, 1]]  # rank r owns chunk r + 1
    assert frames[-1] == [[4] * 4] * 4


def test_what_the_slides_say_of_the_recorded_measurements_is_what_was_recorded():
    import json

    prefetch, plain = (json.loads(path.read_text()) for path in figures.RECORDED_FSDP.values())
    assert prefetch["hidden_communication_ms"] > plain["hidden_communication_ms"]
    assert prefetch["exposed_communication_share"] < plain["exposed_communication_share"]
    lecture_4 = " ".join((REPO / "slides" / "04-zero-fsdp.md").read_text().split())
    assert "more of what is in flight (the lower lanes) runs while the rank computes" in lecture_4
    recorded = json.loads(figures.RECORDED_PLAN_CHECK.read_text())
    ratios = [row["step_s"]["measured_over_predicted"] for row in recorded["layouts"] if row["own_core"]]
    slower, median = sum(ratio > 1 for ratio in ratios), statistics.median(ratios)
    within = recorded["step_time_within_1_33"].split(" layouts")[0]  # "13 of 14"
    lecture_9 = " ".join((REPO / "slides" / "09-choosing-a-layout.md").read_text().split())
    assert (
        f"measured **slower** than predicted on {slower} of {len(ratios)} layouts, median {median:.2f}×"
        in (lecture_9)
    )
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"measured slower than predicted on {slower} of the {len(ratios)} layouts" in readme
    assert (
        f"median measured/predicted {median:.2f}, within a factor 1.33 on {within.split(' of ')[0]}" in readme
    )
