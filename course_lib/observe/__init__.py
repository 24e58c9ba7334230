"""Part 5 of the course: where a step's time goes, and what a broken job looks like.

- ``anatomy``: a step cut into its parts (data, forward, backward, communication, optimizer),
  with the unexplained remainder named;
- ``stragglers``: which rank makes the others wait;
- ``replicas``: whether data-parallel replicas are still equal;
- ``flight_recorder``: every rank's last collectives, written when something fails;
- ``faults``: a rank that misbehaves on purpose (``COURSE_FAULT``), to see the signs;

The last two plug into ``course_lib.distributed.hooks`` when imported: the collectives call
them without knowing them, as PyTorch's collectives call its debug checks and flight recorder.
The techniques (``course_lib.parallel``) and this package never import each other.
"""
