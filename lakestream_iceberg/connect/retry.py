"""Bounded, jittered retry of transient storage and catalog failures (:func:`~lakestream_iceberg.connect.diagnose.
transient` tells them from permanent ones): :func:`call_with_retry`, and :func:`read_with_retry` for reads of published
data, which says so in a :class:`~lakestream_iceberg.errors.ReadError` when the store keeps failing past the budget."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from lakestream_iceberg.connect.diagnose import explain, one_line, transient
from lakestream_iceberg.connect.log_limit import WarningLimit
from lakestream_iceberg.errors import ReadError

__all__ = ["call_with_retry", "read_with_retry"]

log = logging.getLogger(__name__)
_retries = WarningLimit(log)  # one warning per failure class per interval in a process; the rest at DEBUG, counted
T = TypeVar("T")


def call_with_retry(
    fn: Callable[[], T],
    *,
    what: str,
    timeout_s: float,
    is_transient: Callable[[BaseException], bool] = transient,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> T:
    """``fn()``, retried on transient failures with jittered exponential backoff (50 ms doubling to 2 s) for at most
    ``timeout_s`` seconds; then (or at once for a permanent failure) the last exception propagates unchanged.

    Only idempotent ``fn`` may be retried (writing a whole object to a fixed path, reading one).
    """
    deadline = clock() + timeout_s
    delay = 0.05
    rand = rng  # made on the first retry: seeding a Random from os.urandom costs ~10 us, on every read and write
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            rand = rand or random.Random()
            pause = delay * rand.uniform(0.5, 1.5)
            if clock() + pause > deadline:
                raise
            _retries.warning(type(exc).__name__, "%s failed (%s, attempt %d); retrying in %.2fs", what,
                             type(exc).__name__, attempt, pause)
            sleep(pause)
            delay = min(delay * 2, 2.0)


def read_with_retry(fn: Callable[[], T], *, what: str, timeout_s: float, properties: Mapping[str, Any] | None) -> T:
    """:func:`call_with_retry` for a read of published data: a transient storage failure that outlasts the budget
    (an object store throttling or failing, not a setting: :func:`explain` names those) raises a
    :class:`~lakestream_iceberg.errors.ReadError` saying so and what to do, instead of the storage's raw error."""
    try:
        return call_with_retry(fn, what=what, timeout_s=timeout_s)
    except OSError as exc:
        if not transient(exc) or explain(exc, properties) is not None:
            raise
        raise ReadError(f"{what} kept failing for lakestream.io.retry-timeout-ms ({timeout_s:g}s; the last: "
                        f"{one_line(exc)}); the step is intact: read it again once the object store recovers, or "
                        "raise lakestream.io.retry-timeout-ms") from exc
