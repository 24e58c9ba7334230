"""The package's shape, read from its source: each layer imports only the layers below it.

``course_lib`` is cut into layers, one sub-package per part of the course, and a module may
import only from its own layer or a layer below:

====  ==============================================  ============================================
rank  layer                                           what it holds
====  ==============================================  ============================================
0     ``errors``, ``checks``, ``flags``,            the leaves everything uses
      ``data``, ``loader_server``, ``models``,
      ``llama``
1     ``distributed``                                 processes, collectives, the ledger, the ring
2     ``parallel``  |  ``observe``                    the techniques  |  the instruments; siblings
                                                      that never import each other (hooks join them)
3     ``plan``                                        layouts composed, costs predicted
4     ``train``                                       the training harness and its drivers
5     ``tools``                                       what serves the course: benchmarks, pictures
====  ==============================================  ============================================

It also checks that no two modules import each other around a loop, that every import of a
course module sits at the top of its file (an import inside a function hides a dependency from
the reader and from this test), and that lessons never draw. Run with ``-s`` to see the graph.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "course_lib"
TOOLS = "course_lib.tools"
LEAVES = (
    "course_lib.errors",
    "course_lib.checks",
    "course_lib.flags",
    "course_lib.data",
    "course_lib.loader_server",
    "course_lib.models",
    "course_lib.llama",
)
LAYERS = {
    "leaves": 0,
    "course_lib.distributed": 1,
    "course_lib.parallel": 2,
    "course_lib.observe": 2,
    "course_lib.plan": 3,
    "course_lib.train": 4,
    "course_lib.tools": 5,
}


def layer_of(name: str) -> str | None:
    """The layer a module belongs to (None: the package's own ``__init__``)."""
    if name in LEAVES:
        return "leaves"
    for layer in LAYERS:
        if name == layer or name.startswith(layer + "."):
            return layer
    return None


def forbidden(source: str, target: str) -> str | None:
    """Why ``source`` may not import ``target``, or None when it may."""
    here, there = layer_of(source), layer_of(target)
    if here is None or there is None or here == there:
        return None
    if LAYERS[there] < LAYERS[here]:
        return None
    if LAYERS[there] == LAYERS[here]:
        return f"{here} and {there} are siblings: they never import each other (use the hooks)"
    return f"{here} (layer {LAYERS[here]}) reaches up to {there} (layer {LAYERS[there]})"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def course_imports(name: str, path: Path, known: set[str]) -> list[tuple[ast.stmt, set[str]]]:
    """Each import statement of ``name`` that names course_lib modules, with the modules it names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    statements = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        found = set()
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
        if found - {name}:
            statements.append((node, found - {name}))
    return statements


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """Every course_lib module ``name`` imports, at the top or inside a function."""
    return set().union(*(found for _, found in course_imports(name, path, known)))


def top_level_statements(tree: ast.Module) -> set[tuple[int, int]]:
    """The statements a module runs when imported: its body, and the bodies of its top-level
    ``if`` and ``try`` blocks (``if TYPE_CHECKING:``), never a function's or a class's."""
    found, pending = set(), list(tree.body)
    while pending:
        node = pending.pop()
        found.add((node.lineno, node.col_offset))
        if isinstance(node, (ast.If, ast.Try)):
            pending.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                pending.extend(handler.body)
    return found


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
    for layer, rank in sorted(LAYERS.items(), key=lambda item: item[1]):
        lines.append(f"{layer.removeprefix('course_lib.')} (layer {rank}):")
        for name in sorted(n for n in graph if layer_of(n) == layer and n != layer):
            targets = ", ".join(short(t) for t in sorted(graph[name]) if layer_of(t) is not None)
            lines.append(f"  {short(name):<28} -> {targets or '(nothing of course_lib)'}")
    return "\n".join(lines)


def layering_problems(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{source} imports {target}: {why}"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if (why := forbidden(source, target)) is not None
    ]


def function_level_imports() -> list[str]:
    modules = all_modules()
    problems = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        at_top = top_level_statements(tree)
        for node, found in course_imports(name, path, set(modules)):
            if (node.lineno, node.col_offset) not in at_top:
                problems.append(
                    f"{name} line {node.lineno} imports {', '.join(sorted(found))} inside a function"
                )
    return problems


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    print("\n" + describe(graph))
    assert len(graph) > 20, "the graph should cover the whole package"
    assert cycles(graph) == [], "modules that import each other (around a loop): " + "; ".join(
        " <-> ".join(component) for component in cycles(graph)
    )


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(name for name in all_modules() if name != "course_lib" and layer_of(name) is None)
    assert unplaced == [], f"modules outside every layer (add them to a sub-package): {unplaced}"


def test_each_layer_imports_only_the_layers_below_it():
    problems = layering_problems(import_graph())
    assert problems == [], "imports against the layers:\n" + "\n".join(problems)


def test_every_import_of_a_course_module_is_at_the_top_of_its_file():
    problems = function_level_imports()
    assert problems == [], "move these imports to the top of the file:\n" + "\n".join(problems)


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
        for target in sorted(targets)
        if layer_of(target) in ("course_lib.train", "course_lib.observe")
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


def test_the_checker_finds_imports_against_the_layers(tmp_path):
    """Upward, sibling and function-level imports are all caught; downward ones pass."""
    graph = {
        "course_lib.distributed.comm": {"course_lib.observe.faults", "course_lib.errors"},
        "course_lib.parallel.ddp": {"course_lib.observe.anatomy", "course_lib.distributed.comm"},
        "course_lib.plan.layout": {"course_lib.parallel.ddp", "course_lib.train.loop"},
        "course_lib.train.loop": {"course_lib.plan.layout", "course_lib.observe.faults"},
    }
    assert layering_problems(graph) == [
        "course_lib.distributed.comm imports course_lib.observe.faults: "
        "course_lib.distributed (layer 1) reaches up to course_lib.observe (layer 2)",
        "course_lib.parallel.ddp imports course_lib.observe.anatomy: "
        "course_lib.parallel and course_lib.observe are siblings: "
        "they never import each other (use the hooks)",
        "course_lib.plan.layout imports course_lib.train.loop: "
        "course_lib.plan (layer 3) reaches up to course_lib.train (layer 4)",
    ]
    lesson = tmp_path / "course_lib" / "plan" / "lesson.py"
    lesson.parent.mkdir(parents=True)
    lesson.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from ..errors import UserError\n"
        "if TYPE_CHECKING:\n"
        "    from ..models import TinyTransformer\n"
        "def late():\n"
        "    from ..parallel import ddp\n"
    )
    known = {"course_lib.parallel.ddp", "course_lib.errors", "course_lib.models"}
    tree = ast.parse(lesson.read_text())
    at_top = top_level_statements(tree)
    statements = course_imports("course_lib.plan.lesson", lesson, known)
    nested = [found for node, found in statements if (node.lineno, node.col_offset) not in at_top]
    assert nested == [{"course_lib.parallel.ddp"}] and len(statements) == 3


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
        "import course_lib.distributed.runtime, course_lib.observe.flight_recorder\n"
        "import course_lib.observe.faults\n"
        "import course_lib.tools.jobcheck\n"
    )
    repository = Path(__file__).resolve().parents[1]
    shown = subprocess.run([sys.executable, "-c", blocker], cwd=repository, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr


def _strings_in_a_row(source: str) -> list[int]:
    """The lines of string statements that follow another string statement: a docstring that
    attaches to nothing (a constant's docstring left after another constant's)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for first, second in zip(body, body[1:]):
            if all(
                isinstance(statement, ast.Expr)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
                for statement in (first, second)
            ):
                found.append(second.lineno)
    return found


def test_no_docstring_is_left_where_it_attaches_to_nothing():
    misplaced = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in _strings_in_a_row(path.read_text())
    ]
    assert not misplaced, f"a string after a docstring documents nothing: {misplaced}"
    assert _strings_in_a_row('X = 1\n"""X."""\n"""stale."""\n') == [3]  # the check sees one


LESSON_LINES, LESSON_FUNCTION_LINES = 500, 80
"""A lesson a student reads at one sitting: a file of at most 500 lines, a function of at most 80."""


def _too_long(source: str, *, file_lines: int, function_lines: int) -> list[str]:
    """What in a file passes the limits: the file itself, and each function, with its length."""
    found = [f"the file: {source.count(chr(10))} lines"] if source.count("\n") > file_lines else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > function_lines:
                found.append(f"{node.name}: {length} lines")
    return found


def test_every_lesson_fits_its_limits():
    """Lessons (every module outside ``tools``) stay readable: files and functions within the
    limits, each offender split by idea rather than trimmed."""
    offenders = {
        str(path.relative_to(PACKAGE.parent)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if "tools" not in path.relative_to(PACKAGE).parts
        and (
            found := _too_long(
                path.read_text(), file_lines=LESSON_LINES, function_lines=LESSON_FUNCTION_LINES
            )
        )
    }
    assert not offenders, f"split these by idea: {offenders}"
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    assert _too_long(f"def long():\n{body}\n", file_lines=500, function_lines=80) == ["long: 82 lines"]


VERBS = {
    "apply_data_parallel": "nn.Module",
    "apply_zero": "ZeroDataParallel",
    "apply_fsdp": "FullyShardedDataParallel",
    "apply_tensor_parallel": "nn.Module",
    "apply_sequence_parallel": "nn.Module",
    "apply_vocabulary_parallel": "nn.Module",
    "apply_context_parallel": "nn.Module",
    "apply_ulysses_parallel": "nn.Module",
    "apply_expert_parallel": "nn.Module",
    "apply_recomputation": "nn.Module",
    "apply_float8": "nn.Module",
    "apply_compile": "nn.Module",
    "apply_pipeline_parallel": "Pipeline",
}
"""Every technique's one verb, and what it returns: the model it changed (or the wrapper a data
axis puts around it), but pipelining, the outer verb, which returns the stages and their schedule."""


def _verb_shape(node: ast.FunctionDef) -> list[str]:
    """What in one verb's signature breaks ``apply_x(model, group_or_mesh, *, options) -> model``."""
    found, positional = [], [a.arg for a in node.args.posonlyargs + node.args.args]
    if positional[:1] != ["model"]:
        found.append(f"its first argument is {positional[:1]}, not model")
    if positional[1:] not in ([], ["group"], ["group_or_mesh"]):
        found.append(f"takes {positional[1:]} by position: only the group (or mesh) comes second")
    returns = ast.unparse(node.returns) if node.returns else None
    if returns != VERBS.get(node.name):
        found.append(f"returns {returns}, not {VERBS.get(node.name)}")
    return found


def test_every_technique_has_one_verb_of_one_shape():
    verbs = {}
    for path in sorted((PACKAGE / "parallel").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("apply_"):
                assert node.name not in verbs, f"{node.name} is defined twice"
                verbs[node.name] = (path, node)
    assert set(verbs) == set(VERBS), f"verbs found {sorted(verbs)}, listed {sorted(VERBS)}"
    wrong = [f"{name}: {problem}" for name, (_, node) in verbs.items() for problem in _verb_shape(node)]
    assert not wrong, wrong
    bad = ast.parse("def apply_x(moe, *, group=None) -> int: ...").body[0]
    assert len(_verb_shape(bad)) == 2  # the check sees a layer taken for the model and a count returned


INSTRUMENTS = re.compile(
    r"\b(faults|flight_recorder|anatomy|recorder|replicas\.|perf_counter|live_tensor_bytes)\b"
)
"""What measures or breaks a run on purpose: it reports through hooks, tracers and step callbacks,
never from inside the lines a student reads as the algorithm."""


def _regions(source: str) -> dict[str, str]:
    """Every ``# #region NAME`` ... ``# #endregion NAME`` of a file: its name and its lines."""
    lines, starts, regions = source.splitlines(), {}, {}
    for number, line in enumerate(lines):
        if match := re.fullmatch(r"\s*# #region (\S+)", line):
            starts[match.group(1)] = number
        elif (match := re.fullmatch(r"\s*# #endregion (\S+)", line)) and match.group(1) in starts:
            regions[match.group(1)] = "\n".join(lines[starts[match.group(1)] + 1 : number])
    return regions


def test_no_reading_region_holds_an_instrument():
    found = [
        f"{path.relative_to(PACKAGE.parent)}#{name}: {sorted(set(INSTRUMENTS.findall(body)))}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, body in _regions(path.read_text()).items()
        if INSTRUMENTS.search(body)
    ]
    assert not found, f"reading regions that name an instrument (move it to a hook): {found}"
    sample = "# #region step\nloss = faults.poisoned(loss)\nwith anatomy.phase('x'):\n# #endregion step\n"
    assert sorted(INSTRUMENTS.findall(_regions(sample)["step"])) == ["anatomy", "faults"]


def _definitions(source: str, where: str) -> tuple[dict[str, str], dict[tuple, str]]:
    """A module's public constants by name, and those that are a list of words by their words."""
    names, words = {}, {}
    for node in ast.parse(source).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        for target in targets:
            if not (isinstance(target, ast.Name) and target.id.isupper() and not target.id.startswith("_")):
                continue
            names[target.id] = where
            value = node.value
            if isinstance(value, ast.Tuple | ast.List | ast.Set) and value.elts:
                if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts):
                    words[tuple(sorted(e.value for e in value.elts))] = f"{where}:{target.id}"
    return names, words


def test_each_vocabulary_is_defined_once():
    """A constant's name means one thing in the whole package, and a list of words is written once:
    the precisions, the schedules, the shardings, the models are imported from where they are owned."""
    names, words, twice = {}, {}, []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine, my_words = _definitions(path.read_text(), str(path.relative_to(PACKAGE.parent)))
        twice += [f"{name} in {names[name]} and {where}" for name, where in mine.items() if name in names]
        twice += [f"{words[w]} and {where} are both {list(w)}" for w, where in my_words.items() if w in words]
        names |= mine
        words |= my_words
    assert not twice, "defined twice (define it where it is owned, import it elsewhere):\n" + "\n".join(twice)
    first, _ = _definitions('SCHEDULES = ("gpipe", "1f1b")\n', "a.py")
    second, _ = _definitions("SCHEDULES = pipeline.WHOLE_BACKWARD\n", "b.py")
    assert first.keys() & second.keys() == {"SCHEDULES"}  # an alias is a second definition too
