"""What purging a dropped stream's table logs: pyiceberg's ``purge_table`` deletes every file the table's manifests list,
and warns for each one it cannot delete, those lifecycle GC already deleted too (:class:`AlreadyDeleted`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["AlreadyDeleted", "quiet_about_collected"]

log = logging.getLogger("lakestream_iceberg.stream")


class AlreadyDeleted(logging.Filter):
    """Drops pyiceberg's purge warning for a file that is not there any more: purge_table walks every manifest entry,
    the DELETED ones of lifecycle GC's collect snapshots too, and warns "Failed to delete data file ..." for each file
    GC already removed (thousands after a long run). A file that is still there, its deletion failed, still warns."""

    _PREFIX = "Failed to delete "

    def __init__(self, io: Any) -> None:
        super().__init__()
        self.io = io
        self.gone = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self._PREFIX) or " file " not in message:
            return True
        path = message.split(" file ", 1)[1]
        try:
            there = self.io.new_input(path).exists()
        except Exception:  # noqa: BLE001 - cannot tell: keep the warning
            return True
        if there:
            return True
        self.gone += 1
        return False


@contextmanager
def quiet_about_collected(io: Any) -> Iterator[None]:
    """While purging a stream's table: :class:`AlreadyDeleted` on pyiceberg's catalog logger, and one INFO line counting
    the files it passed over."""
    purge_log = logging.getLogger("pyiceberg.catalog")
    quiet = AlreadyDeleted(io)
    purge_log.addFilter(quiet)
    try:
        yield
    finally:
        purge_log.removeFilter(quiet)
        if quiet.gone:
            log.info("purge: %d files the table's metadata lists were already deleted (lifecycle GC)", quiet.gone)
