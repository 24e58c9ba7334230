"""The package's shape, read from its source: data flows down, lessons never reach the tools.

``course_lib`` holds lessons (what a student reads) and, in ``course_lib/tools``, what serves the
course (benchmarks, plots, the slide checker, the lab commands). Tools import lessons; a lesson
never imports a tool, never draws, never picks a matplotlib backend, and no two modules import
each other, directly or around a loop. Run with ``-s`` to see the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "course_lib"
TOOLS = "course_lib.tools"
# What the harness is made of: the parallel lessons may not know about it (no registration, no plumbing).
HARNESS = {"course_lib.strategies", "course_lib.trainer", "course_lib.train", "course_lib.checkpoint"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """Every course_lib module ``name`` imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "course_lib")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "course_lib":
                continue
            for alias in node.names:  # `from . import comm` imports a module, `from .errors import X` a name
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def is_tool(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def describe(graph: dict[str, set[str]]) -> str:
    def short(name: str) -> str:
        return name.removeprefix("course_lib.") or name

    lines = []
    for title, wanted in (("lessons", False), ("tools", True)):
        lines.append(f"{title}:")
        for name in sorted(n for n in graph if is_tool(n) == wanted and n not in ("course_lib", TOOLS)):
            targets = ", ".join(short(t) for t in sorted(graph[name]) if t not in ("course_lib", TOOLS))
            lines.append(f"  {short(name):<22} -> {targets or '(nothing of course_lib)'}")
    return "\n".join(lines)


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    print("\n" + describe(graph))
    assert len(graph) > 20, "the graph should cover the whole package"
    assert cycles(graph) == [], "modules that import each other (around a loop): " + "; ".join(
        " <-> ".join(component) for component in cycles(graph)
    )


def test_lessons_never_import_tools():
    graph = import_graph()
    upward = [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        if not is_tool(name)
        for target in sorted(targets)
        if is_tool(target)
    ]
    assert upward == [], "lessons must not import course_lib.tools: " + "; ".join(upward)


def test_parallel_lessons_know_nothing_of_the_training_harness():
    graph = import_graph()
    reaching = [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        if name.startswith("course_lib.parallel.")
        for target in sorted(targets & HARNESS)
    ]
    assert reaching == [], "a parallel/ lesson registers itself or reaches into the harness: " + "; ".join(
        reaching
    )


def test_no_module_picks_a_matplotlib_backend_and_lessons_never_draw():
    problems = []
    for name, path in all_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("use", "switch_backend") and ast.unparse(node.func.value) in (
                    "matplotlib",
                    "plt",
                ):
                    problems.append(f"{name} line {node.lineno} chooses a backend: {ast.unparse(node)}")
            imported = []
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported = [node.module]
            if any(module.split(".")[0] == "matplotlib" for module in imported) and not is_tool(name):
                problems.append(
                    f"{name} line {node.lineno} imports matplotlib: lessons return data, tools draw it"
                )
            if any(module == "matplotlib.pyplot" for module in imported):
                problems.append(
                    f"{name} line {node.lineno} imports pyplot: build a matplotlib.figure.Figure instead"
                )
    assert problems == [], "\n".join(problems)


def test_the_checker_finds_a_cycle_and_an_upward_import():
    """The checks above can fail: a made-up graph with both defects is caught."""
    graph = {
        "course_lib.a": {"course_lib.b"},
        "course_lib.b": {"course_lib.a", "course_lib.tools.plots"},
        "course_lib.tools.plots": set(),
    }
    assert cycles(graph) == [["course_lib.a", "course_lib.b"]]
    assert [t for n, ts in graph.items() if not is_tool(n) for t in ts if is_tool(t)] == [
        "course_lib.tools.plots"
    ]


def test_the_jobs_checks_import_without_torch():
    """A job checks its GPUs and the network plugin with Python from wherever it runs (a container, a
    uenv) before the training environment is known to work: those checks must not need torch."""
    import subprocess
    import sys

    blocker = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'torch'\")\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "import course_lib.runtime, course_lib.flight_recorder, course_lib.faults\n"
        "import course_lib.tools.jobcheck\n"
    )
    repository = Path(__file__).resolve().parents[1]
    shown = subprocess.run([sys.executable, "-c", blocker], cwd=repository, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
