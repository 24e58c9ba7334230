"""When the file system refuses a write, the run stops in one line and loses nothing it had finished.

The disks are real: small tmpfs file systems mounted in a mount namespace of the test's own
(``unshare --mount``), filled up while training writes its checkpoints and metrics.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env

EXIT_USER_ERROR = 2
CHECKPOINT_DISK_KB = 600  # room for one checkpoint of the digits CNN with Adam (about 430 kB), not two
QUICK = "--epochs 1 --no-progress --global-batch-size 60"


def _in_small_disks(tmp_path: Path, script: str) -> list[str]:
    """Run ``script`` (sh) where ``$CK`` and ``$MT`` are fresh tmpfs mounts; its output's lines."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "mt").mkdir()
    prelude = (
        f'set -u; CK={tmp_path}/ck; MT={tmp_path}/mt; TRAIN="{sys.executable} -m course_lib.train {QUICK}"\n'
        f"mount -t tmpfs -o size={CHECKPOINT_DISK_KB}k tmpfs $CK && mount -t tmpfs -o size=64k tmpfs $MT\n"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", prelude + script],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in the order things happened
        text=True,
        timeout=300,
    )
    assert "mount:" not in done.stdout, done.stdout  # the disks were made
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def full_disks(tmp_path_factory) -> list[str]:
    tmp = tmp_path_factory.mktemp("disks")
    return _in_small_disks(
        tmp,
        # a checkpoint every step: the first fits, the second fills the disk
        "$TRAIN --max-steps 3 --checkpoint-every 1 --checkpoint-dir $CK/run; echo status=$?\n"
        "echo listing: $(ls -A $CK/run)\n"
        "$TRAIN --max-steps 3 --checkpoint-dir $CK/run --resume latest --dry-run; echo status=$?\n"
        # the metrics disk is full before the first line: nothing may be left half-written
        "head -c 1000000 /dev/zero > $MT/filler 2>/dev/null\n"
        "$TRAIN --max-steps 1 --metrics $MT/metrics.jsonl; echo status=$?\n"
        "echo metrics bytes: $(wc -c < $MT/metrics.jsonl)\n",
    )


def _part(lines: list[str], index: int) -> list[str]:
    """The output lines of the ``index``-th command (each ends with ``status=N``)."""
    parts, current = [], []
    for line in lines:
        current.append(line)
        if line.startswith("status="):
            parts.append(current)
            current = []
    parts.append(current)
    return parts[index]


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one_and_says_so_in_one_line(full_disks):
    output = _part(full_disks, 0)
    assert output[-1] == f"status={EXIT_USER_ERROR}", full_disks
    [error] = [line for line in output if line.startswith("error:")]
    assert re.fullmatch(
        r"error: could not write checkpoint step-00000002 in \S+/ck/run \(No space left on device: "
        r"[\d.]+ MB free, and a checkpoint takes [\d.]+ MB\); the newest checkpoint, step-00000001, is "
        r"intact: free some space or choose another --checkpoint-dir, then rerun with --resume latest",
        error,
    ), full_disks
    assert not any("Traceback" in line for line in full_disks)


def test_nothing_half_written_is_left_for_resume_latest(full_disks):
    listing = next(line for line in full_disks if line.startswith("listing:"))
    assert listing == "listing: step-00000001"  # the partial step-00000002 was removed
    assert _part(full_disks, 1)[-2:] == ["configuration OK for 1 process(es)", "status=0"], full_disks


def test_a_full_disk_while_writing_metrics_stops_in_one_line_and_leaves_no_partial_line(full_disks):
    output = _part(full_disks, 2)
    assert output[-1] == f"status={EXIT_USER_ERROR}", full_disks
    errors = [line for line in output if line.startswith("error:")]
    assert len(errors) == 1 and "could not write the metrics to" in errors[0], full_disks
    assert "(No space left on device); the lines written before are intact" in errors[0]
    assert "metrics bytes: 0" in full_disks


def test_a_metrics_line_is_whole_or_absent(tmp_path):
    """Without a full disk, every line a run appends is a whole JSON record."""
    lines = _in_small_disks(
        tmp_path, "$TRAIN --max-steps 2 --metrics $MT/m.jsonl; echo status=$?\ncat $MT/m.jsonl\n"
    )
    assert "status=0" in lines, lines
    [record] = [json.loads(line) for line in lines if line.startswith("{")]
    assert record["steps"] == 2 and record["epoch_complete"] is False
