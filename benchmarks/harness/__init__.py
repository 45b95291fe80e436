"""The benchmark harness: what every script under ``benchmarks/`` needs besides its scenario.

- ``stats``: percentiles, medians, Jain's index, ratios;
- ``tables``: the plain-text result table, printed and stored in the JSON;
- ``results``: machine facts, the JSON written to ``benchmarks/results/`` and a ``Run`` that times the phases and
  writes the end of a run (tables printed, JSON with the keys every script shares);
- ``files``: file-system hygiene between runs (``os.sync()``, calm file creation, run folders kept until the end);
- ``procs``: child processes (a start line, a pipe protocol, reporting a child's traceback, stopping them), CPU and RSS
  readings, a free port;
- ``timing``: sleeping until a moment, a saturated or paced producer's batches;
- ``latency``: a TCP line with a fixed delay, an object store on this host answering as one across a network;
- ``services``: a PostgreSQL, the project's or one of its own in a temp dir;
- ``rounds``: rounds in alternating or rotating order, so that a slow phase of the machine hits every variant;
- ``catalogs``: a SQLite catalog with a local warehouse, in one folder;
- ``cli``: the options every script has (``--smoke``, ``--out``) and smoke-sized defaults.

Scripts import these names from ``_common`` (``benchmarks/`` is on ``sys.path`` when a script runs), which re-exports
them: ``from _common import Run, Table, percentile``.
"""
