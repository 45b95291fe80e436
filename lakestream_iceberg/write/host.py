"""Is this host's ``memcpy`` slow where pyarrow's Parquet writer copies? glibc's ``rep movsb`` at short distances.

glibc releases with bug 30994 (Debian 12's 2.36 among them) copy blocks of a few KiB up to about the L2 size with
``rep movsb`` on AMD Zen CPUs, and there that instruction is about 10x slower when the destination lies a few bytes past
the source modulo 4 KiB (glibc bug 30994). pyarrow's Parquet writer makes exactly such copies: a BYTE_ARRAY value goes
4 bytes after its length, a data page a few bytes after its definition levels. On such a host a producer spends about
a third more CPU per small global batch than it needs to (``benchmarks/host_copy.py``). The fix is the host's, not
this library's: ``GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=16777216`` in the producer's environment, which
glibc reads when a process starts (a running process cannot change it).

* :func:`check_copy` measures it (about a millisecond: 112 copies of 64 KiB at distances 0 and 4 past a multiple of
  4 KiB, the best of several timings, so a busy machine does not fake a verdict) and says what to do;
* :func:`warn_if_slow_copy` logs that advice once per process (a :class:`~lakestream_iceberg.write.writer.BatchWriter`
  calls it when a producer opens); ``lakestream host`` prints the check.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass

from lakestream_iceberg.errors import ConfigError

__all__ = ["TUNABLE", "TUNABLES_ADVICE", "CopyCheck", "check_copy", "warn_if_slow_copy"]

log = logging.getLogger(__name__)  # "lakestream_iceberg.write.host": set it to ERROR to silence the advice

TUNABLE = "glibc.cpu.x86_rep_movsb_threshold"
TUNABLES_ADVICE = f"GLIBC_TUNABLES={TUNABLE}=16777216"
COPY_BYTES = 64 << 10
SLOW_RATIO = 0.3  # a copy at distance 4 below this fraction of one at distance 0: the pathology (it measures ~0.1)


@dataclass(frozen=True, kw_only=True)
class CopyCheck:
    """What :func:`check_copy` measured.

    Attributes:
        aligned_gb_s: A 64 KiB copy whose destination is a multiple of 4 KiB past its source (GB/s, best of the runs).
        near_gb_s: The same copy 4 bytes further (GB/s, best of the runs).
        slow: True when ``near_gb_s`` is below 0.3x ``aligned_gb_s``: this host has the pathology.
        tunables: ``GLIBC_TUNABLES`` of this process (``None`` when unset).
        libc: The C library and its version (``"glibc 2.36"``), as :func:`platform.libc_ver` tells.
        advice: What to do (``None`` when nothing is to be done).
    """

    aligned_gb_s: float
    near_gb_s: float
    slow: bool
    tunables: str | None
    libc: str
    advice: str | None

    @property
    def ratio(self) -> float:
        """``near_gb_s / aligned_gb_s``: about 1 on a healthy host, about 0.1 with the pathology."""
        return self.near_gb_s / self.aligned_gb_s if self.aligned_gb_s else float("nan")


def _best_gb_s(dst: int, src: int, *, runs: int, copies: int) -> float:
    memmove = ctypes.memmove
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        for _ in range(copies):
            memmove(dst, src, COPY_BYTES)
        best = min(best, time.perf_counter_ns() - t0)
    return COPY_BYTES * copies / max(best, 1)  # bytes per ns = GB/s


def check_copy(*, runs: int = 7, copies: int = 4) -> CopyCheck:
    """Measure a 64 KiB copy at distance 0 and 4 past a multiple of 4 KiB, in this process; see the module docstring.

    Each figure is the best of ``runs`` timings of ``copies`` copies: preemption or another busy core only ever makes a
    timing slower, so the best one is what the copy costs. Both figures are taken in each of two passes (the first also
    warms the pages and caches) and the best of both passes counts, so a slow phase of the machine touches both.
    """
    for name, value in (("runs", runs), ("copies", copies)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
            raise ConfigError(f"check_copy: {name} must be an integer from 1 to 1000, got {value!r}")
    arena = ctypes.create_string_buffer(4 * COPY_BYTES + 8192)
    base = (ctypes.addressof(arena) + 4095) & ~4095
    src, aligned, near = base, base + 2 * COPY_BYTES, base + 2 * COPY_BYTES + 4
    best_aligned = best_near = 0.0
    for _ in range(2):
        best_aligned = max(best_aligned, _best_gb_s(aligned, src, runs=runs, copies=copies))
        best_near = max(best_near, _best_gb_s(near, src, runs=runs, copies=copies))
    slow = best_near < SLOW_RATIO * best_aligned
    tunables = os.environ.get("GLIBC_TUNABLES")
    name, version = platform.libc_ver()
    libc = f"{name} {version}".strip() or "unknown"
    advice = None
    if slow:
        if tunables and TUNABLE in tunables:
            advice = (f"GLIBC_TUNABLES sets {TUNABLE} ({tunables!r}) but copies stay slow: raise the threshold above "
                      f"the page and value sizes (16777216), or use a glibc with bug 30994 fixed")
        else:
            advice = (f"start producer processes with {TUNABLES_ADVICE} (read at process start; join it to an "
                      f"existing GLIBC_TUNABLES with ':'), or use a glibc with bug 30994 fixed")
    return CopyCheck(aligned_gb_s=best_aligned, near_gb_s=best_near, slow=slow, tunables=tunables, libc=libc,
                     advice=advice)


_checked = False
_lock = threading.Lock()


def warn_if_slow_copy() -> CopyCheck | None:
    """Run :func:`check_copy` once per process and log its advice as a warning when the host has the pathology.

    Returns the check the first time (``None`` on later calls, and where the check cannot run). Never raises: this is
    advice, and a producer must open whatever it says.
    """
    global _checked
    with _lock:
        if _checked:
            return None
        _checked = True
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # the tunable and the pathology are x86's
    try:
        result = check_copy()
    except Exception:  # noqa: BLE001 - advice only: never stop a producer for it
        log.debug("host copy check failed", exc_info=True)
        return None
    if result.slow:
        log.warning("slow memcpy on this host (glibc bug 30994, %s; copies at short distances %.0fx slower): "
                    "Parquet writing costs up to a third more CPU here; %s (`lakestream host` checks it)",
                    result.libc, 1 / result.ratio if result.ratio else float("inf"), result.advice)
    return result
