# Two commands for a newcomer:
#   make lab    set up if needed, then train the digits CNN on 1 process, DDP on 2, FSDP on 2
#   make test   set up if needed (Python packages, and the system packages the tests need), then run every test
#
# The packages (about 5 GB: torch ships its CUDA libraries) live outside the clone, in a shared
# virtual environment $(VENV_CACHE)/<hash of pyproject.toml + constraints.txt>, so a second clone
# or a rerun reuses them. `.venv` in the clone is a small virtual environment of its own that sees
# those packages and *this* clone's course_lib: two clones on one machine each run their own code,
# whoever started the Python (a notebook server, a script run from elsewhere, torchrun).

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV_CACHE ?= $(HOME)/.cache/course-venvs
DEPS_HASH := $(shell "$(PYTHON)" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read() + open("constraints.txt", "rb").read()).hexdigest()[:16])')
VENV_DIR := $(VENV_CACHE)/$(DEPS_HASH)
PY := .venv/bin/python
PY_VERSION := $(shell "$(PYTHON)" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
SHARED_SITE := $(VENV_DIR)/lib/python$(PY_VERSION)/site-packages
CLONE_SITE := .venv/lib/python$(PY_VERSION)/site-packages
PYTEST_ARGS ?=
# make test runs the test files on this many workers (pytest-xdist), a whole file per worker: a
# notebook's cells, the Slurm cluster and the built slides each stay with one worker. The longest
# files start first, in the order tests/conftest.py gives (LONGEST_FIRST).
TEST_WORKERS ?= 2

.PHONY: setup system-deps lab student-edition lint format test test-fast test-under-load clean-results slides slides-setup slides-build gpu-record gpu-check

setup:
	@set -euo pipefail; \
	mkdir -p "$(VENV_CACHE)"; \
	if command -v flock >/dev/null; then exec 9>"$(VENV_DIR).lock"; flock 9; fi; \
	if [ ! -f "$(VENV_DIR)/.complete" ]; then \
	  "$(PYTHON)" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed: set PYTHON=/path/to/python3.11")'; \
	  echo "Creating the virtual environment in $(VENV_DIR) (once; about a minute on a fast network)"; \
	  rm -rf "$(VENV_DIR)"; \
	  "$(PYTHON)" -m venv "$(VENV_DIR)"; \
	  "$(VENV_DIR)/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'; \
	  touch "$(VENV_DIR)/.complete"; \
	fi; \
	if ls "$(SHARED_SITE)"/course_lib-*.dist-info >/dev/null 2>&1; then \
	  "$(VENV_DIR)/bin/pip" uninstall --quiet --yes course_lib; \
	fi; \
	if [ -L .venv ] || [ "$$(cat .venv/shared-venv 2>/dev/null)" != "$(VENV_DIR) $(CURDIR)" ] || [ ! -x $(PY) ]; then \
	  rm -rf .venv; \
	  "$(VENV_DIR)/bin/python" -m venv --without-pip .venv; \
	  echo "import site; site.addsitedir('$(SHARED_SITE)')" > "$(CLONE_SITE)/_course_shared_packages.pth"; \
	  ln -s "$(VENV_DIR)/share" .venv/share; ln -s "$(VENV_DIR)/etc" .venv/etc; \
	  for tool in "$(VENV_DIR)"/bin/*; do \
	    name=$${tool##*/}; \
	    case "$$name" in python*|pip*|activate*|Activate*) continue;; esac; \
	    if head -1 "$$tool" | grep -qa "^#!$(VENV_DIR)/bin/python"; then \
	      { echo "#!$(CURDIR)/.venv/bin/python"; tail -n +2 "$$tool"; } > ".venv/bin/$$name"; chmod +x ".venv/bin/$$name"; \
	    else ln -s "$$tool" ".venv/bin/$$name"; fi; \
	  done; \
	  echo "$(VENV_DIR) $(CURDIR)" > .venv/shared-venv; \
	fi; \
	if [ "$$($(PY) -P -c 'import course_lib, pathlib; print(pathlib.Path(course_lib.__file__).parent.parent)' 2>/dev/null)" != "$(CURDIR)" ]; then \
	  $(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e . ; \
	fi

lab: setup
	$(PY) -m course_lib.tools.lab

# The repository a student receives: every tracked file but the labs' solution.py and
# solution_answers.toml, written to OUT (a new folder). There `make test` grades each untouched
# exercise and expects it to fail (tests/tools/test_student_edition.py).
OUT ?= ../course-student
student-edition: setup
	$(PY) -m course_lib.tools.student_edition $(OUT)

# What the whole suite needs from the operating system (Chromium and pdfinfo for the slides, Slurm
# and munge for the job scripts): installed with apt-get when missing and this user may (root, or
# a password-less sudo); otherwise one line names the command to run, before any test starts.
# `python3 course_lib/tools/system_deps.py --dry-run` says what it would install.
system-deps:
	@"$(PYTHON)" course_lib/tools/system_deps.py

# The project's style (rules and line length in pyproject.toml): `make format` applies it.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# On a machine with a CUDA GPU (about 3 minutes on an H100): the rates of the block products at bf16 and
# fp8, attention and memory-bound work, and the gpu-marked tests, written to
# slides/recorded/gpu/<gpu>.json for the planner. Commit what it records.
gpu-record: setup
	$(PY) -m course_lib.tools.evidence.gpu_record

# Single-GPU training steps of the course's Llama module beside the planner's predictions (under 8 minutes)
gpu-check: setup
	$(PY) -m course_lib.tools.evidence.gpu_check

test: system-deps setup lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The tests that assert on measured times (marked `timing`), run while other processes keep both
# cores busy (pytest --busy-cores, tests/conftest.py): what a shared machine does to them. Each must
# hold there too: it compares measurements taken side by side, or nets out the time a rank waited
# for a core. About 3 minutes on 2 cores.
test-under-load: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --busy-cores 2 -m timing $(PYTEST_ARGS)

# Everything but the multi-minute parts (notebooks, the browser, Slurm, slides): the inner loop while editing.
test-fast: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow and not notebooks and not slurm and not slides and not browser" $(PYTEST_ARGS)

clean-results:
	rm -rf results checkpoints

# The lecture slides: Slidev decks slides/[0-9]*.md, built with the pinned Slidev of
# slides/package-lock.json (Node.js 20 or newer) into static sites, each printed to PDF by one
# Chromium once every slide has drawn (slides/export-built-decks.mjs), and each PDF page drawn as a
# PNG by pdftoppm (Debian: apt-get install chromium poppler-utils).
#   make slides   draw the figures from the code, then build every deck and export it:
#                 slides/dist/site/<deck>/ (a static site: serve slides/dist over HTTP),
#                 slides/dist/pdf/<deck>.pdf and slides/dist/png/<deck>/<slide>.png
SLIDES_DECKS := $(notdir $(sort $(wildcard slides/[0-9]*.md)))
SLIDES_OUT ?= $(CURDIR)/slides/dist
CHROMIUM ?= $(shell command -v chromium || command -v chromium-browser || command -v google-chrome)
SLIDEV := node_modules/.bin/slidev
# the PNG pages' width in pixels (the tests draw them smaller: they look for ink, not detail)
SLIDES_PNG_WIDTH ?= 1960

slides-setup:
	@command -v npm >/dev/null && node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)' \
	  || { echo "error: the slides need Node.js 20 or newer with npm (found: $$(node --version 2>/dev/null || echo none)); see https://nodejs.org" >&2; exit 2; }
	@[ -n "$(CHROMIUM)" ] || { echo "error: exporting the slides needs Chromium: apt-get install chromium (or set CHROMIUM=/path/to/chromium)" >&2; exit 2; }
	@command -v pdftoppm >/dev/null || { echo "error: the slides' PNG pages are drawn from their PDF with pdftoppm: apt-get install poppler-utils" >&2; exit 2; }
	@cd slides && if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then \
	  echo "Installing the pinned Slidev into slides/node_modules (once; about half a minute)"; \
	  PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error; \
	fi

slides: setup slides-setup
	$(PY) -m course_lib.tools.figures slides/public/images
	$(PY) -m course_lib.tools.slides check --no-python
	@$(MAKE) --no-print-directory slides-build

# Build and export the decks as they are (no figures drawn, nothing downloaded): the tests run this offline.
slides-build:
	@set -euo pipefail; cd slides; \
	[ -x $(SLIDEV) ] || { echo "error: Slidev is not installed: run make slides-setup" >&2; exit 2; }; \
	rm -rf "$(SLIDES_OUT)/site" "$(SLIDES_OUT)/pdf" "$(SLIDES_OUT)/png"; \
	echo "== building $(SLIDES_DECKS)"; \
	mkdir -p "$(SLIDES_OUT)"; \
	$(SLIDEV) build $(SLIDES_DECKS) --base ./ --out "$(SLIDES_OUT)/site" >"$(SLIDES_OUT)/build.log" 2>&1 \
	  || { tail -40 "$(SLIDES_OUT)/build.log" >&2; exit 1; }; \
	echo "== printing each deck to PDF"; \
	node export-built-decks.mjs "$(CHROMIUM)" "$(SLIDES_OUT)/site" "$(SLIDES_OUT)/pdf" $(SLIDES_DECKS:.md=); \
	for deck in $(SLIDES_DECKS); do \
	  name=$${deck%.md}; \
	  mkdir -p "$(SLIDES_OUT)/png/$$name"; \
	  pdftoppm -png -scale-to-x $(SLIDES_PNG_WIDTH) -scale-to-y -1 "$(SLIDES_OUT)/pdf/$$name.pdf" "$(SLIDES_OUT)/png/$$name/page"; \
	  for page in "$(SLIDES_OUT)/png/$$name"/page-*.png; do \
	    number=$${page##*-}; number=$${number%.png}; mv "$$page" "$(SLIDES_OUT)/png/$$name/$$((10#$$number)).png"; \
	  done; \
	done; \
	{ echo '<!doctype html><meta charset="utf-8"><title>Lectures</title><h1>Lectures</h1><ul>'; \
	  for deck in $(SLIDES_DECKS); do name=$${deck%.md}; \
	    title=$$(sed -n 's/^title: *"\{0,1\}\([^"]*\)"\{0,1\}$$/\1/p' $$deck | head -1); \
	    echo "<li><a href=\"$$name/\">$$title</a> (<a href=\"../pdf/$$name.pdf\">PDF</a>)</li>"; \
	  done; echo '</ul>'; } > "$(SLIDES_OUT)/site/index.html"; \
	echo "slides: $(SLIDES_OUT)/pdf/, $(SLIDES_OUT)/png/, and $(SLIDES_OUT)/site/ to serve:"; \
	echo "  python3 -m http.server --directory $(SLIDES_OUT) 8000, then open http://localhost:8000/site/"
