"""What serves the course rather than teaching it: commands, benchmarks, pictures and checkers.

Every module here may import the lessons (``course_lib`` and ``course_lib.parallel``); no lesson
imports one of these. Plotting lives here too: the lessons return data (timelines, schedules,
tables) and ``plots`` and ``figures`` draw it.
"""
