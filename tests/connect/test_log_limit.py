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


def _in_a_forked_child(limit: WarningLimit) -> tuple[int, bool]:
    """Fork; the child logs one warning of ``limit`` and exits 0 if it was a WARNING, 1 if not; (its exit code, hung)."""
    import os
    import time

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os._exit(0 if limit.warning("SlowDown", "read %d failed", 1) else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -9, True


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="os.fork")
def test_a_forked_child_warns_even_when_another_thread_held_the_lock_at_the_fork() -> None:
    """A retry's warning in one thread while another forks (a DataLoader starting its workers on a throttled store):
    the child inherited the limit's lock held by a thread it does not have, and its first retry warning hung for good.
    The child is a process of its own: a fresh lock, and its first warning of a kind reaches the user."""
    import threading

    limit = WarningLimit(logging.getLogger("lakestream_iceberg.test_log_limit"), interval_s=3600.0)
    assert limit.warning("SlowDown", "read %d failed", 0)  # the parent warned just now
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with limit._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    try:
        code, hung = _in_a_forked_child(limit)
    finally:
        release.set()
        holder.join()
    assert not hung, "the forked child hung on the warning limit's lock"
    assert code == 0, "the forked child's first warning of a kind was not a WARNING"
