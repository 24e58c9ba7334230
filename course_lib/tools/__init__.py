"""What serves the course rather than teaching it: commands, benchmarks, pictures and checkers.

Every module here may import the lessons (``course_lib`` and ``course_lib.parallel``); no lesson
imports one of these. Plotting lives here too: the lessons return data (timelines, schedules,
tables) and ``plots`` and ``figures`` draw it.
"""

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
"""The repository's root: the course's slides, labs and Slurm jobs beside the package."""
RECORDED = REPOSITORY / "slides" / "recorded"
"""The measurements the slides draw, each written by the command its file names."""
