"""No number in a notebook's prose that the output beside it can contradict (``tools/prose.py``), and
the predict-then-run cells every notebook has (``tools/predict.py``)."""

from __future__ import annotations

import json
import math
import re

import pytest

from course_lib.tools import labs, notebooks, predict, prose

NOTEBOOKS = notebooks.notebook_paths()


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_every_quantity_a_notebook_states_is_held_by_the_code_beside_it(notebook):
    assert prose.problems(notebook) == []


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_every_notebook_asks_for_a_prediction_and_ships_none(notebook):
    """A prediction cell reads the student's predictions file and holds no answer; its check ran
    with none made (the notebook a student gets is the one CI runs), and printed the measurement."""
    cells = json.loads(notebook.read_text())["cells"]
    code = ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]
    asking = [index for index, source in enumerate(code) if "predict.yours(" in source]
    checking = [index for index, source in enumerate(code) if "predict.check(" in source]
    assert asking and checking and asking[0] < checking[0], f"{notebook.name}: no prediction, then its check"
    for source in code:
        for line in source.splitlines():
            if re.match(r"prediction(_\w+)? = ", line):
                reads_the_file = rf'prediction(_\w+)? = predict\.yours\("{notebook.stem}", "\w+"\)'
                assert re.match(reads_the_file, line), line
    keys = set(re.findall(rf'predict\.yours\("{notebook.stem}", "(\w+)"\)', "".join(code)))
    written = predict.read_predictions(predict.PREDICTIONS_DIR / f"{notebook.stem}.toml")
    assert set(written) == keys and set(written.values()) == {""}, written  # committed empty
    for cell in cells:
        if cell["cell_type"] == "code" and "predict.check(" in "".join(cell["source"]):
            shown = "".join(notebooks.output_text(output) for output in cell.get("outputs", []))
            lines = shown.splitlines()
            assert any(line.startswith("NONE") for line in lines), shown
            assert not any(line.startswith(("HIT", "MISS")) for line in lines), shown


def test_no_prediction_prints_the_measurement_and_the_idea(capsys):
    assert predict.check("bytes each rank sends", None, 1.5 * 2**20, unit="B", hint="2(N-1)/N") is False
    assert capsys.readouterr().out == (
        "NONE  bytes each rank sends: no prediction was made; measured 1.5 MiB. The idea: 2(N-1)/N\n"
    )


def test_a_prediction_is_read_from_the_notebooks_file(tmp_path, capsys):
    (tmp_path / "02_collectives.toml").write_text('all_reduce_bytes = "1.5 MiB"\nother = ""\n')
    assert predict.yours("02_collectives", "all_reduce_bytes", folder=tmp_path) == "1.5 MiB"
    assert predict.yours("02_collectives", "other", folder=tmp_path) is None
    assert predict.yours("03_data_parallel", "anything", folder=tmp_path) is None  # no file yet
    (tmp_path / "04_zero_and_fsdp.toml").write_text("saving = 5 %\n")
    assert predict.yours("04_zero_and_fsdp", "saving", folder=tmp_path) is None
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == "all_reduce_bytes: your prediction is 1.5 MiB (predictions/02_collectives.toml)"
    assert shown[1].startswith("other: no prediction yet. Write yours in predictions/02_collectives.toml")
    assert shown[2].startswith("anything: no prediction yet")
    assert shown[3].startswith("saving: 04_zero_and_fsdp.toml is not TOML") and 'key = "1.5 MiB"' in shown[3]


def test_an_instructor_lists_a_folder_of_predictions(tmp_path, capsys):
    (tmp_path / "02_collectives.toml").write_text('all_reduce_bytes = "1.5 MiB"\n')
    (tmp_path / "03_data_parallel.toml").write_text('bucketed_speedup = ""\n')
    assert predict.main([str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "1.5 MiB" in shown and shown.splitlines()[-1] == "1 of 2 predictions made"
    assert predict.main([str(tmp_path / "absent")]) == 2
    assert "no predictions files" in capsys.readouterr().err
    assert predict.main([]) == 0  # the course's own, all empty
    assert capsys.readouterr().out.splitlines()[-1].startswith("0 of ")


def _markdown(text: str, **metadata) -> dict:
    return {"cell_type": "markdown", "metadata": metadata, "source": text}


def _code(source: str, printed: str = "") -> dict:
    outputs = [{"output_type": "stream", "name": "stdout", "text": printed}] if printed else []
    return {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": source, "outputs": outputs}


def test_a_planted_contradiction_in_a_committed_notebook_is_found(tmp_path):
    """Notebook 10's straggler text, with the number of another run written into it."""
    source = next(path for path in NOTEBOOKS if path.stem == "10_when_it_breaks")
    notebook = json.loads(source.read_text())
    cells = notebook["cells"]
    index = next(i for i, cell in enumerate(cells) if "rank 1 arrives" in "".join(cell["source"]))
    cells[index]["source"] = ["On the left, rank 1 arrives 61.9 ms a step after the others."]
    planted = tmp_path / source.name
    planted.write_text(json.dumps(notebook))
    found = prose.problems(planted)
    assert len(found) == 1 and f"cell {index + 1} states '61.9 ms'" in found[0], found
    assert "guard it with an assert" in found[0] and "from-sources" in found[0]


@pytest.mark.parametrize(
    ("cells", "held"),
    [
        # printed by the code beside it, where nbval compares it: as written, or to more digits
        ([_code("print(size)", "16.8 MB of gradients"), _markdown("The gradients are 16.8 MB.")], True),
        ([_code("print(size)", "16.84 MB"), _markdown("The gradients are 16.8 MB.")], True),
        ([_code("print(size)", "16.8 MB"), _markdown("The gradients are 16.9 MB.")], False),
        # a timing printed in a cell whose output nbval ignores holds nothing: it changes every run
        ([_code("# NBVAL_IGNORE_OUTPUT\nprint(lag)", "61.9 ms"), _markdown("Rank 1 lags 61.9 ms.")], False),
        # the bound of an assertion, or a setting, in the code before or after
        ([_markdown("The first step takes over 100 ms."), _code("assert first_ms > 100")], True),
        ([_markdown("Buckets of 4 MB."), _code("x = 1"), _code("bucket_mb = 4")], False),  # only the nearest
        # theory, papers and datasheets: a cell tagged from-sources
        ([_markdown("A link of 25 GB/s.", tags=["from-sources"])], True),
        ([_markdown("A link of 25 GB/s.")], False),
        # not quantities: code, formulas, a product, a count without a unit
        ([_markdown("Call `sleep(0.02 s)`, see $2 \\times 3 s$, a 2 x 2 mesh, 64 GPUs.")], True),
        ([_markdown("It ran 1.3x faster.")], False),
        ([_markdown("It ran 1.3x faster."), _code("assert ratio > 1.3")], True),
    ],
)
def test_what_holds_a_quantity(cells, held):
    assert (prose.unguarded(cells) == []) is held, prose.unguarded(cells)


# -- predictions -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "unit", "value"),
    [
        ("1.5 MiB", "B", 1.5 * 2**20),
        ("140.7 kB", "B", 140_700),
        ("2240", "B", 2240),
        ("60 ms", "s", 0.06),
        ("0.27", "", 0.27),
        ("40 %", "", 0.4),
        ("35,173", "", 35_173),
        (6, "", 6.0),
    ],
)
def test_a_prediction_is_read_with_its_unit(text, unit, value):
    assert math.isclose(predict.parse(text, unit=unit), value)


@pytest.mark.parametrize(
    ("text", "unit", "message"),
    [
        ("abc", "B", "'abc' is not a number: write it with its unit, e.g. '1.5 B'"),
        ("3 kg", "B", "'kg' is not a unit of this quantity; it takes 'B', 'bytes', 'kB'"),
        ("60 MB", "s", "'MB' is not a unit of this quantity; it takes 's', 'ms'"),
        ("nan", "", "is not a number"),
        ("1e999", "", "is not a finite number"),
        (True, "", "not a bool"),
    ],
)
def test_a_prediction_that_is_not_a_number_in_its_unit_is_named_in_one_line(text, unit, message, capsys):
    assert predict.check("the bytes", text, 100.0, unit=unit) is False
    shown = capsys.readouterr().out
    assert shown.count("\n") == 1 and message in shown, shown


def test_a_hit_and_a_miss_say_so_and_a_miss_gives_the_hint(capsys):
    assert predict.check("bytes each rank sends", "1.5 MiB", 1.5 * 2**20, unit="B")
    assert predict.check("bytes each rank sends", "3 MiB", 1.5 * 2**20, unit="B", hint="2(N-1)/N") is False
    hit, miss = capsys.readouterr().out.splitlines()
    assert hit == "HIT   bytes each rank sends: you said 1.5 MiB, measured 1.5 MiB (within 10%)"
    assert miss == (
        "MISS  bytes each rank sends: you said 3 MiB, measured 1.5 MiB (2x too high); hint: 2(N-1)/N"
    )


ROOT = notebooks.NOTEBOOKS.parent
NUMBER_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
)


def test_the_readme_counts_the_decks_there_are():
    """The README's lecture list names as many decks as ``slides/`` holds, the last one included."""
    decks = sorted(ROOT.glob("slides/[0-9][0-9]-*.md"))
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"{NUMBER_WORDS[len(decks)].capitalize()} Slidev decks in `slides/`" in readme
    assert "overlapped tensor parallelism, float8 and compiled blocks" in readme  # the tenth's topic


def test_every_notebook_a_text_names_exists_and_the_moved_references_point_where_the_topic_is():
    """Every "notebook NN" in a notebook's prose or the README names a notebook there is; and the
    references the renumbering once broke point at the notebook that teaches the topic."""
    numbers = {path.name[:2] for path in notebooks.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")}
    texts = {"README.md": (ROOT / "README.md").read_text()}
    for path in sorted(notebooks.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        texts[path.name] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    for name, text in texts.items():
        for found in re.finditer(r"[Nn]otebooks? (\d\d)\b", " ".join(text.split())):
            assert found[1] in numbers, (name, found[0])
    flat = {name: " ".join(text.split()) for name, text in texts.items()}
    assert "notebook 05 measures what both do to a training step" in flat["02_collectives.ipynb"]
    assert "(async TP, notebook 15," in flat["14_choosing_a_layout.ipynb"]
    assert (
        "Notebooks 06 and 14 said tensor parallelism's communication cannot hide"
        in flat["15_overlap_float8_compile.ipynb"]
    )


# -- references and counts ---------------------------------------------------------------------------

TOPICS = {
    "00": "process rank launch torchrun rendezvous environment slurm_procid barrier all-reduce",
    "01": "baseline throughput batch mfu single parameters digits model",
    "02": "collective all-reduce ring alpha beta alpha-beta bandwidth latency nccl hierarchy tree bytes",
    "03": "ddp bucket overlap hook nccl anatomy plot_anatomy data-parallel gradient all-reduce sampler "
    "communication",
    "04": "zero fsdp shard hsdp anatomy plot_anatomy bf16 prefetch precision checkpoint autograd.function "
    "functional_call gather",
    "05": "scaling strong-scaling speedup strong ddp batch all-reduce step noise seed factor backward",
    "06": "tensor column row f g mlp megatron all-reduce",
    "07": "pipeline 1f1b gpipe bubble schedule stage stages theory micro-batch",
    "08": "zero-bubble zb-h1 zb-v bubble backward split w pipeline activation",
    "09": "3-d mesh grid train_3d tensor pipeline data",
    "10": "flight fault hang straggler diagnose checkpoint failure breaks record tools",
    "11": "sequence norm regather reduce-scatter all-gather all-gathers activation",
    "12": "context ring attention ulysses zig-zag causal softmax sequence",
    "13": "expert moe routing capacity all-to-all",
    "14": "planner layout plan predict published gpu h200 fits layouts score tensor",
    "15": "async tp collective matmul matmuls float8 compile overlap hidden",
}
"""Words of each notebook's topic: a sentence that names "notebook NN" must use one of NN's within
160 characters. A heuristic, and it says so: it caught the references the renumbering broke."""


def _misplaced_references(texts: dict[str, str]) -> list[tuple[str, str]]:
    found = []
    for name, text in texts.items():
        flat = " ".join(text.split())
        for match in re.finditer(r"[Nn]otebooks? (\d\d)((?:,? (?:and )?\d\d)*)", flat):
            window = flat[max(0, match.start() - 160) : match.end() + 160].lower()
            for number in [match[1], *re.findall(r"\d\d", match[2])]:
                words = TOPICS[number].split()
                if not any(re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", window) for word in words):
                    found.append((name, number))
    return found


def _prose_texts() -> dict[str, str]:
    texts = {"README.md": (ROOT / "README.md").read_text()}
    for path in sorted(notebooks.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        texts[path.name] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    for path in [*sorted(ROOT.glob("slides/[0-9][0-9]-*.md")), *sorted(ROOT.glob("labs/*/README.md"))]:
        texts[str(path.relative_to(ROOT))] = path.read_text()
    return texts


def test_every_notebook_a_text_names_is_on_the_topic_around_it():
    assert set(TOPICS) == {path.name[:2] for path in notebooks.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")}
    assert _misplaced_references(_prose_texts()) == []
    # the references the renumbering once broke are each found
    broken = {
        "02": "The next section measures α; notebook 08 measures what both do to a training step.",
        "14": "they cost seconds a step here (async TP, notebook 06, overlaps them with the matmul)",
        "15": "Notebooks 06 and 11 said tensor parallelism's communication cannot hide",
    }
    assert _misplaced_references(broken) == [("02", "08"), ("14", "06"), ("15", "11")]


def test_every_lecture_and_lab_a_text_names_exists():
    decks = {int(path.name[:2]) for path in ROOT.glob("slides/[0-9][0-9]-*.md")}
    lab_numbers = {int(re.match(r"lab(\d+)_", name)[1]) for name in labs.lab_names()}
    for name, text in _prose_texts().items():
        flat = " ".join(text.split())
        for found in re.finditer(r"\b[Ll]ectures? (\d+)\b", flat):
            assert int(found[1]) in decks, (name, found[0])
        for found in re.finditer(r"\b[Ll]abs? (\d+)\b", flat):
            assert int(found[1]) in lab_numbers, (name, found[0])


def test_the_readme_counts_the_notebooks_and_labs_there_are():
    readme = " ".join((ROOT / "README.md").read_text().split())
    labs_readme = " ".join((ROOT / "labs" / "README.md").read_text().split())
    count_notebooks, count_labs = len(NOTEBOOKS), len(labs.lab_names())
    assert f"the {NUMBER_WORDS[count_notebooks]} notebooks" in readme
    assert f"{NUMBER_WORDS[count_labs]} labs with exercises" in readme
    assert labs_readme.startswith(f"# Labs {NUMBER_WORDS[count_labs].capitalize()} labs turn the lectures")


def test_the_syllabus_lists_each_notebook_and_lab_once_in_order():
    readme = (ROOT / "README.md").read_text()
    syllabus = readme[readme.index("## Syllabus") : readme.index("### One day")]
    rows = [line for line in syllabus.splitlines() if re.match(r"\| \d+ \|", line)]
    cells = [line.split("|")[3:5] for line in rows]  # notebooks, labs
    listed_notebooks = [
        name for notebooks_cell, _ in cells for name in re.findall(r"`(\d\d_\w+)`", notebooks_cell)
    ]
    listed_labs = [name for _, labs_cell in cells for name in re.findall(r"`(lab\d+_\w+)`", labs_cell)]
    assert listed_notebooks == [path.stem for path in NOTEBOOKS]
    assert listed_labs == labs.lab_names()  # in the course's order, by number
    assert [int(row.split("|")[1]) for row in rows] == list(range(1, len(rows) + 1))
