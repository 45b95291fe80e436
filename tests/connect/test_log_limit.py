"""WarningLimit: one WARNING per key and interval in a process, the rest at DEBUG and counted into the next."""

from __future__ import annotations

import logging

import pytest

from lakestream_iceberg.connect.log_limit import WarningLimit


def test_one_warning_per_key_and_interval_the_rest_at_debug_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("lakestream_iceberg.test_log_limit")
    now = [100.0]
    limit = WarningLimit(log, interval_s=30.0, clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger=log.name)
    for i in range(1_000):  # a thousand retries within a second: one warning
        now[0] += 0.001
        limit.warning("SlowDown", "read %d failed", i)
    assert limit.warning("Timeout", "read %d failed", 0)  # another kind: its own warning
    now[0] += 30.0
    assert limit.warning("SlowDown", "read %d failed", 1_000)  # the interval passed: a warning with the count
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["read 0 failed", "read 0 failed",
                        "read 1000 failed (and 999 more like it in the last 31s, logged at DEBUG)"]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 999  # nothing lost at DEBUG
