"""The head relay: one process per host follows the head for every reader; election, takeover, errors, fallback."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import ConfigError, ReadError, StepCollectedError, StreamError, StreamNotFoundError
from lakestream_iceberg.read import relay as relay_module
from lakestream_iceberg.read import relay_client, relay_lock
from lakestream_iceberg.read.follow import HeadWatcher
from lakestream_iceberg.read.relay_client import RelayWatcher, follower
from lakestream_iceberg.read.stream_ref import StreamRef
from tests.backends import fresh_name, postgres_service
from tests.read.test_dataset import SCHEMA, check_items, make_catalog, make_stream, shard
from tests.support import until

pytest.importorskip("torch")  # the dataset's tests need the torch extra (the core's run without it)
from lakestream_iceberg.read.dataset import LakestreamDataset  # noqa: E402

__all__ = ["postgres_service"]

ROOT = Path(__file__).resolve().parents[2]

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.read.test_dataset import make_catalog
    from lakestream_iceberg import Stream
    from lakestream_iceberg.read.stream_ref import StreamRef
    from lakestream_iceberg.read.relay_client import follower
    stream = Stream.open(make_catalog(Path({tmp!r})), "ns.s")
    watcher, _ = follower(stream, ref=StreamRef.of(stream), branch="main", relay=True, poll_s=0.02, max_poll_s=0.5)
    print("holding" if watcher.holding else "client", flush=True)
    time.sleep(600)
""")


# A holder of a newer release: one that also reads lakestream.format-version 2 (this release reads 1 only)
NEWER_HOLDER = HOLDER.replace("\nfrom lakestream_iceberg import Stream\n", textwrap.dedent("""
    import dataclasses
    from lakestream_iceberg.format import properties
    properties.FORMAT_VERSION = dataclasses.replace(properties.FORMAT_VERSION, choices=("1", "2"))
    from lakestream_iceberg import Stream
"""))
assert NEWER_HOLDER != HOLDER


@pytest.fixture(autouse=True)
def relay_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path_factory.mktemp("relay")
    directory.chmod(0o700)
    monkeypatch.setenv("LAKESTREAM_RELAY_DIR", str(directory))
    return directory


def watch(stream: Stream) -> RelayWatcher | HeadWatcher:
    watcher, _ = follower(stream, ref=StreamRef.of(stream), branch="main", relay=True, poll_s=0.02, max_poll_s=0.5)
    return watcher


def start_holder(tmp_path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(ROOT), tmp=str(tmp_path))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "holding"  # EOF (a crash) reads "" and fails here, no hang
    return proc


def client_of_a_killed_holder(stream: Stream, holder: subprocess.Popen[str]) -> RelayWatcher:
    """A reader that connected to ``holder`` (another process serving the relay), which is then SIGKILLed."""
    client = watch(stream)
    assert isinstance(client, RelayWatcher) and not client.holding
    client.check()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    return client


def commit(stream: Stream, step: int, world: int = 2) -> None:
    assert stream.producer("prep-0").commit([shard(step, r) for r in range(world)]).step == step


def fallback_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings of readers that went on reading directly because the head relay failed."""
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "goes on reading directly" in r.getMessage()]


def test_a_client_takes_over_when_the_holder_is_killed(tmp_path: Path, relay_dir: Path) -> None:
    stream = make_stream(tmp_path, steps=2)
    holder = start_holder(tmp_path)
    try:
        client = watch(stream)
        assert isinstance(client, RelayWatcher) and not client.holding
        client.check()
        assert client.head()[0] == 2
        assert [f.file_path for f in client.files(None, 2)] == [f.file_path for f in stream.locate(2)]
        commit(stream, 3)
        stop = threading.Event()
        assert client.wait(3, timeout=60, stop=stop)[0] == 3
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        commit(stream, 4)
        assert client.wait(4, timeout=60, stop=stop)[0] == 4  # reconnected, and elected itself
        assert client.holding
        assert [f.file_path for f in client.files(None, 4)] == [f.file_path for f in stream.locate(4)]
        client.close()
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert not list(relay_dir.iterdir())  # the last reader stopped serving: its socket and lock file are gone


def test_a_reader_never_follows_through_a_holder_of_a_release_that_reads_other_format_versions(tmp_path: Path) -> None:
    """A host upgraded one process at a time: a newer release holds the relay, and upgrades the stream to a format
    version this release does not read. The older reader asked that holder for the head and the step's files, and read
    them without ever seeing the version (only a holder checks it). Releases that read other versions meet at other
    sockets: this reader serves its own relay and is refused with the error that says to upgrade."""
    stream = make_stream(tmp_path, steps=2)
    proc = subprocess.Popen([sys.executable, "-c", NEWER_HOLDER.format(root=str(ROOT), tmp=str(tmp_path))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        commit(stream, 3)
        stream.table.catalog.load_table(stream.name).transaction().set_properties(
            {"lakestream.format-version": "2"}).commit_transaction()
        client = watch(stream)
        try:
            with pytest.raises(ConfigError, match=r"format-version='2'.*reads format version 1 only.*Upgrade"):
                client.check()
                client.wait(3, timeout=60, stop=threading.Event())
                client.files(None, 3)
            assert isinstance(client, RelayWatcher) and client.holding  # its own relay, not the newer release's
        finally:
            client.close()
    finally:
        proc.kill()
        proc.wait(timeout=60)


@pytest.mark.parametrize("call", [
    pytest.param(lambda client, stream: client.wait(2, timeout=60, stop=threading.Event())[0] == 2, id="waiting"),
    # a connection opened to a holder that accepts (the kernel queues it) but never answers ``hello``: a bare
    # TimeoutError came out of the first ``files`` (or of reconnecting) instead of the relay's error
    pytest.param(lambda client, stream: [f.file_path for f in client.files(None, 2)]
                 == [f.file_path for f in stream.locate(2)], id="its files connection opened now"),
])
def test_a_stopped_holder_makes_its_reader_read_directly_instead_of_hanging(
        call: Callable[[RelayWatcher, Stream], bool], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A holder that accepts but never answers (stopped, stuck in a slow lookup): its reader raised a ReadError ("did
    not answer ... pass relay=False") that ended the training job. It reads directly instead, once it has waited
    ``IO_S`` (the same wait as before the error), and says so once, naming the cause and the socket."""
    stream = make_stream(tmp_path, steps=1)
    holder = start_holder(tmp_path)
    try:
        client = watch(stream)
        assert isinstance(client, RelayWatcher)
        client.check()
        monkeypatch.setattr(relay_client, "IO_S", 0.5)
        holder.send_signal(signal.SIGSTOP)
        commit(stream, 2)
        with caplog.at_level(logging.WARNING, logger=relay_client.__name__):
            assert call(client, stream)
            assert client.direct
            assert client.wait(2, timeout=60, stop=threading.Event())[0] == 2  # directly, at once
            assert [f.file_path for f in client.files(client.head()[1], 2)] == [f.file_path for f in stream.locate(2)]
        (warned,) = fallback_warnings(caplog)
        assert "did not answer" in warned and str(client._paths.socket) in warned, warned
        client.close()
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait(timeout=60)


def test_errors_arrive_as_the_same_classes_as_direct_reads(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=8)
    client = watch(stream)
    assert isinstance(client, RelayWatcher) and client.holding
    stream.checkpoint("early", step=1)
    stream.checkpoint("late", step=6)
    Stream.open(stream.table.catalog, "ns.s").collect_garbage(dry_run=False, keep_last=1)  # collects steps 1..5
    client.check()
    with pytest.raises(StepCollectedError, match="step 3 "):
        client.files(None, 3)
    assert len(client.files(None, 7)) == 2
    direct = HeadWatcher(Stream.open(stream.table.catalog, "ns.s"), branch="main")
    stream.table.catalog.drop_table("ns.s")
    with pytest.raises(StreamNotFoundError):
        direct.check()
    with pytest.raises(StreamNotFoundError):
        client.wait(99, timeout=60, stop=threading.Event())
    Stream.create(stream.table.catalog, "ns.s", schema=stream.payload_arrow_schema, world_size=2)
    with pytest.raises(StreamError) as direct_error:
        direct.check()
    with pytest.raises(StreamError) as relayed:
        client.wait(99, timeout=60, stop=threading.Event())
    assert type(relayed.value) is type(direct_error.value) and "dropped and created again" in str(relayed.value)
    client.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_follow_through_the_relay(tmp_path: Path, relay_dir: Path, context: str) -> None:
    from torch.utils.data import DataLoader

    stream = make_stream(tmp_path, steps=1)
    done = threading.Event()

    def produce() -> None:
        for step in range(2, 9):
            commit(stream, step)
        done.set()

    ds = LakestreamDataset(stream, rank=1, world_size=2, follow=True, end_step=8, timeout=60)
    assert ds.relay  # the default in follow mode
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    thread = threading.Thread(target=produce)
    items, sockets = [], []
    for item in loader:
        if not items:
            sockets = list(relay_dir.glob("*.sock"))  # served while the workers follow
            thread.start()
        items.append(item)
    thread.join()
    assert done.is_set()
    check_items(items, world=2, rank=1, steps=list(range(1, 9)))
    assert len(sockets) == 1


CONNECTS: dict[int, int] = {}  # catalog connections opened, by process


@pytest.mark.services
def test_forked_workers_open_a_catalog_connection_only_to_serve_the_relay(tmp_path: Path, relay_dir: Path,
                                                                         postgres_service: object) -> None:
    """A host's catalog connections are its relay holder's (polls, LISTEN): a forked worker that follows through
    the relay opens none, not even at start-up (it uses its parent's view of the table, not a reload)."""
    import torch
    from pyiceberg.catalog.sql import SqlCatalog
    from sqlalchemy import event
    from sqlalchemy.pool import Pool
    from torch.utils.data import DataLoader

    database = fresh_name("db")
    postgres_service.create_database(database)  # type: ignore[attr-defined]
    catalog = SqlCatalog("pg", uri=postgres_service.sqlalchemy_uri(database),  # type: ignore[attr-defined]
                         warehouse=f"file://{tmp_path}/warehouse")
    catalog.create_namespace("ns")
    stream = Stream.create(catalog, "ns.s", schema=SCHEMA, world_size=2)
    commit(stream, 1)

    def connected(*_args: object) -> None:
        CONNECTS[os.getpid()] = CONNECTS.get(os.getpid(), 0) + 1

    def census(item: dict) -> dict:
        return {**item, "pid": torch.tensor(os.getpid()), "connects": torch.tensor(CONNECTS.get(os.getpid(), 0))}

    ds = LakestreamDataset(Stream.open(catalog, "ns.s"), rank=0, world_size=2, follow=True, end_step=6, timeout=60,
                           transform=census)
    items: list[dict] = []
    event.listen(Pool, "connect", connected)
    try:
        for item in DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"):
            items.append(item)
            if int(item["step"]) < 6:  # in lockstep: step k + 1 exists only once step k arrived, so both workers
                commit(stream, int(item["step"]) + 1)  # follow (none has finished) until step 4 arrived, however slow
    finally:
        event.remove(Pool, "connect", connected)
    check_items(items, world=2, rank=0, steps=list(range(1, 7)))
    opened: dict[int, int] = {}  # by worker, up to step 4 (the first worker to finish stops serving, the other takes over)
    for item in items[:4]:
        opened[int(item["pid"])] = max(opened.get(int(item["pid"]), 0), int(item["connects"]))
    assert len(opened) == 2 and sorted(opened.values())[0] == 0  # the client: none
    assert sorted(opened.values())[1] <= 2  # the holder: its polls and its LISTEN


def _recorded_terminations(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The pids of the DataLoader workers terminated from now on. DataLoader joins each worker for
    ``MP_STATUS_CHECK_INTERVAL``, then terminates the ones still alive (they exit 0 either way): set to 60 s, long enough
    for any machine, so a termination means the worker never noticed the shutdown."""
    import multiprocessing.process

    import torch.utils.data._utils as torch_utils

    monkeypatch.setattr(torch_utils, "MP_STATUS_CHECK_INTERVAL", 60.0)
    terminated: list[int | None] = []
    terminate = multiprocessing.process.BaseProcess.terminate

    def recorded(process: multiprocessing.process.BaseProcess) -> None:
        terminated.append(process.pid)
        terminate(process)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "terminate", recorded)
    return terminated


@pytest.mark.parametrize("relay", [True, False])
def test_workers_waiting_for_a_step_exit_by_themselves_when_the_loop_stops_early(
        tmp_path: Path, relay: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that breaks out while its workers wait for unpublished steps: DataLoader's shutdown reaches the waits
    (read/worker_exit.py), and every worker exits by itself instead of being terminated after its join timeout."""
    from torch.utils.data import DataLoader

    terminated = _recorded_terminations(monkeypatch)
    stream = make_stream(tmp_path, steps=2)
    ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, relay=relay)  # follows forever
    loader = iter(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert [next(loader)["step"], next(loader)["step"]] == [1, 2]  # then both workers wait for steps 3 and 4
    workers = list(loader._workers)  # torch's worker processes, only observed
    loader._shutdown_workers()  # what the iterator's __del__ does when a loop stops early
    assert terminated == [] and [w.exitcode for w in workers] == [0, 0]


def test_stateful_dataloader_workers_waiting_for_a_step_exit_by_themselves_when_the_loop_stops_early(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchdata's StatefulDataLoader (what docs/guide/training.md names for resuming with workers) runs a worker loop
    of its own: its shutdown reached no waiting worker, which was terminated after 5 s each (and a worker whose training
    process died followed the stream until its timeout, forever without one)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    from torchdata.stateful_dataloader import StatefulDataLoader

    terminated = _recorded_terminations(monkeypatch)
    stream = make_stream(tmp_path, steps=2)
    ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True)  # follows forever
    loader = iter(StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert [next(loader)["step"], next(loader)["step"]] == [1, 2]  # then both workers wait for steps 3 and 4
    workers = list(loader._workers)
    loader._shutdown_workers()
    assert terminated == [] and [w.exitcode for w in workers] == [0, 0]


@pytest.mark.parametrize("persistent", [True, False])
def test_follow_mode_under_persistent_workers_warns_once(tmp_path: Path, persistent: bool) -> None:
    """DataLoader restarts persistent workers between items only, so after a break a follow-mode worker holds the next
    iter(loader) until its step is published: the first worker says so once; without persistent workers nothing."""
    from torch.utils.data import DataLoader

    logfile = tmp_path / "workers.log"
    handler = logging.FileHandler(logfile)  # forked workers inherit it: what they log lands in the file
    logger = logging.getLogger("lakestream_iceberg.read.dataset")
    logger.addHandler(handler)
    try:
        stream = make_stream(tmp_path, steps=2)
        ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, relay=False)
        loader = iter(DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent,
                                 multiprocessing_context="fork"))
        assert [next(loader)["step"], next(loader)["step"]] == [1, 2]  # both workers have started their iterations
        loader._shutdown_workers()
    finally:
        logger.removeHandler(handler)
        handler.close()
    warned = [line for line in logfile.read_text().splitlines() if "persistent_workers=True" in line]
    assert len(warned) == (1 if persistent else 0), warned


def test_a_worker_watch_stops_the_iteration_on_shutdown_or_orphaning_and_never_after_it_closed() -> None:
    import multiprocessing

    from lakestream_iceberg.read.worker_exit import ShutdownWatch, stop_on_shutdown

    context = multiprocessing.get_context("fork")
    orphaned, shut_down, closed = threading.Event(), threading.Event(), threading.Event()
    never = context.Event()  # the training process died without shutting the worker down: never set
    ShutdownWatch(never, orphaned, parent=os.getppid() + 1_000_000)._thread.join()  # not our parent: orphaned
    done = context.Event()
    watch = ShutdownWatch(done, shut_down)
    done.set()  # DataLoader shuts its workers down
    watch._thread.join()
    quiet = ShutdownWatch(context.Event(), closed)
    quiet.close()  # the iteration returned: the thread is gone, and it set nothing
    assert orphaned.is_set() and shut_down.is_set() and not closed.is_set() and not quiet._thread.is_alive()
    assert stop_on_shutdown(threading.Event()) is None  # not in a DataLoader worker: nothing watched


@pytest.mark.parametrize("relay", [True, False])
def test_forked_workers_of_a_table_dropped_and_created_again_raise(tmp_path: Path, relay: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked worker starts from its parent's view of the table (no reload): its first poll, through the relay or
    not, finds the table another one, and no step of the old table is delivered."""
    import torch.utils.data._utils as torch_utils
    from torch.utils.data import DataLoader

    stream = make_stream(tmp_path, steps=3)
    ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, end_step=3, timeout=60, relay=relay)
    stream.table.catalog.drop_table("ns.s")
    Stream.create(stream.table.catalog, "ns.s", schema=SCHEMA, world_size=2)
    # After a worker's exception DataLoader's shutdown joins each worker for this long before terminating it (torch's
    # behaviour with any dataset): shut this loader down here, in 0.2 s per worker rather than 5 s in a later test.
    monkeypatch.setattr(torch_utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    loader = iter(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    with pytest.raises(StreamError, match="dropped and created again"):
        list(loader)
    loader._shutdown_workers()


def test_disabled_or_unusable_relay_reads_directly(tmp_path: Path, relay_dir: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    stream = make_stream(tmp_path, steps=3)
    ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, end_step=3, timeout=60, relay=False)
    check_items(list(ds), world=2, rank=0, steps=[1, 2, 3])
    assert not list(relay_dir.iterdir())
    with pytest.raises(Exception, match="relay"):
        LakestreamDataset(stream, rank=0, world_size=2, follow=True, relay="no")
    relay_dir.chmod(0o755)  # others may enter: not private, not used
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.read"):
        ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, end_step=3, timeout=60)
        check_items(list(ds), world=2, rank=0, steps=[1, 2, 3])
    assert "others may enter it" in caplog.text and "read the catalog directly" in caplog.text
    assert not list(relay_dir.iterdir())


def test_a_forked_child_does_not_keep_its_parents_relay_elected(tmp_path: Path, relay_dir: Path) -> None:
    stream = make_stream(tmp_path, steps=1)
    client = watch(stream)
    assert isinstance(client, RelayWatcher) and client.holding
    (lock,) = relay_dir.glob("*.lock")
    locked = open(lock, "rb")  # noqa: SIM115  the file the parent locked, which it removes when it releases
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its copy of the lock is closed, so the parent's release frees the lock
        os.close(write)
        os.read(read, 1)  # until the parent released
        try:
            fcntl.flock(locked, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os._exit(0 if not lock.exists() else 4)
        except BlockingIOError:
            os._exit(3)
    locked.close()
    os.close(read)
    client.close()
    os.write(write, b"x")
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert make_catalog(tmp_path)  # the parent goes on


def test_a_holder_opened_on_an_old_view_answers_for_the_current_head(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=2)
    old = Stream.open(make_catalog(tmp_path), "ns.s")  # a worker's view, read when it started
    commit(stream, 3)
    commit(stream, 4)
    holder = watch(old)
    assert isinstance(holder, RelayWatcher) and holder.holding
    assert [f.file_path for f in holder.files(None, 4)] == [f.file_path for f in stream.locate(4)]
    holder.close()


def test_a_follow_reader_whose_planned_step_was_collected_gets_the_direct_error(tmp_path: Path) -> None:
    stream = make_stream(tmp_path, steps=10)
    ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, end_step=10, prefetch=2, timeout=60,
                           collate=lambda it: it.step)
    iterator = iter(ds)
    got = [next(iterator)]  # steps 2 and 3 are planned through the relay, on the head of that moment
    stream.checkpoint("early", step=1)
    stream.checkpoint("late", step=6)
    Stream.open(stream.table.catalog, "ns.s").collect_garbage(dry_run=False, keep_last=1)  # collects steps 1..5
    with pytest.raises(StepCollectedError, match="step 4 "):
        got.extend(iterator)
    assert got[:1] == [1] and set(got) <= {1, 2, 3}
    ds.load_state_dict({"next_step": 6})
    assert list(ds) == [6, 7, 8, 9, 10]


def test_the_lock_is_never_held_twice_while_holders_remove_their_lock_files(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Holders unlink their lock file when they stop: whoever opened that file just before must not count as holding
    the lock (relay_lock.lock_file checks that the path still names the file it locked). Threads lock through open files of
    their own, which exclude each other as processes do."""
    path = tmp_path / "k.lock"
    holders: list[int] = []
    taken, overlaps = [0], [0]
    guard = threading.Lock()

    def run() -> None:
        for _ in range(300):
            fd = relay_lock.lock_file(path)
            if fd is None:
                continue
            with guard:
                overlaps[0] += bool(holders)
                holders.append(fd)
                taken[0] += 1
            os.sched_yield()
            with guard:
                holders.remove(fd)
            relay_lock.unlink_quietly(path)  # as HeadRelay.stop: unlink while locked, then release
            os.close(fd)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert taken[0] > 0 and overlaps[0] == 0 and not path.exists()

    # the race itself, made certain: the file is unlinked (its holder stopping) between this open and this lock
    real_stat, unlinked = os.stat, []

    def stat_after_unlink(target: object, *args: object, **kwargs: object) -> os.stat_result:
        if target == path and not unlinked:
            unlinked.append(target)
            os.unlink(path)
        return real_stat(target, *args, **kwargs)  # type: ignore[arg-type]

    path.touch()
    with monkeypatch.context() as patch:
        patch.setattr(os, "stat", stat_after_unlink)
        fd = relay_lock.lock_file(path)
    assert fd is not None and unlinked
    assert os.fstat(fd).st_ino == os.stat(path).st_ino  # it holds the file the path names now, made after the unlink
    os.close(fd)


def test_a_holder_serves_connections_on_descriptors_above_1024(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder with many clients (two connections per reader) or many open files gets descriptors >= 1024, which
    ``select`` refuses: its accept thread died and every reader of the host waited for a relay that never answered."""
    stream = make_stream(tmp_path, steps=2)
    monkeypatch.setattr(relay_client, "IO_S", 2.0)  # without poll(): fail in seconds, not after the full IO_S
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        watcher = watch(stream)
        assert isinstance(watcher, RelayWatcher) and watcher.holding
        watcher.check()
        assert [f.file_path for f in watcher.files(None, 2)] == [f.file_path for f in stream.locate(2)]
        watcher.close()
    finally:
        for fd in filler:
            os.close(fd)


def test_a_holder_at_its_client_limit_makes_its_own_reader_read_directly(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A relay at MAX_CLIENTS closes new connections; a reader of the holder's own process then spun forever
    (elect: "I hold it", connect: refused, elect, ...) instead of giving up after CONNECT_S. The holder says so, once.
    After CONNECT_S the reader raised a ReadError (the job ended); it reads directly instead, and says why."""
    stream = make_stream(tmp_path, steps=2)
    monkeypatch.setattr(relay_module, "MAX_CLIENTS", 1)
    monkeypatch.setattr(relay_client, "CONNECT_S", 0.5)
    watcher = watch(stream)
    assert isinstance(watcher, RelayWatcher) and watcher.holding  # its wait connection is the one client
    got: list[object] = []

    def files() -> None:
        try:
            got.append([f.file_path for f in watcher.files(None, 2)])  # opens the files connection: refused
        except BaseException as exc:  # noqa: BLE001
            got.append(exc)

    thread = threading.Thread(target=files, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the reader spun instead of reading directly"
    assert got == [[f.file_path for f in stream.locate(2)]] and watcher.direct
    (warned,) = fallback_warnings(caplog)
    assert "clients it takes" in warned and "at step 2" in warned, warned
    full = [r for r in caplog.records if "its most: refusing new connections" in r.getMessage()]
    assert len(full) == 1 and full[0].levelno == logging.WARNING  # once, however many connections it refused
    watcher.close()


def test_a_holder_out_of_descriptors_accepts_again_once_some_are_free(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """accept() failing with EMFILE (many clients under a low ``ulimit -n``) ended the holder's accept thread for good:
    the relay stayed elected and answered nobody again."""
    import resource
    import socket

    stream = make_stream(tmp_path, steps=2)
    monkeypatch.setattr(relay_client, "IO_S", 2.0)
    watcher = watch(stream)
    assert isinstance(watcher, RelayWatcher) and watcher.holding
    watcher.check()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tried = threading.Event()
    handler = logging.Handler()
    handler.emit = lambda record: tried.set() if "cannot accept" in record.getMessage() else None  # type: ignore[method-assign]

    def fill() -> None:  # every free descriptor, also any that another thread frees meanwhile
        try:
            while True:
                filler.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass

    relay_module.log.addHandler(handler)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
        fill()
        peer.connect(str(watcher._paths.socket))  # needs no new descriptor: accepting it does
        for _ in range(400):  # the accept thread tries within 0.2 s: it warns (or, before, its thread ended)
            fill()
            if tried.wait(0.05) or not any(t.name == "lakestream-relay-accept" for t in threading.enumerate()):
                break
    finally:
        relay_module.log.removeHandler(handler)
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    peer.close()
    assert [f.file_path for f in watcher.files(None, 2)] == [f.file_path for f in stream.locate(2)]
    watcher.close()


def _hello(path: Path, *, timeout: float = 5.0) -> dict[str, object]:
    """One raw ``hello`` to the relay at ``path``: its answer (ConnectionError: refused; TimeoutError: deaf)."""
    import socket

    from lakestream_iceberg.read.relay_wire import recv_frame, send_frame

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        send_frame(sock, {"op": "hello"}, timeout=timeout)
        return recv_frame(sock, timeout=timeout)


def test_a_holder_that_cannot_start_a_clients_thread_serves_the_next_clients(tmp_path: Path) -> None:
    """A thread that could not start (``ulimit -u`` counts threads; or memory) raised RuntimeError out of the accept
    loop: its thread ended, the relay stayed elected and every reader of the host waited for answers that never came
    (the refused connection was also kept open, never served). A thread stack no address space holds fails the same
    ``pthread_create`` for real."""
    stream = make_stream(tmp_path, steps=2)
    watcher = watch(stream)
    assert isinstance(watcher, RelayWatcher) and watcher.holding
    watcher.check()
    path = watcher._paths.socket
    uuid = str(stream.table.metadata.table_uuid)
    assert _hello(path)["uuid"] == uuid
    previous = threading.stack_size(1 << 50)
    try:
        with pytest.raises(ConnectionError):  # refused at once: closed, not kept open unserved (a TimeoutError)
            _hello(path)
    finally:
        threading.stack_size(previous)
    assert _hello(path)["uuid"] == uuid  # served again (before: TimeoutError, nobody accepted any more)
    assert [f.file_path for f in watcher.files(None, 2)] == [f.file_path for f in stream.locate(2)]
    watcher.close()


def test_a_holder_reads_no_request_larger_than_requests_are() -> None:
    """The holder read its clients' requests with the replies' limit (64 MB): a client declaring 64 MB held that much of
    the holder's memory per connection (20 such clients took 1.2 GB), up to MAX_CLIENTS of them. A request is a few
    dozen bytes: a larger one ends its connection at once, before its body is read."""
    import socket
    import struct

    from lakestream_iceberg.read.relay_wire import MAX_FRAME, MAX_REQUEST, recv_frame

    assert MAX_REQUEST < MAX_FRAME
    ours, theirs = socket.socketpair()
    with ours, theirs:
        body = b'{"op":"hello","pad":"' + b"x" * MAX_REQUEST + b'"}'
        theirs.sendall(struct.pack(">I", len(body)))  # the header alone: the body is never needed to refuse it
        with pytest.raises(ConnectionError, match="exceeds"):
            recv_frame(ours, timeout=10, limit=MAX_REQUEST)


def test_a_relay_closes_a_connection_declaring_a_request_larger_than_requests_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through a holder: it read on towards the declared 32 MB (up to IO_S) instead of closing at once."""
    import socket
    import struct

    monkeypatch.setattr(relay_module, "IO_S", 3600.0)  # a holder reading on waits for the body past this test's wait
    stream = make_stream(tmp_path, steps=1)
    watcher = watch(stream)
    assert isinstance(watcher, RelayWatcher) and watcher.holding
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(120.0)  # closed at once; a holder reading on towards 32 MB would not close it for an hour
        sock.connect(str(watcher._paths.socket))
        try:
            sock.sendall(struct.pack(">I", 32 * 1024 * 1024) + b'{"op":"hello","pad":"' + b"x" * 256 * 1024)
            assert sock.recv(1) == b""  # closed; before: TimeoutError, the holder reading on towards 32 MB
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed before all of our bytes went, or with them unread
    assert _hello(watcher._paths.socket)["uuid"] == str(stream.table.metadata.table_uuid)
    watcher.close()


def test_a_kept_answer_is_not_held_up_by_another_steps_slow_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every files request took the holder's plan lock before looking at the answers it keeps: while one step's lookup
    waited on storage (a slow manifest read), readers asking for a step already answered waited too, past IO_S into a
    ReadError ("is its holder stopped?") when the read took that long. The slow read is the real lookup, held back."""
    stream = make_stream(tmp_path, steps=3)
    first, second = watch(stream), watch(stream)  # two readers of this process, each with its own connections
    assert isinstance(first, RelayWatcher) and isinstance(second, RelayWatcher) and first.holding
    first.check()
    second.check()
    expected = [f.file_path for f in stream.locate(2)]
    assert [f.file_path for f in second.files(None, 2)] == expected  # step 2's answer is kept
    relay = relay_module.held(first._paths)
    assert relay is not None
    index = relay.stream.index
    looking, release = threading.Event(), threading.Event()
    lookup = index.files

    def slow_files(snapshot: object, step: int) -> list:
        if step == 3:
            looking.set()
            release.wait(120)  # past the client's IO_S: a kept answer stuck behind this lookup fails its reader
        return lookup(snapshot, step)

    monkeypatch.setattr(index, "files", slow_files)
    slow = threading.Thread(target=first.files, args=(None, 3), daemon=True)
    slow.start()
    try:
        assert looking.wait(30)
        answered: list[list[str]] = []
        kept = threading.Thread(target=lambda: answered.append([f.file_path for f in second.files(None, 2)]),
                                daemon=True)
        kept.start()
        kept.join(timeout=60)  # answered at once, or its reader failed after IO_S (10 s): either way it ends
        assert answered == [expected], "a kept answer waited for another step's lookup"
    finally:
        release.set()
        slow.join(timeout=60)
    first.close()
    second.close()


def test_a_step_whose_answer_exceeds_a_frame_raises_an_error_that_says_so(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer over MAX_FRAME (a step of some 400,000 files) was sent anyway; its reader refused the frame as a broken
    connection, connected again (electing anew) and asked again, four times, each costing the holder the whole answer,
    then raised "closed 4 connections in a row": nothing said the step was too large for the relay."""
    from lakestream_iceberg.read import relay_wire

    stream = make_stream(tmp_path, steps=2)
    watcher = watch(stream)
    assert isinstance(watcher, RelayWatcher) and watcher.holding
    watcher.check()
    watcher.files(None, 1)  # its files connection is open
    asked: list[object] = []  # the holder's requests for step 2 (the watcher's own head waits go on meanwhile)
    answer = relay_module.HeadRelay._answer

    def counted(self: relay_module.HeadRelay, request: dict) -> dict:
        if request.get("step") == 2 and request.get("op") != "wait":
            asked.append(request.get("op"))
        return answer(self, request)

    monkeypatch.setattr(relay_module.HeadRelay, "_answer", counted)
    monkeypatch.setattr(relay_wire, "MAX_FRAME", 300)  # the hello and head answers fit, a step's two files do not
    with pytest.raises(ReadError, match=r"step 2 .*too large.*relay=False"):
        watcher.files(None, 2)
    assert len(asked) == 1, asked  # asked once, not once per reconnection
    watcher.check()  # the connection still works
    monkeypatch.undo()
    assert [f.file_path for f in watcher.files(None, 2)] == [f.file_path for f in stream.locate(2)]
    watcher.close()


@pytest.mark.parametrize("timeout", [b"1" + b"0" * 400, b"-1" + b"0" * 400, b"NaN", b"Infinity", b"0", b"0.5"])
def test_a_wait_request_of_any_json_number_is_answered_with_the_head(tmp_path: Path, timeout: bytes) -> None:
    """A wait's timeout is a wire number: an integer past a float's range raised OverflowError in the holder, which
    came back as ReadError("the head relay failed (OverflowError: int too large to convert to float)")."""
    import socket
    import struct

    from lakestream_iceberg.read.relay_wire import recv_frame

    stream = make_stream(tmp_path, steps=1)
    watcher = watch(stream)
    assert isinstance(watcher, RelayWatcher) and watcher.holding
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(watcher._paths.socket))
        body = b'{"op":"wait","step":1,"timeout":' + timeout + b"}"
        sock.sendall(struct.pack(">I", len(body)) + body)
        reply = recv_frame(sock, timeout=10)
    assert reply.get("head") == 1 and "error" not in reply, reply
    watcher.close()


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"op": "files", "step": ' + b"9" * 5_000 + b"}", b"\xff\xfe", b"[1]"])
def test_a_frame_that_is_not_a_json_object_ends_the_connection_only(body: bytes) -> None:
    """A peer's frame of arrays nested 100,000 deep raised RecursionError out of recv_frame: a traceback from the
    holder's client thread, or out of a reader (a broken peer's bytes are a broken connection, nothing else)."""
    import socket
    import struct

    from lakestream_iceberg.read.relay_wire import recv_frame

    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(struct.pack(">I", len(body)) + body)
        with pytest.raises(ConnectionError, match="relay frame is not"):
            recv_frame(ours, timeout=10)


FORKING_HOLDER = HOLDER.replace("time.sleep(600)\n", """sys.stdin.readline()
import os
if os.fork() == 0:  # a child that outlives the holder (a worker, a helper process), till the test lets it go
    sys.stdin.read()
    os._exit(0)
print("forked", flush=True)
time.sleep(600)
""")
assert FORKING_HOLDER != HOLDER


def test_a_holders_forked_child_does_not_keep_its_clients_connections_open(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked by the holder kept copies of the holder's client connections: when the holder died its clients
    saw no end of connection, waited out IO_S and raised ReadError instead of electing a new holder."""
    stream = make_stream(tmp_path, steps=1)
    monkeypatch.setattr(relay_client, "IO_S", 5.0)
    holder = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER.format(root=str(ROOT), tmp=str(tmp_path))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "holding"
        client = watch(stream)
        assert isinstance(client, RelayWatcher) and not client.holding
        client.check()  # its connection is accepted: the child is forked with a copy of it
        holder.stdin.write("fork\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "forked"
        holder.kill()
        holder.wait(timeout=60)
        commit(stream, 2)
        assert client.wait(2, timeout=60, stop=threading.Event())[0] == 2  # reconnected, and elected itself
        assert client.holding
        client.close()
    finally:
        holder.kill()
        holder.wait(timeout=60)
        holder.stdin.close()  # the child's stdin ends: it exits


def test_a_relay_dir_variable_that_cannot_be_used_is_said_not_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """LAKESTREAM_RELAY_DIR naming a file, a folder others may enter or a relative path was dropped without a word
    (followers polled the catalog each), and a relative one was used from each process's working directory."""
    from lakestream_iceberg.read import relay_wire

    usable = relay_wire.relay_dir()  # the tests' own (conftest.py)
    assert usable is not None
    afile = tmp_path / "afile"
    afile.write_text("x")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    for value, why in ((str(afile), "not a folder"), (str(shared), "others may enter it"), ("relative/dir", "relative")):
        monkeypatch.setenv("LAKESTREAM_RELAY_DIR", value)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=relay_wire.__name__):
            assert relay_wire.relay_dir() is None
        assert any("LAKESTREAM_RELAY_DIR" in r.getMessage() and why in r.getMessage() for r in caplog.records), \
            caplog.text
    assert not Path("relative").exists()
    monkeypatch.setenv("LAKESTREAM_RELAY_DIR", str(usable))
    assert relay_wire.relay_dir() == usable


def test_an_unusable_relay_dir_variable_is_the_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A follower under a LAKESTREAM_RELAY_DIR that cannot be used logged, after the warning saying why, a second one
    saying no private directory was found among $XDG_RUNTIME_DIR, /dev/shm and the temporary directory, none of which
    is tried when the variable is set."""
    stream = make_stream(tmp_path, world=1, steps=2)
    value = f"relative/{tmp_path.name}"  # relay_dir() says why a value is not used once per process
    monkeypatch.setenv("LAKESTREAM_RELAY_DIR", value)
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.read"):
        watcher, _ = follower(stream, ref=StreamRef.of(stream), branch="main", relay=True, poll_s=0.02, max_poll_s=0.5)
    try:
        assert isinstance(watcher, HeadWatcher)  # reads directly
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"LAKESTREAM_RELAY_DIR={value} is not used" in m for m in messages), messages
        assert not any("/dev/shm" in m for m in messages), messages
    finally:
        watcher.close()
        stream.close()


def test_a_step_published_again_after_a_rollback_is_read_as_the_readers_head_lists_it(tmp_path: Path) -> None:
    """Another engine rolls main back from step 4 to step 2 and producers publish steps 3 and 4 again. A reader that
    started since (its head lists the new step 3) read the new step 3 directly, but the old one through the relay: the
    relay planned steps on the head of the first client that asked (kept until a step past it is asked), whose files
    were still there. A reader whose head is still the old one reads the old step 3, as a direct read of its head does."""
    stream = make_stream(tmp_path, steps=4)
    first = watch(Stream.open(make_catalog(tmp_path), "ns.s"))
    assert isinstance(first, RelayWatcher)
    first.check()
    old = [f.file_path for f in stream.locate(3)]
    assert [f.file_path for f in first.files(first.head()[1], 3)] == old  # planned on the head of step 4
    step_2 = next(s.snapshot_id for s in stream.refresh().table.metadata.snapshots
                  if s.summary is not None and s.summary.additional_properties.get("lakestream.step") == "2")
    stream.table.manage_snapshots().rollback_to_snapshot(step_2).commit()
    again = Stream.open(make_catalog(tmp_path), "ns.s").producer("prep-1")
    for step in (3, 4):
        assert again.commit([shard(step + 100, r) for r in range(2)], seq=step - 3).step == step
    head = stream.refresh().table.metadata.snapshot_by_name("main").snapshot_id
    new = [f.file_path for f in stream.locate(3)]
    assert new != old
    second = watch(Stream.open(make_catalog(tmp_path), "ns.s"))
    assert isinstance(second, RelayWatcher)
    stop = threading.Event()
    until(lambda: second.wait(4, timeout=5, stop=stop)[1] == head, "the relay to see the new head")
    assert [f.file_path for f in second.files(second.head()[1], 3)] == new
    assert [f.file_path for f in first.files(first.head()[1], 3)] == old
    second.close()
    first.close()


@pytest.mark.parametrize("relay", [True, False])
def test_the_training_process_of_workers_reads_the_head_for_its_metric_through_the_relay(
        tmp_path: Path, relay: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dataset.track(loader)`` reports how far behind the head the loop is: with the relay, the training process
    asks the host's relay (no pointer query or ``metadata.json`` read of its own per report, which made a thousand
    ranks a thousand catalog pollers); without, it reads the head itself. The gauge is right either way."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from torch.utils.data import DataLoader

    from lakestream_iceberg.connect import metrics

    stream = make_stream(tmp_path, steps=6)
    holder = start_holder(tmp_path) if relay else None
    parent, polls = os.getpid(), []
    check = HeadWatcher.check

    def counted(self: HeadWatcher) -> bool:
        if os.getpid() == parent:  # the forked workers' own polls are not the training process's
            polls.append(1)
        return check(self)

    monkeypatch.setattr(HeadWatcher, "check", counted)
    registry = prometheus_client.CollectorRegistry()
    metrics.use_registry(registry)
    try:
        ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, end_step=4, timeout=60, group="run",
                               report_s=0.05, relay=relay)
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        labels = {"catalog": stream.table.catalog.name, "stream": stream.name, "group": "run", "rank": "0"}
        steps = []
        for item in ds.track(loader):
            steps.append(int(item["step"]))
            if steps[-1] == 4:  # head 6; refreshed at each report (every 0.05 s)
                until(lambda: registry.get_sample_value("lakestream_consumer_steps_behind_head", labels) == 2,
                      "the gauge to see head step 6 with the rank at step 4")
        assert steps == [1, 2, 3, 4]
        assert registry.get_sample_value("lakestream_consumer_last_step", labels) == 4
        assert registry.get_sample_value("lakestream_consumer_steps_behind_head", labels) is None  # the rank is done
        assert (len(polls) == 0) if relay else (len(polls) > 0)
    finally:
        metrics.use_registry(None)
        if holder is not None:
            holder.kill()
            holder.wait(timeout=60)


@pytest.mark.parametrize("metric", [True, False])
def test_the_training_process_of_workers_never_serves_the_relay(tmp_path: Path, metric: bool) -> None:
    """``dataset.track(loader)`` opened the host's relay in the training process before the loader forked its workers,
    so the training process was its first client and served it (metric exported or not): its polls of the catalog, and
    every worker's step plans (manifest reads) of the host, ran on the training loop's interpreter. It asks the relay
    only for the metric, as a client, and reads the head itself while no other process serves it."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from torch.utils.data import DataLoader

    from lakestream_iceberg.connect import metrics
    from lakestream_iceberg.read.relay import held
    from lakestream_iceberg.read.relay_wire import relay_paths

    stream = make_stream(tmp_path, steps=6)
    ref = StreamRef.of(stream)
    paths = relay_paths(catalog_name=ref.catalog_name, catalog_properties=ref.catalog_properties,
                        identifier=ref.identifier, table_uuid=str(stream.table.metadata.table_uuid), branch="main")
    assert paths is not None
    registry = prometheus_client.CollectorRegistry()
    metrics.use_registry(registry if metric else None)
    try:
        ds = LakestreamDataset(stream, rank=0, world_size=2, follow=True, end_step=4, timeout=60, group="run",
                               report_s=0.05, relay=True)
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        tracked = ds.track(loader)
        assert held(paths) is None
        steps = []
        labels = {"catalog": stream.table.catalog.name, "stream": stream.name, "group": "run", "rank": "0"}
        for item in tracked:
            steps.append(int(item["step"]))
            assert held(paths) is None, steps
            if metric and steps[-1] == 4:  # head 6
                until(lambda: registry.get_sample_value("lakestream_consumer_steps_behind_head", labels) == 2,
                      "the gauge to see head step 6 with the rank at step 4")
        assert steps == [1, 2, 3, 4]
    finally:
        metrics.use_registry(None)


def test_a_relay_dir_too_long_for_a_socket_in_bytes_is_said_not_used(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A LAKESTREAM_RELAY_DIR of non-ASCII characters short enough in characters but not in bytes (a unix socket's path
    is bytes) was taken: every follower then failed to bind or reach the socket ("AF_UNIX path too long") and logged a
    warning of its own, instead of the one warning saying the folder is not used and why."""
    from lakestream_iceberg.read import relay_wire

    base = Path(tempfile.mkdtemp(prefix="lsr"))
    try:
        chosen = base / ("é" * (relay_wire._SOCKET_NAME_MAX - 38 - len(str(base)) - 1))
        assert len(str(chosen)) + 38 <= relay_wire._SOCKET_NAME_MAX < len(os.fsencode(str(chosen))) + 38
        monkeypatch.setenv("LAKESTREAM_RELAY_DIR", str(chosen))
        with caplog.at_level(logging.WARNING, logger=relay_wire.__name__):
            assert relay_wire.relay_dir() is None
        assert any("too long for a unix socket" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        shutil.rmtree(base)


def test_a_holder_whose_connection_queue_is_full_makes_its_reader_read_directly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A reader reconnecting (its holder exited) to a relay whose queue of connections not yet accepted is full (a
    holder out of descriptors, stopped, or starved while a whole host reconnects at once) got a bare BlockingIOError
    ("Resource temporarily unavailable") out of its wait: a unix socket refuses such a connect at once instead of
    queueing it. It waits for a free place as for a holder starting up (CONNECT_S), and then reads directly (before:
    it raised the relay's ReadError, which ended the job)."""
    import socket

    stream = make_stream(tmp_path, steps=1)
    holder = start_holder(tmp_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    queued: list[socket.socket] = []
    try:
        client = client_of_a_killed_holder(stream, holder)
        paths = client._paths
        with open(paths.lock, "a+b") as lock:  # a holder that never accepts: this test
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            paths.socket.unlink()
            listener.bind(str(paths.socket))
            listener.listen(1)
            while True:  # fill its queue until the kernel refuses a connection
                peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                peer.setblocking(False)
                queued.append(peer)
                try:
                    peer.connect(str(paths.socket))
                except BlockingIOError:
                    break
            monkeypatch.setattr(relay_client, "CONNECT_S", 0.5)
            commit(stream, 2)
            with caplog.at_level(logging.WARNING, logger=relay_client.__name__):
                client.check()
                assert client.direct and client.head()[0] == 2
        (warned,) = fallback_warnings(caplog)
        assert "no process served the head relay" in warned, warned
        client.close()
    finally:
        for peer in queued:
            peer.close()
        listener.close()
        holder.kill()
        holder.wait(timeout=60)


def test_a_relay_directory_removed_under_its_readers_makes_them_read_directly(tmp_path: Path, relay_dir: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The relay directory removed while readers follow (systemd removes $XDG_RUNTIME_DIR when the user's last session
    ends, e.g. a run started over ssh and left running): a reader whose holder exited then reconnected, found no
    socket, tried to serve the relay itself and got a bare FileNotFoundError out of its wait (making the lock file),
    which a follow-mode loop can take for a collected step's file; then the relay's ReadError, which ended the job. It
    reads directly, and its warning names the folder and LAKESTREAM_RELAY_DIR."""
    stream = make_stream(tmp_path, steps=1)
    holder = start_holder(tmp_path)
    try:
        client = client_of_a_killed_holder(stream, holder)
        shutil.rmtree(relay_dir)
        commit(stream, 2)
        with caplog.at_level(logging.WARNING, logger=relay_client.__name__):
            client.check()
            assert client.direct and client.head()[0] == 2
            assert [f.file_path for f in client.files(client.head()[1], 2)] == [f.file_path for f in stream.locate(2)]
        (warned,) = fallback_warnings(caplog)
        assert "cannot serve the head relay" in warned and str(relay_dir) in warned, warned
        client.close()
    finally:
        holder.kill()
        holder.wait(timeout=60)


def test_the_holder_keeps_answers_of_at_most_so_many_data_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder kept its last 256 answers whatever their size: in steady state every step's list of data files of
    the last 256 steps (a stream of one file per rank at 4,096 ranks: about 370 MB; at 100,000 files a step: about
    9 GB) in the process that serves the relay, a rank or a DataLoader worker. The answers kept hold at most
    ``PLAN_FILES_KEPT`` data files, and always the newest answer."""
    stream = make_stream(tmp_path, steps=4)  # 2 files a step
    monkeypatch.setattr(relay_module, "PLAN_FILES_KEPT", 5)
    watcher = watch(stream)
    assert isinstance(watcher, RelayWatcher) and watcher.holding
    watcher.check()
    relay = relay_module.held(watcher._paths)
    assert relay is not None
    for step in range(1, 5):
        assert [f.file_path for f in watcher.files(None, step)] == [f.file_path for f in stream.locate(step)]
        kept = list(relay._plans.values())
        assert kept[-1]["step"] == step and sum(len(answer["files"]) for answer in kept) <= 5
    monkeypatch.setattr(relay_module, "PLAN_FILES_KEPT", 1)  # one answer larger than the bound is still kept
    assert [f.file_path for f in watcher.files(None, 1)] == [f.file_path for f in stream.locate(1)]
    assert [answer["step"] for answer in relay._plans.values()] == [1]
    watcher.close()


def test_readers_a_little_behind_the_head_do_not_make_the_relay_poll_the_catalog(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follow-mode reader whose producers stay a step or two ahead (fewer than its prefetch) refreshes its head at
    every step to prefetch further; through the relay that refresh was a ``check``, which makes the holder poll the
    catalog now and plan the next steps on the head of now: one catalog query (and a manifest read on each new head)
    per step and reader of the host, what the relay is there to save. The refresh asks the relay for its head (its own
    loop polls); only a reader that found a file gone after a GC makes it poll."""
    from lakestream_iceberg.read.follow import pump_steps

    stream = make_stream(tmp_path, steps=3)
    forced: list[int] = []
    replan = relay_module.HeadRelay._replan

    def counted(relay: relay_module.HeadRelay) -> None:
        forced.append(1)
        replan(relay)

    monkeypatch.setattr(relay_module.HeadRelay, "_replan", counted)
    holder = watch(stream)
    assert isinstance(holder, RelayWatcher) and holder.holding
    readers = [follower(stream, ref=StreamRef.of(stream), branch="main", relay=True, poll_s=0.02, max_poll_s=0.5)
               for _ in range(4)]
    stop = threading.Event()
    pumps = [pump_steps(watcher, files, first=1, stride=1, end=10, follow=True, prefetch=3, timeout=60, poll_s=0.02,
                        max_poll_s=0.5, stop=stop, closers=[]) for watcher, files in readers]
    for pump in pumps:
        assert next(pump)[0] == 1
    started = len(forced)  # each reader's first head
    producer = stream.producer("prep-1")
    for step in range(2, 11):
        if step + 2 <= 10:
            assert producer.commit([shard(step + 2, r) for r in range(2)]).step == step + 2
        for pump in pumps:
            assert next(pump)[0] == step
    assert len(forced) == started
    for pump in pumps:
        pump.close()
    holder.close()


def test_a_stopped_holders_warning_names_its_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The relay client's error for a holder that does not answer named the holder's pid: with many processes on a
    host, the pid says which one to look at (a stopped, debugged or GIL-starved process). Its reader now reads
    directly; the warning saying so names the pid."""
    stream = make_stream(tmp_path, steps=1)
    holder = start_holder(tmp_path)
    try:
        client = watch(stream)
        assert isinstance(client, RelayWatcher)
        client.check()
        monkeypatch.setattr(relay_client, "IO_S", 0.5)
        holder.send_signal(signal.SIGSTOP)
        commit(stream, 2)
        with caplog.at_level(logging.WARNING, logger=relay_client.__name__):
            assert (client.wait(2, timeout=None, stop=threading.Event()) or (0,))[0] == 2
        (warned,) = fallback_warnings(caplog)
        assert "did not answer" in warned and f"pid {holder.pid}" in warned, warned
        client.close()
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait(timeout=60)



def test_a_step_the_readers_head_lists_is_read_after_a_rollback_below_it_by_a_new_holder(tmp_path: Path) -> None:
    """A reader has heard of head step 4 (not read step 3 yet) when another engine rolls main back to step 2 and, before
    anything is published again, the relay's holder stops (its rank finished, or was killed) and a new one is elected.
    A direct read of the reader's head reads step 3 as that head lists it; the new holder planned step 3 on its own
    head (step 2), since the reader's head descends from it, and answered StepNotPublishedError, which ends a follow:
    the client promises to plan "on this reader's head, as a direct read does" after a rollback."""
    stream = make_stream(tmp_path, steps=4)
    holder = watch(Stream.open(make_catalog(tmp_path), "ns.s"))
    reader = watch(Stream.open(make_catalog(tmp_path), "ns.s"))
    assert isinstance(holder, RelayWatcher) and holder.holding
    assert isinstance(reader, RelayWatcher) and not reader.holding
    reader.check()
    head, snapshot = reader.head()
    assert head == 4
    old = [f.file_path for f in stream.locate(3)]
    step_2 = next(s.snapshot_id for s in stream.refresh().table.metadata.snapshots
                  if s.summary is not None and s.summary.additional_properties.get("lakestream.step") == "2")
    stream.table.manage_snapshots().rollback_to_snapshot(step_2).commit()
    holder.close()  # the holder stops; the reader's next request elects a new one (here: the reader's process)
    try:
        direct = Stream.open(make_catalog(tmp_path), "ns.s")
        assert [f.file_path for f in direct.index.files(direct.table.metadata.snapshot_by_id(snapshot), 3)] == old
        assert [f.file_path for f in reader.files(snapshot, 3)] == old
    finally:
        reader.close()


def test_a_follower_reads_on_after_a_rollback_below_its_heard_head_when_another_reader_starts(tmp_path: Path) -> None:
    """The same rollback, with one holder throughout: another reader of the host starting an iteration (a rank
    restarting, the next epoch's DataLoader workers) asks the relay to ``check``, which plans later steps on the relay's
    head of now, rolled back; the first follower's next step then came back StepNotPublishedError."""
    stream = make_stream(tmp_path, steps=4)
    ds = LakestreamDataset(Stream.open(make_catalog(tmp_path), "ns.s"), rank=0, world_size=2, follow=True,
                           end_step=4, timeout=30, prefetch=0)
    it = iter(ds)
    assert [next(it)["step"], next(it)["step"]] == [1, 2]  # this reader serves the relay
    step_2 = next(s.snapshot_id for s in stream.refresh().table.metadata.snapshots
                  if s.summary is not None and s.summary.additional_properties.get("lakestream.step") == "2")
    stream.table.manage_snapshots().rollback_to_snapshot(step_2).commit()
    other = LakestreamDataset(Stream.open(make_catalog(tmp_path), "ns.s"), rank=1, world_size=2, follow=True,
                              end_step=1, timeout=30)
    assert [item["step"] for item in other] == [1]
    check_items(list(it), world=2, rank=0, steps=[3, 4])


def _holder_child(stream: Stream, paths: object) -> tuple[int, int]:
    """A forked child serving the relay at ``paths`` (its pid, and a pipe that ends when the child is gone)."""
    ready, told = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(ready)
            relay = relay_module.hold(stream, branch="main", paths=paths, poll_s=0.02, max_poll_s=0.5)  # type: ignore[arg-type]
            os.write(told, b"1" if relay is not None else b"0")
            signal.pause()
        finally:
            os._exit(1)
    os.close(told)
    assert os.read(ready, 1) == b"1"
    return pid, ready


def test_a_new_holder_removes_the_files_that_killed_holders_left(tmp_path: Path, relay_dir: Path) -> None:
    """A holder killed before it could stop (a DataLoader worker terminated when its training process exits, SIGKILL,
    out of memory) leaves its socket and lock file; no later holder of that relay comes where each job follows a new
    stream, so they gathered, two files per job. A new holder removes them, and leaves a live holder's alone."""
    from lakestream_iceberg.read.relay_wire import RelayPaths

    stream = make_stream(tmp_path, steps=1)
    live_paths = RelayPaths(relay_dir, "f" * 32)
    live, live_pipe = _holder_child(stream, live_paths)
    files: list[int] = []
    try:
        for i in range(1, 9):  # each "job": a holder of its own stream's relay, killed
            pid, pipe = _holder_child(stream, RelayPaths(relay_dir, f"{i:032x}"))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(pipe)
            reader = watch(stream)  # the next job's reader serves its own relay, then stops
            assert isinstance(reader, RelayWatcher) and reader.holding
            reader.close()
            if i in (4, 8):
                files.append(len([p for p in relay_dir.iterdir() if p.stem != live_paths.key]))
        # before, the killed holders' files stayed: 8 after four jobs, 16 after eight
        assert files[1] <= files[0] + 2 and files[0] <= 2, files
        assert live_paths.lock.exists() and live_paths.socket.exists()  # a live holder's files stay, and it answers
        client = RelayWatcher(stream, paths=live_paths, branch="main", poll_s=0.02, max_poll_s=0.5, elect=False)
        assert client.latest()[0] == 1
        client.close()
    finally:
        os.kill(live, signal.SIGKILL)
        os.waitpid(live, 0)
        os.close(live_pipe)
