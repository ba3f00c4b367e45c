"""`tidemark chaos`: a model-based randomized checker of the replay protocol.

It starts a throwaway PostgreSQL cluster, a source log (a ``postgres_log`` table or a
``file_archive`` folder: ``source.py``), two sink databases and a pipeline (``world.py``), drives them through a seeded random sequence of operations and faults
(``ops.py``, ``faults.py``; calls into the library only through ``adapter.py``), and after
every step runs recovery and an independent checker of docs/design.md's invariants
(``checker.py``, plain SQL, no code shared with the data path) and an oracle of content
(``oracle.py``: its own model of every sink's rows and live letters, compared row for row).
``runner.py`` holds the sequence, the per-step report and the summary. The sequence is a pure function of the seed,
so the first failing step K is reproduced by ``tidemark chaos --seed N --steps K``.
"""
