"""Run the notebooks as a student would and check what they leave on the page.

    python -m course_lib.tools.notebooks run [NAME ...]   execute in place, outputs saved
    python -m course_lib.tools.notebooks check            what the committed outputs must hold

``run`` executes each notebook top to bottom in a fresh kernel started in ``notebooks/`` (the
folder JupyterLab starts it in), with the environment a student has: no matplotlib backend chosen
from outside, so the figures come out as inline images. The outputs it saves are the reference
that a new execution's text must reproduce (``output_differences``, nbval's rules). ``check``
finds, in the committed outputs:

- a cell that draws (it calls ``plt.``, ``plots.`` or ``figures.``) with no ``image/png`` output;
- an output that holds an absolute path of the machine that ran it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import time
from pathlib import Path

from . import prose
from .prose import IGNORE_OUTPUT, output_text

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
DRAWING_MODULES = ("plt", "plots", "figures")
SANITIZE_CONFIG = NOTEBOOKS / "nbval_sanitize.cfg"
"""Regular expressions (nbval's format) for outputs that depend on the machine, removed before comparing."""
# Outputs compared as nbval compares them: text of every kind, not pictures (their bytes differ
# from one matplotlib build to another; that a picture is there is checked separately).
NOT_COMPARED = ("image/png", "image/jpeg", "application/vnd.jupyter.widget-view+json")
# A path that names a machine's folders: /home/..., /Users/..., /work/..., /tmp/..., C:\...
MACHINE_PATH = re.compile(
    r"(?<![\w.~])(?:/(?:home|Users|root|work|tmp|scratch|capstor|users|private|var|mnt|opt)/|[A-Z]:\\\\?\w)"
)


def notebook_paths(names: list[str] | None = None) -> list[Path]:
    """The course's notebooks in order, or those named (with or without ``.ipynb``).

    Args:
        names: notebook names such as ``07_pipeline_schedules``; None for all of them.
    """
    every = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return every
    by_name = {path.stem: path for path in every}
    unknown = [name for name in names if name.removesuffix(".ipynb") not in by_name]
    if unknown:
        raise SystemExit(f"error: no notebook {', '.join(unknown)}; there are: {', '.join(by_name)}")
    return [by_name[name.removesuffix(".ipynb")] for name in names]


def draws(source: str) -> bool:
    """Whether a code cell draws: it calls a function of ``plt``, ``plots`` or ``figures``.

    Args:
        source: the cell's code (IPython magics such as ``%matplotlib inline`` are allowed).
    """
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    for node in ast.walk(ast.parse(code)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in DRAWING_MODULES
        ):
            return True
    return False


def problems(path: Path) -> list[str]:
    """What is wrong with a notebook's committed outputs, one line each naming the cell.

    Args:
        path: the ``.ipynb`` file.
    """
    found = []
    notebook = json.loads(path.read_text())
    code_cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    for number, cell in enumerate(code_cells, start=1):
        source = "".join(cell["source"])
        outputs = cell.get("outputs", [])
        where = f"{path.name} code cell {number}"
        if draws(source) and not any("image/png" in output.get("data", {}) for output in outputs):
            found.append(f"{where} draws but shows no image: end it with the Figure, or display() each one")
        for output in outputs:
            text = output_text(output)
            match = MACHINE_PATH.search(text)
            if match:
                line = text[text.rfind("\n", 0, match.start()) + 1 :].split("\n", 1)[0]
                found.append(f"{where} shows a path of this machine: {line.strip()[:120]}")
    return found


def _compared_outputs(outputs: list, patterns: list[tuple[str, str]]) -> dict[str, list]:
    """A cell's outputs as nbval compares them: streams merged by name, then every text value by its
    kind (stdout, stderr, text/plain, text/html, ename...), with the machine-dependent parts removed.

    Args:
        outputs: the cell's outputs, as nbformat reads them (text joined into strings).
        patterns: (regex, replacement) pairs from ``nbval_sanitize.cfg``.
    """
    from nbval.plugin import coalesce_streams

    compared: dict[str, list] = {}
    for output in coalesce_streams(outputs):
        if output.output_type == "stream":
            values = {output.name: output.text}
        elif output.output_type == "error":
            values = {"ename": output.ename, "evalue": output.evalue}
        else:
            values = {kind: text for kind, text in output.get("data", {}).items() if kind not in NOT_COMPARED}
        for kind, text in values.items():
            if isinstance(text, str):
                for regex, replacement in patterns:
                    text = re.sub(regex, replacement, text)
            compared.setdefault(kind, []).append(text)
    return compared


def output_differences(executed: dict, committed: dict) -> list[str]:
    """Where a fresh execution of a notebook shows other text than its committed outputs.

    The rules are nbval's: a cell marked ``# NBVAL_IGNORE_OUTPUT`` only has to run; in the others,
    the stream outputs (merged by name) and every textual result must be the same, once the
    patterns of ``nbval_sanitize.cfg`` are removed; images are not compared.

    Args:
        executed: the notebook (parsed JSON) as the new execution saved it.
        committed: the committed notebook, same cells.
    """
    import nbformat
    from nbformat.v4.rwbase import rejoin_lines
    from nbval.plugin import get_sanitize_patterns

    patterns = get_sanitize_patterns(SANITIZE_CONFIG.read_text())
    # As nbformat reads a file: copies whose text, stored as lists of lines, is joined into strings.
    executed, committed = (rejoin_lines(nbformat.from_dict(notebook)) for notebook in (executed, committed))
    ran = [cell for cell in executed.cells if cell.cell_type == "code"]
    reference = [cell for cell in committed.cells if cell.cell_type == "code"]
    if len(ran) != len(reference):
        return [f"{len(ran)} code cells were executed, the committed notebook has {len(reference)}"]
    found = []
    for number, (new, old) in enumerate(zip(ran, reference), start=1):
        if IGNORE_OUTPUT in (line.strip() for line in old.source.splitlines()):
            continue
        got = _compared_outputs(new.outputs, patterns)
        expected = _compared_outputs(old.outputs, patterns)
        if got != expected:
            kinds = sorted(set(got) | set(expected))
            kind = next(kind for kind in kinds if got.get(kind) != expected.get(kind))
            found.append(
                f"code cell {number}: its {kind} output differs from the committed one\n"
                f"  committed: {expected.get(kind)!r:.600}\n  now:       {got.get(kind)!r:.600}"
            )
    return found


def run(paths: list[Path], *, cell_timeout: int = 600) -> None:
    """Execute notebooks in place, as JupyterLab would, and save their outputs.

    Args:
        paths: the notebooks to run.
        cell_timeout: seconds a cell may take before the run stops with an error.
    """
    import nbformat
    from nbclient import NotebookClient

    # A student's kernel has no backend chosen from outside: the figures must show inline. And it
    # imports this checkout's course_lib, whichever one the virtual environment was installed from.
    os.environ.pop("MPLBACKEND", None)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(NOTEBOOKS.parent), os.environ.get("PYTHONPATH")])
    )
    for path in paths:
        started = time.perf_counter()
        notebook = nbformat.read(path, as_version=4)
        NotebookClient(
            notebook,
            timeout=cell_timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(NOTEBOOKS)}},
        ).execute()
        nbformat.write(notebook, path)
        print(f"{path.name}: ran in {time.perf_counter() - started:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.tools.notebooks", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="execute notebooks in place and save their outputs")
    run_parser.add_argument(
        "names", nargs="*", help="notebooks to run (default: all), e.g. 07_pipeline_schedules"
    )
    commands.add_parser(
        "check",
        help="check the committed outputs: images where cells draw, no machine paths, no number in the "
        "prose that the code beside it does not hold (tools/prose.py)",
    )
    args = parser.parse_args(argv)
    paths = notebook_paths(getattr(args, "names", None))
    if args.command == "run":
        run(paths)
    found = [problem for path in paths for problem in [*problems(path), *prose.problems(path)]]
    for problem in found:
        print(problem, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
