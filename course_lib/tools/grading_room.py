"""Where a submission is graded: a room without the answers, a channel it cannot forge, a last word.

A list of forbidden calls is not a sandbox: every list has gaps (a directory-relative open, libc's
``open`` through ctypes, a program started by a path that raises no audit event, the solution's
cached bytecode). So the grading of a lab runs where the answers are not:

- **the room**: a scratch copy of ``course_lib`` and of the labs, without any lab's
  ``solution.py`` or ``solution_answers.toml`` (``SECRETS``), and the submission copied in. The
  grading process and every process it starts import the course from there;
- **namespaces**, where Linux allows them (``unshare``: as root, or with user namespaces): a mount
  namespace in which the repository's ``labs`` and ``.git`` (whose objects hold every solution)
  are empty, and a PID namespace whose first process is the grading's: when the judge ends it,
  the kernel ends every process in it, a detached grandchild too;
- **the channel**: the grading process sends each property's outcome to the judge through a pipe,
  every message signed with a key only it holds (HMAC-SHA256, RFC 2104); the key is wiped and the
  pipe closed in every process it forks (the sandboxes, the ranks), before a submission loads.
  A message that does not verify ends the grading as not graded;
- **the judge** (the process that runs ``labs check``, which never loads a submission) prints the
  signed lines, checks the answers against the keys itself, ends every process of the grading,
  and only then prints its verdict, last: what the submission printed is shown apart (on stderr,
  marked), and nothing it leaves behind can print after.

What this cannot stop without namespaces (a machine that allows none): code that finds the
repository by its absolute path and reads it through native calls; the audit hook of
``sandbox.seal`` still refuses Python's own ways. Cost: copying the package (a few MB) per
grading, a fraction of a second.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import course_lib

from . import REPOSITORY

SECRETS = ("solution.py", "solution_answers.toml")
"""What no process of a grading may find: each lab's solution and the keys to its questions."""
PACKAGE = Path(course_lib.__file__).resolve().parent
LABS = REPOSITORY / "labs"
HIDDEN_FOLDERS = ("labs", ".git")
"""The repository's folders a grading in namespaces sees empty."""
KEY_BYTES = 32


def build_room(scratch: Path, submission: Path) -> Path:
    """Copy the course and the labs without their ``SECRETS`` into ``scratch``, and the submission
    into ``scratch/submission/`` under its own name; return the submission's copy.

    Args:
        scratch: an empty folder of the judge's.
        submission: the student's file.
    """
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(PACKAGE, scratch / "course_lib", ignore=ignore)
    shutil.copytree(LABS, scratch / "labs", ignore=shutil.ignore_patterns("__pycache__", *SECRETS))
    copy = scratch / "submission" / submission.name
    copy.parent.mkdir()
    shutil.copyfile(submission, copy)
    return copy


@functools.cache
def namespace_prefix() -> tuple[str, ...]:
    """The ``unshare`` command that starts a process in a mount and a PID namespace of its own, or ()
    where this machine allows none (no ``unshare``, or no user namespaces for this user)."""
    unshare = shutil.which("unshare")
    if unshare is None or sys.platform != "linux":
        return ()
    user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    prefix = (unshare, *user, "--mount", "--pid", "--fork", "--mount-proc")
    try:
        tried = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return prefix if tried.returncode == 0 else ()


def command(python_argv: list[str]) -> list[str]:
    """``python_argv`` run in the namespaces where they exist, the repository's ``HIDDEN_FOLDERS`` folders
    covered with empty ones first; as it is elsewhere."""
    prefix = namespace_prefix()
    if not prefix:
        return python_argv
    hidden = [str(REPOSITORY / name) for name in HIDDEN_FOLDERS if (REPOSITORY / name).is_dir()]
    script = (
        'for folder in "$@"; do [ "$folder" = -- ] && break; '
        'mount -t tmpfs none "$folder" || exit 97; shift; done; shift; exec "$@"'
    )
    return [*prefix, "sh", "-c", script, "sh", *hidden, "--", *python_argv]


def new_key() -> bytes:
    """A fresh key for one grading's channel."""
    return os.urandom(KEY_BYTES)


def sign(key: bytes | bytearray, number: int, record: dict) -> str:
    """One channel message: the record, its number (so that none can be dropped or replayed), its MAC."""
    body = json.dumps({"n": number, "record": record}, sort_keys=True)
    return json.dumps({"body": body, "mac": hmac.new(bytes(key), body.encode(), hashlib.sha256).hexdigest()})


def verify(key: bytes, number: int, line: str) -> dict | None:
    """The record a channel line carries if it is the ``number``-th, signed with ``key``; else None."""
    try:
        message = json.loads(line)
        body, mac = message["body"], message["mac"]
        expected = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
        content = json.loads(body)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(mac, str) or not hmac.compare_digest(mac, expected) or content.get("n") != number:
        return None
    return content.get("record")


class Sender:
    """The grading process's end of the channel: its key and pipe, forgotten by every process it forks.

    Args:
        fd: the pipe's writing end, inherited from the judge.
        key: the channel's key, read from the judge.
    """

    def __init__(self, fd: int, key: bytes):
        self._fd, self._key, self._sent = fd, bytearray(key), 0
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """In a child: wipe the key in place and close the pipe, before anything else runs there."""
        for index in range(len(self._key)):
            self._key[index] = 0
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

    def send(self, record: dict) -> None:
        if self._fd < 0:
            raise RuntimeError("the channel belongs to the grading process, not to its children")
        data = (sign(self._key, self._sent, record) + "\n").encode()
        while data:
            data = data[os.write(self._fd, data) :]
        self._sent += 1
