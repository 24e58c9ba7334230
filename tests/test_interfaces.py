"""What a student calls reads like PyTorch: options by keyword, a docstring entry per argument.

The set of functions and classes checked is not a hand-kept list: it is read from the teaching
material itself (every ``course_lib`` name the notebooks, the labs and the slides' code call),
plus every public class of the ``parallel/`` lessons (the entry points a student wraps a model
with; the dataclasses they return are records, not calls). For each one:

- every parameter is described in the docstring's ``Args:`` section (PyTorch's layout: one
  ``name: what it is`` entry per argument; for a class, in the class docstring);
- every parameter with a default (an option) is keyword-only, after ``*``, so a call reads as
  ``build_schedule("1f1b", 4, 8, virtual_stages=2)`` and never as a row of bare numbers;
- the teaching material calls no private name (``module._helper``).

Each parallel lesson also names the paper it follows.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import pkgutil
import re

import pytest

from conftest import REPO

PARALLEL_LESSONS = tuple(
    f"course_lib.{name}"
    for name in (
        "parallel.ddp",
        "parallel.flat_param",
        "parallel.zero",
        "parallel.fsdp",
        "parallel.tensor",
        "parallel.pipeline",
        "parallel.mesh",
        "train.three_d",
    )
)


def teaching_sources() -> list[tuple[str, str]]:
    """(where, python source) of every notebook, lab file and deck: a notebook's cells, like a deck's
    code blocks, share one namespace, so each is read as one source."""
    sources = []
    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = [
            "".join(cell["source"])
            for cell in json.loads(notebook.read_text())["cells"]
            if cell["cell_type"] == "code"
        ]
        lines = "\n".join(cells).split("\n")
        # IPython's own syntax (magics, shell escapes) is not Python
        sources.append(
            (notebook.name, "\n".join("" if line.lstrip()[:1] in "%!" else line for line in lines))
        )
    for path in sorted((REPO / "labs").rglob("*.py")):
        sources.append((str(path.relative_to(REPO)), path.read_text()))
    fence = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
    for deck in sorted((REPO / "slides").glob("*.md")):
        sources.append((deck.name, "\n".join(block.group(1) for block in fence.finditer(deck.read_text()))))
    return sources


def called_names(source: str) -> set[tuple[str, str]]:
    """(module, name) of every ``course_lib`` function or class this source calls or imports."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> course_lib module
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if _is_module(candidate):
                    modules[alias.asname or alias.name] = candidate
                else:
                    found.add((node.module, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("course_lib") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            found.add((modules[node.value.id], node.attr))
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def student_api() -> dict[str, object]:
    """``module.name`` -> the object, for everything the material calls and the parallel classes."""
    api = {}
    for _, source in teaching_sources():
        for module_name, name in called_names(source):
            value = getattr(importlib.import_module(module_name), name, None)
            if _defined_in_course_lib(value) and not name.startswith("_"):
                api[f"{module_name}.{name}"] = value
    for lesson in PARALLEL_LESSONS:
        package = importlib.import_module(lesson)
        inside = [f"{lesson}.{m.name}" for m in pkgutil.iter_modules(getattr(package, "__path__", []))]
        for module in (package, *map(importlib.import_module, inside)):  # a package: each of its files
            for name, value in vars(module).items():
                if (
                    inspect.isclass(value)
                    and value.__module__ == module.__name__
                    and not name.startswith("_")
                ):
                    # a dataclass is a record a lesson returns; one the material builds is found above
                    if _parameters(value) and not dataclasses.is_dataclass(value):
                        api[f"{module.__name__}.{name}"] = value
    return dict(sorted(api.items()))


def _defined_in_course_lib(value) -> bool:
    if inspect.isclass(value) and issubclass(value, BaseException):
        return False  # an error's only argument is its message
    return (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__.startswith("course_lib")


def _parameters(value) -> list[inspect.Parameter]:
    target = value.__init__ if inspect.isclass(value) else value
    if inspect.isclass(value) and target is object.__init__:
        return []
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    return [p for p in signature.parameters.values() if p.name not in ("self", "cls")]


def documented_arguments(value) -> set[str]:
    """The names of a docstring's ``Args:`` section (``name:`` or ``name (type):`` at its indent)."""
    doc = inspect.getdoc(value) or ""
    lines = doc.splitlines()
    if "Args:" not in [line.strip() for line in lines]:
        return set()
    start = [line.strip() for line in lines].index("Args:") + 1
    names, indent = set(), None
    for line in lines[start:]:
        if not line.strip():
            continue
        current = len(line) - len(line.lstrip())
        if indent is None:
            indent = current
        if current < indent:
            break
        match = re.match(r"\*{0,2}(\w+)(?: \([^)]*\))?:", line.strip())
        if current == indent and match:
            names.add(match.group(1))
    return names


def test_the_material_calls_a_real_api():
    """The discovery works: it finds the central pieces, so the checks below cannot pass empty."""
    api = student_api()
    for expected in (
        "course_lib.distributed.launch.launch",
        "course_lib.distributed.comm.all_reduce",
        "course_lib.parallel.ddp.DataParallel",
        "course_lib.parallel.fsdp.FullyShardedDataParallel",
        "course_lib.parallel.pipeline.build_schedule",
        "course_lib.distributed.runtime.rank",
    ):
        assert expected in api, f"{expected} not found among {sorted(api)}"
    assert len(api) > 40


def test_every_argument_a_student_passes_is_documented():
    missing = []
    for name, value in student_api().items():
        wanted = {p.name for p in _parameters(value)}
        undocumented = sorted(wanted - documented_arguments(value))
        if undocumented:
            missing.append(f"{name}: {', '.join(undocumented)}")
    assert missing == [], "no Args: entry for\n" + "\n".join(missing)


def _the_verbs_group(name: str, parameter: str) -> bool:
    """A technique's verb takes its group (or mesh) second, by position, as torchtitan's
    ``apply_tp(model, tp_mesh)`` does (``test_architecture.VERBS``): no other option may."""
    return name.rpartition(".")[2].startswith("apply_") and parameter in ("group", "group_or_mesh")


def test_options_are_keyword_only():
    positional = []
    for name, value in student_api().items():
        options = [
            p.name
            for p in _parameters(value)
            if p.default is not inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            and not _the_verbs_group(name, p.name)
        ]
        if options:
            positional.append(f"{name}: {', '.join(options)}")
    assert positional == [], "options that should come after `*`:\n" + "\n".join(positional)


def test_the_material_calls_no_private_name():
    private = sorted(
        f"{where}: {module}.{name}"
        for where, source in teaching_sources()
        for module, name in called_names(source)
        if name.startswith("_") and not name.startswith("__")
    )
    assert private == [], "call a public function by name instead:\n" + "\n".join(private)


@pytest.mark.parametrize("lesson", PARALLEL_LESSONS)
def test_each_parallel_lesson_names_its_paper(lesson):
    doc = importlib.import_module(lesson).__doc__
    assert re.search(r"(Paper|Papers|This is)\b.*?(19|20)\d\d", doc, re.S), (
        f"{lesson.replace('.', '/')}.py: say which paper the lesson follows (authors, title, year)"
    )


def test_the_args_reader_reads_pytorch_style_sections():
    def example(tensor, *, op="sum", group=None):
        """Reduce.

        Args:
            tensor: the input; it is
                overwritten.
            op (str): ``"sum"`` or ``"mean"``.

        Returns:
            group: not an argument (another section).
        """

    assert documented_arguments(example) == {"tensor", "op"}
