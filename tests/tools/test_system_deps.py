"""`make test` installs the system packages its tests need, or says in one line how; CI runs `make test`."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.tools import system_deps

from conftest import REPO

EVERY_COMMAND = sorted(
    {command for requirement in system_deps.REQUIREMENTS for command in requirement.commands}
)


def _fake_bin(folder: Path, *commands: str, node_version: str = "v20.20.2") -> Path:
    """A PATH folder holding stand-ins for ``commands`` (and a Node.js that prints ``node_version``)."""
    folder.mkdir(exist_ok=True)
    for command in [*commands, "npm"]:
        (folder / command).write_text("#!/bin/sh\nexit 0\n")
    (folder / "node").write_text(f"#!/bin/sh\necho {node_version}\n")
    for script in folder.iterdir():
        script.chmod(0o755)
    return folder


def _run(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "course_lib" / "tools" / "system_deps.py"), *args],
        cwd=REPO,
        env={"PATH": str(path), "HOME": os.environ.get("HOME", "/root")},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_dry_run_names_every_missing_package_and_installs_nothing(tmp_path):
    shown = _run(_fake_bin(tmp_path / "bin"), "--dry-run")
    assert shown.returncode == 0, shown.stderr
    would = shown.stdout.splitlines()[0]
    for package in ("chromium", "poppler-utils", "iproute2", "slurmctld", "slurmd", "slurm-client", "munge"):
        assert package in would.split(), shown.stdout
    assert "chromium: exporting the slides and opening them" in shown.stdout
    assert "with: apt-get update -qq && apt-get install -y -qq chromium" in shown.stdout


def test_nothing_is_installed_when_everything_is_there(tmp_path, monkeypatch, capsys):
    font = tmp_path / "DejaVuSans.ttf"
    font.write_bytes(b"")
    monkeypatch.setattr(
        system_deps,
        "REQUIREMENTS",
        tuple(
            dataclasses.replace(requirement, files=(font,)) if requirement.files else requirement
            for requirement in system_deps.REQUIREMENTS
        ),
    )
    monkeypatch.setenv("PATH", str(_fake_bin(tmp_path / "bin", *EVERY_COMMAND)))
    assert system_deps.main([]) == 0
    assert "everything the tests need is installed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "version, problem",
    [(None, "Node.js (with npm) is not installed"), ("v18.19.0", "Node.js v18.19.0 is too old")],
)
def test_a_missing_or_old_node_is_named_with_where_to_get_it(tmp_path, version, problem):
    folder = _fake_bin(tmp_path / "bin", *EVERY_COMMAND, node_version=version or "v20.0.0")
    if version is None:
        (folder / "node").unlink()
    shown = _run(folder)
    assert shown.returncode == system_deps.EXIT_MISSING
    assert shown.stderr.strip().splitlines() == [
        f"error: {problem}; the slide tests need Node.js 20 or newer: install it from "
        "https://nodejs.org/en/download (or run `make test-fast`, which needs no Node)"
    ]


def test_a_user_who_cannot_install_is_told_the_exact_command(tmp_path, monkeypatch, capsys):
    # no sudo, no chromium, no Slurm
    folder = _fake_bin(tmp_path / "bin", "apt-get", "pdfinfo", "ip", "unshare")
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert system_deps.main([]) == system_deps.EXIT_MISSING
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "error: the tests need these system packages, and this user cannot install them: run `sudo apt-get "
        "update -qq && sudo apt-get install -y -qq chromium slurmctld slurmd slurm-client munge` as an "
        "administrator"
    )


def test_a_machine_without_apt_is_told_the_package_names(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(_fake_bin(tmp_path / "bin")))
    assert system_deps.main([]) == system_deps.EXIT_MISSING
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "this machine has no apt-get: install them with its own package manager" in line


def test_the_install_step_runs_before_the_tests_and_ci_runs_only_make_test():
    make = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert make.index("course_lib/tools/system_deps.py") < make.index("-m pytest")
    commands = [
        line.strip()
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert commands == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', "exec make test"]


def test_the_system_step_uses_only_the_standard_library():
    """It runs with the system's Python, before the virtual environment exists."""
    shown = subprocess.run(
        [
            shutil.which("python3") or sys.executable,
            "-I",
            "-c",
            "import runpy, sys; sys.argv = ['x', '--help']; "
            f"runpy.run_path({str(REPO / 'course_lib' / 'tools' / 'system_deps.py')!r}, run_name='__main__')",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0 and "--dry-run" in shown.stdout, shown.stderr
