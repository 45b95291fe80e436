"""SQL catalogs across ``os.fork``: a forked child process gets database connections of its own.

pyiceberg's ``SqlCatalog`` keeps a SQLAlchemy connection pool. A worker process forked from a process that already
used the catalog (a ``multiprocessing`` pool with the ``fork`` start method, the default on Linux before Python 3.14)
inherits the pooled connections: one PostgreSQL socket then carries two processes' statements interleaved, and one
SQLite handle is used by two processes, which SQLite forbids ("do not open a database connection, then fork, then use
it in the child"). SQLAlchemy's remedy is ``engine.dispose(close=False)`` in the child: it forgets the inherited
connections without closing them (closing would end the parent's sessions) and opens new ones on demand.
:func:`fork_safe` registers that, once per process, for the engine of every SQL catalog a stream is opened on.
Thread pools are handled where they live (``write/writer.py`` ``ProcessPool``).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

__all__ = ["fork_safe"]

log = logging.getLogger(__name__)

_engines: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def fork_safe(catalog: Any) -> None:
    """Give forked children of this process their own connections of ``catalog`` (a no-op for non-SQL catalogs)."""
    global _registered
    engine = getattr(catalog, "engine", None)
    if engine is None or not hasattr(engine, "dispose"):
        return
    with _lock:
        _engines.add(engine)
        if not _registered:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _registered = True


def _after_fork_in_child() -> None:
    # The child runs one thread: a fresh lock (another thread of the parent may have held it at the fork).
    global _lock
    _lock = threading.Lock()
    for engine in list(_engines):
        try:
            engine.dispose(close=False)
        except Exception:  # noqa: BLE001 - the next checkout opens a connection either way
            log.debug("could not drop inherited connections of %s after fork", engine, exc_info=True)
