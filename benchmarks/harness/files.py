"""File-system hygiene between the runs a benchmark compares.

Deleting thousands of small files makes creating files slow for the next minutes on some local file systems, and a
benchmark that deletes one run's folder before the next run charges that to whichever system creates files. ext4
without a journal (this project's VMs) skips, when it allocates an inode, every free inode freed less than 60 s ago,
or 6 minutes while its inode table block is dirty (``recently_deleted`` in fs/ext4/ialloc.c; ``perf`` shows about
three quarters of a file creation's CPU there). Measured on such a VM: creating an empty file costs 0.02-0.06 ms of
CPU when calm and 0.4-1.3 ms after a run folder of a few thousand files was deleted; 8 lakestream producers publishing
1 MiB batches (about 4 new files per batch) published 54 MiB/s right after 10,000 files were deleted, 145 on a calm
file system. A Kafka broker with in-memory storage creates no files. So the benchmarks that compare keep every run's
folder until they end (``RunFolders``) and wait, once at the start, until creating a file costs what it costs on a
calm file system (``settle_file_creation``). Before each run they flush what the previous one wrote (``flush_writes``):
otherwise the kernel writes it back while the next run runs, and charges it for it.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

__all__ = ["RunFolders", "dir_bytes", "file_creation_ms", "flush_writes", "settle_file_creation", "settle_and_say"]


def flush_writes() -> None:
    """``os.sync()`` where the platform has it: the previous run's writes reach the disk before the next run starts."""
    if hasattr(os, "sync"):
        os.sync()


def dir_bytes(path: Path) -> int:
    """Bytes of the files below ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def file_creation_ms(directory: Path, *, files: int = 100) -> float:
    """CPU milliseconds to create one empty file in ``directory``: the mean of ``files`` creations. The files are kept
    (deleting them is what slows the next ones); they go with ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    start = time.process_time()
    for i in range(files):
        fd = os.open(directory / f"probe-{os.getpid()}-{time.time_ns()}-{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
    return (time.process_time() - start) / files * 1000


def settle_file_creation(directory: Path, *, calm_ms: float = 0.15, max_wait_s: float = 420.0,
                         poll_s: float = 10.0) -> dict[str, Any]:
    """Wait until creating a file in ``directory`` costs at most ``calm_ms`` of CPU (see above), or ``max_wait_s``
    passed (0: measure once, do not wait). Returns what it saw: the first and last cost, the seconds waited, and
    whether it settled; a benchmark records it next to its figures."""
    first = last = file_creation_ms(directory)
    start = time.monotonic()
    waited = 0.0  # seconds spent waiting after the first probe (none when it was calm, or max_wait_s is 0)
    while last > calm_ms and time.monotonic() - start < max_wait_s:
        time.sleep(poll_s)
        last = file_creation_ms(directory)
        waited = time.monotonic() - start
    return {"create_ms_first": round(first, 4), "create_ms": round(last, 4), "waited_s": round(waited, 1),
            "settled": last <= calm_ms, "calm_ms": calm_ms}


def settle_and_say(directory: Path, *, max_wait_s: float, indent: str = "") -> dict[str, Any]:
    """``settle_file_creation`` and one progress line saying what it saw."""
    seen = settle_file_creation(directory, max_wait_s=max_wait_s)
    print(f"{indent}file system {'calm' if seen['settled'] else 'NOT calm'}: creating a file {seen['create_ms']:.3f} ms "
          f"of CPU (first probe {seen['create_ms_first']:.3f} ms, waited {seen['waited_s']:.0f} s)", flush=True)
    return seen


class RunFolders:
    """Folders of finished runs, deleted when the benchmark ends (``close``) instead of between the runs it measures
    (see above). When the disk would go below ``min_free_bytes``, the oldest are deleted at once and counted in
    ``deleted_early`` (a benchmark reports it: the runs after it may have paid for the deletion)."""

    def __init__(self, *, min_free_bytes: int = 8 << 30, delete_at_once: bool = False) -> None:
        self._kept: list[Path] = []
        self._min_free = min_free_bytes
        self._at_once = delete_at_once
        self.deleted_early = 0

    def retire(self, path: Path) -> None:
        if self._at_once:
            shutil.rmtree(path, ignore_errors=True)
            return
        self._kept.append(path)
        while self._kept and shutil.disk_usage(path.parent).free < self._min_free:
            shutil.rmtree(self._kept.pop(0), ignore_errors=True)
            self.deleted_early += 1

    def close(self) -> None:
        while self._kept:
            shutil.rmtree(self._kept.pop(0), ignore_errors=True)
