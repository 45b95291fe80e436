"""A follow-mode iteration whose head relay fails goes on reading directly: every step once, in order, from where it was.

The relay is an optimisation (read/relay_client.py): a holder that never answers, one that breaks every connection, a
relay folder removed under its readers or a relay of another table at the socket ended the iteration (and the training
job) with a ReadError saying "pass relay=False". Real streams on the embedded SQLite catalog, real relay processes.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import StepCollectedError
from lakestream_iceberg.read import relay as relay_module
from lakestream_iceberg.read import relay_client
from lakestream_iceberg.read.relay_client import RelayWatcher
from tests.read.test_dataset import check_items, make_catalog, make_stream
from tests.read.test_relay import ROOT, commit, fallback_warnings, relay_dir, watch

pytest.importorskip("torch")
from lakestream_iceberg.read.dataset import LakestreamDataset  # noqa: E402

__all__ = ["relay_dir"]  # autouse: a relay directory of its own

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.read.test_dataset import make_catalog
    from lakestream_iceberg import Stream
    from lakestream_iceberg.read import relay
    from lakestream_iceberg.read.stream_ref import StreamRef
    from lakestream_iceberg.read.relay_client import follower
    {setup}
    stream = Stream.open(make_catalog(Path({tmp!r})), "ns.s")
    watcher, _ = follower(stream, ref=StreamRef.of(stream), branch="main", relay=True, poll_s=0.02, max_poll_s=0.5)
    print("holding" if watcher.holding else "client", flush=True)
    time.sleep(600)
""")


def start_holder(tmp_path: Path, setup: str = "") -> subprocess.Popen[str]:
    """Another process serving the relay of ``ns.s`` (``setup``: a line it runs first)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(ROOT), tmp=str(tmp_path), setup=setup)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "holding"  # EOF (a crash) reads "" and fails here, no hang
    return proc


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.send_signal(signal.SIGCONT)  # a stopped one too
        proc.kill()
        proc.wait(timeout=60)


def follow(tmp_path: Path, **kwargs: Any) -> LakestreamDataset:
    kwargs.setdefault("prefetch", 2)
    return LakestreamDataset(Stream.open(make_catalog(tmp_path), "ns.s"), rank=0, world_size=2, follow=True,
                             timeout=60, **kwargs)


def steps_of(items: list) -> list[int]:
    return [item["step"] for item in items]


def test_a_stopped_holder_leaves_the_iteration_reading_directly_from_where_it_was(
        tmp_path: Path, holders: list, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The holder stops (SIGSTOP: a process stuck in a slow catalog call or lookup answers no better) while a rank
    follows with steps prefetched through it: each step comes once, in order, prefetch on; the rank's saved position is
    the one a direct read saves (its next step and the data file naming its timeline), and resumes with relay=False."""
    stream = make_stream(tmp_path, steps=4)
    holder = start_holder(tmp_path)
    holders.append(holder)
    ds = follow(tmp_path, end_step=8)
    it = iter(ds)
    got = [next(it), next(it)]  # steps 3 and 4 are planned through the relay meanwhile (prefetch 2)
    monkeypatch.setattr(relay_client, "IO_S", 0.5)
    holder.send_signal(signal.SIGSTOP)
    commit(stream, 5)
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.read"):
        got += [next(it), next(it), next(it)]
        commit(stream, 6)  # published while the rank waits directly
        got.append(next(it))
        state = ds.state_dict()
        ds.close()
    check_items(got, world=2, rank=0, steps=[1, 2, 3, 4, 5, 6])
    assert state["next_step"] == 7
    (warned,) = fallback_warnings(caplog)
    assert "did not answer" in warned and f"pid {holder.pid}" in warned, warned
    commit(stream, 7)
    commit(stream, 8)
    resumed = LakestreamDataset(Stream.open(make_catalog(tmp_path), "ns.s"), rank=0, world_size=2, follow=True,
                                end_step=8, timeout=60, relay=False)
    resumed.load_state_dict(state)  # the data file it names is the step's, as a direct read planned it
    check_items(list(resumed), world=2, rank=0, steps=[7, 8])


def test_a_holder_breaking_every_connection_leaves_the_iteration_reading_directly(
        tmp_path: Path, holders: list, caplog: pytest.LogCaptureFixture) -> None:
    """A holder that answers ``hello`` and ``check`` but closes the connection at every other request (here: one
    that reads no request over 16 bytes): ATTEMPTS broken connections in a row ended the iteration."""
    make_stream(tmp_path, steps=6)
    holders.append(start_holder(tmp_path, setup="relay.MAX_REQUEST = 16"))
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.read"):
        items = list(follow(tmp_path, end_step=6))
    check_items(items, world=2, rank=0, steps=[1, 2, 3, 4, 5, 6])
    (warned,) = fallback_warnings(caplog)
    assert f"closed {relay_client.ATTEMPTS} connections in a row" in warned, warned


def test_a_relay_folder_removed_mid_iteration_leaves_it_reading_directly(
        tmp_path: Path, relay_dir: Path, holders: list, caplog: pytest.LogCaptureFixture) -> None:
    """The holder exits and the relay folder is gone (systemd removes $XDG_RUNTIME_DIR at logout): the rank cannot
    serve the relay itself (OSError making the lock file), which ended its iteration."""
    stream = make_stream(tmp_path, steps=2)
    holder = start_holder(tmp_path)
    holders.append(holder)
    it = iter(follow(tmp_path, end_step=5))
    got = [next(it), next(it)]  # up to the head: no request in flight while the holder goes
    holder.kill()
    holder.wait(timeout=60)
    shutil.rmtree(relay_dir)
    for step in (3, 4, 5):
        commit(stream, step)
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.read"):
        got.extend(it)
    check_items(got, world=2, rank=0, steps=[1, 2, 3, 4, 5])
    (warned,) = fallback_warnings(caplog)
    assert "cannot serve the head relay" in warned and str(relay_dir) in warned, warned


def test_a_relay_of_another_table_at_the_socket_is_never_used(
        tmp_path: Path, holders: list, caplog: pytest.LogCaptureFixture) -> None:
    """The rank's holder exits and, at its socket, a relay of another stream answers (here a link to it; another build
    or program at the path alike). Its answers are never used (the hello names its table); the rank reads directly,
    warning once with what it found there: a misconfiguration of the host's relay folder, which only costs catalog
    polls, not one a training job should end on."""
    stream = make_stream(tmp_path, steps=2)
    other = make_stream(tmp_path, world=1, steps=5, name="ns.other")
    holder = start_holder(tmp_path)
    holders.append(holder)
    it = iter(follow(tmp_path, end_step=4))
    got = [next(it), next(it)]  # up to the head: no request in flight while the socket is replaced
    foreign = watch(other)  # serves ns.other's relay from this process
    assert isinstance(foreign, RelayWatcher) and foreign.holding
    served = relay_module.held(foreign._paths)
    assert served is not None
    own_socket = foreign._paths.socket.parent / next(p.name for p in foreign._paths.socket.parent.glob("*.sock")
                                                     if p != foreign._paths.socket)
    holder.kill()  # killed: it leaves its socket, which is replaced by another table's relay
    holder.wait(timeout=60)
    own_socket.unlink()
    own_socket.symlink_to(foreign._paths.socket)
    commit(stream, 3)
    commit(stream, 4)
    try:
        with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.read"):
            got.extend(it)
        check_items(got, world=2, rank=0, steps=[1, 2, 3, 4])
        (warned,) = fallback_warnings(caplog)
        assert f"serves table '{other.table.metadata.table_uuid}'" in warned and str(own_socket) in warned, warned
        assert not served._plans  # no step of the other table was planned for this rank
    finally:
        foreign.close()


def test_a_holder_at_its_client_limit_leaves_its_own_ranks_iteration_reading_directly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """This rank serves the relay, which takes one client: its prefetch connection waits CONNECT_S for a place, then
    reads directly (before: a ReadError out of the prefetched step)."""
    make_stream(tmp_path, steps=4)
    monkeypatch.setattr(relay_module, "MAX_CLIENTS", 1)
    monkeypatch.setattr(relay_client, "CONNECT_S", 0.5)
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.read"):
        items = list(follow(tmp_path, end_step=4))
    check_items(items, world=2, rank=0, steps=[1, 2, 3, 4])
    (warned,) = fallback_warnings(caplog)
    assert "clients it takes" in warned, warned


def test_errors_of_the_stream_surface_as_before_once_reading_directly(
        tmp_path: Path, holders: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading directly after the relay failed, a collected step raises the direct read's StepCollectedError (not a
    relay error, and not skipped), after the steps before it."""
    stream = make_stream(tmp_path, steps=10)
    holder = start_holder(tmp_path)
    holders.append(holder)
    it = iter(follow(tmp_path, end_step=10, prefetch=0, collate=lambda item: item.step))
    assert next(it) == 1
    monkeypatch.setattr(relay_client, "IO_S", 0.5)
    holder.send_signal(signal.SIGSTOP)
    assert next(it) == 2  # read directly
    stream.checkpoint("late", step=6)
    Stream.open(stream.table.catalog, "ns.s").collect_garbage(dry_run=False, keep_last=1)  # collects steps 1..5
    with pytest.raises(StepCollectedError, match="step 3 "):
        next(it)


def test_a_reader_that_went_direct_and_a_waiting_thread_agree(tmp_path: Path, holders: list,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A prefetch thread finds the relay failed while the waiting thread is blocked on it: both go on directly, one
    warning, and the wait returns the step once it is published."""
    stream = make_stream(tmp_path, steps=1)
    holder = start_holder(tmp_path)
    holders.append(holder)
    client = watch(Stream.open(make_catalog(tmp_path), "ns.s"))
    assert isinstance(client, RelayWatcher)
    client.check()
    monkeypatch.setattr(relay_client, "IO_S", 0.5)
    holder.send_signal(signal.SIGSTOP)
    waited: list[object] = []
    waiter = threading.Thread(target=lambda: waited.append(client.wait(2, timeout=60, stop=threading.Event())))
    with caplog.at_level(logging.WARNING, logger="lakestream_iceberg.read"):
        waiter.start()
        try:  # the head heard from the relay names a snapshot by its id: looked up directly
            assert [f.file_path for f in client.files(client.head()[1], 1)] == [f.file_path for f in stream.locate(1)]
            assert client.direct
            commit(stream, 2)
        finally:
            waiter.join(timeout=60)
    assert len(waited) == 1 and waited[0] is not None and waited[0][0] == 2  # type: ignore[index]
    assert len(fallback_warnings(caplog)) == 1
    client.close()
