"""What the full test suite needs from the operating system, installed when it is missing.

``make test`` runs everything: the slide decks are built with Node.js and exported with Chromium,
their PDFs counted with ``pdfinfo``, the job scripts submitted to a real Slurm. Those programs
come from the operating system, not from pip. This step (run by ``make test`` before any test)
looks for each of them and, on Debian or Ubuntu where it may install packages (root, or a
password-less ``sudo``), installs the missing ones with ``apt-get``. Where it may not, it stops
with one line that names the exact command to run, and a non-zero exit, before any test starts.

Node.js is the exception: Debian 12 ships Node 18 and the pinned Slidev needs 20, so a missing
or old Node is reported with where to get it, never installed behind the user's back.

Run by hand::

    python3 course_lib/tools/system_deps.py            # install what is missing (or say how)
    python3 course_lib/tools/system_deps.py --dry-run  # only say what would be installed

It uses the standard library alone and imports nothing from ``course_lib``, so it runs with the
system's Python before the virtual environment exists.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

EXIT_MISSING = 2
"""Exit status when something is missing and this machine cannot install it here."""

MINIMUM_NODE_MAJOR = 20
DEJAVU_FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")


@dataclass(frozen=True)
class Requirement:
    """One Debian package and how to tell that it is already there."""

    package: str
    used_for: str
    commands: tuple[str, ...] = ()  # present if any of these is on PATH
    files: tuple[Path, ...] = ()  # ... or any of these files exists

    def present(self) -> bool:
        return any(shutil.which(command) for command in self.commands) or any(
            path.exists() for path in self.files
        )


REQUIREMENTS = (
    Requirement(
        "chromium", "exporting the slides and opening them", commands=("chromium", "chromium-browser")
    ),
    Requirement("poppler-utils", "counting the exported PDF pages", commands=("pdfinfo",)),
    Requirement("fonts-dejavu-core", "the slides' offline fonts", files=(DEJAVU_FONT,)),
    Requirement("iproute2", "a loopback-only network to prove the slides build offline", commands=("ip",)),
    Requirement("util-linux", "network namespaces (unshare)", commands=("unshare",)),
    Requirement("slurmctld", "the local Slurm cluster's controller", commands=("slurmctld",)),
    Requirement("slurmd", "the local Slurm cluster's node daemon", commands=("slurmd",)),
    Requirement("slurm-client", "sbatch, squeue, scontrol", commands=("sbatch",)),
    Requirement("munge", "Slurm's authentication", commands=("munged",)),
)


def missing_packages() -> list[Requirement]:
    return [requirement for requirement in REQUIREMENTS if not requirement.present()]


def node_problem() -> str | None:
    """Why the installed Node.js cannot build the slides, or None if it can."""
    if not shutil.which("node") or not shutil.which("npm"):
        return "Node.js (with npm) is not installed"
    shown = subprocess.run(["node", "--version"], capture_output=True, text=True)
    version = shown.stdout.strip()
    try:
        major = int(version.lstrip("v").split(".")[0])
    except ValueError:
        return f"`node --version` printed {version!r}, not a version"
    if major < MINIMUM_NODE_MAJOR:
        return f"Node.js {version} is too old"
    return None


def install_command(packages: list[str]) -> list[list[str]]:
    """The apt-get calls that install ``packages`` (prefixed with sudo when not root)."""
    prefix = [] if os.geteuid() == 0 else ["sudo"]
    return [[*prefix, "apt-get", "update", "-qq"], [*prefix, "apt-get", "install", "-y", "-qq", *packages]]


def may_install() -> bool:
    """True where this user may run apt-get: root, or a password-less sudo."""
    if os.geteuid() == 0:
        return True
    return (
        bool(shutil.which("sudo"))
        and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="course_lib/tools/system_deps.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--dry-run", action="store_true", help="say what would be installed, install nothing")
    args = parser.parse_args(argv)

    problem = node_problem()
    if problem:
        print(
            f"error: {problem}; the slide tests need Node.js {MINIMUM_NODE_MAJOR} or newer: install it from "
            "https://nodejs.org/en/download (or run `make test-fast`, which needs no Node)",
            file=sys.stderr,
        )
        return EXIT_MISSING
    missing = missing_packages()
    if not missing:
        print("system packages: everything the tests need is installed")
        return 0
    names = [requirement.package for requirement in missing]
    commands = install_command(names)
    shown = " && ".join(shlex.join(command) for command in commands)
    if args.dry_run:
        print(f"would install: {' '.join(names)}")
        for requirement in missing:
            print(f"  {requirement.package}: {requirement.used_for}")
        print(f"with: {shown}")
        return 0
    if not shutil.which("apt-get"):
        print(
            f"error: the tests need {' '.join(names)} (Debian's package names) and this machine has no "
            "apt-get: install them with its own package manager (or run `make test-fast`, which needs none "
            "of them)",
            file=sys.stderr,
        )
        return EXIT_MISSING
    if not may_install():
        print(
            f"error: the tests need these system packages, and this user cannot install them: run `{shown}` "
            "as an administrator (or `make test-fast`, which needs none of them)",
            file=sys.stderr,
        )
        return EXIT_MISSING
    print(f"Installing the system packages the tests need (once): {' '.join(names)}", flush=True)
    environment = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in commands:
        finished = subprocess.run(command, env=environment, stdout=subprocess.DEVNULL)
        if finished.returncode != 0:
            print(
                f"error: `{shlex.join(command)}` failed with exit status {finished.returncode} (its message "
                "is above); fix that and run `make test` again",
                file=sys.stderr,
            )
            return EXIT_MISSING
    still_missing = [requirement.package for requirement in missing_packages()]
    if still_missing:
        print(f"error: after installing, still missing: {' '.join(still_missing)}", file=sys.stderr)
        return EXIT_MISSING
    return 0


if __name__ == "__main__":
    sys.exit(main())
