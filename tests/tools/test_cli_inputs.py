"""``lakestream`` commands given what they cannot use: steps no stream can hold or that GC collected, numbers out of
range, malformed stream names. Each is a one-line error naming the option (or argparse's usage, exit 2), never a
wait for a step that cannot come nor output that starts elsewhere than asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lakestream_iceberg import Stream
from lakestream_iceberg.tools.config import embedded_catalog
from tests.support import SCHEMA, batch

STREAM = "ns.inputs"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A stream of 4 steps whose steps below 3 GC collected (checkpoint at 3)."""
    stream = Stream.create(embedded_catalog(tmp_path), STREAM, schema=SCHEMA, world_size=1)
    producer = stream.producer("p")
    for seq in range(4):
        producer.commit(batch("p", seq, 1), seq=seq)
    stream.checkpoint("c3", step=3)
    assert stream.collect_garbage(dry_run=False).collected_below == {"main": 3}
    return tmp_path


def in_process(home: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``main()`` in this process: the exit code (argparse's 2 included), stdout and stderr."""
    from lakestream_iceberg.tools.cli import main

    capsys.readouterr()
    try:
        code = main(["--home", str(home), *args])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


@pytest.mark.parametrize("step", [str(2**63), str(10**21)])
def test_tail_refuses_a_step_no_stream_can_publish(home: Path, capsys: pytest.CaptureFixture[str], step: str) -> None:
    """A step is an Iceberg long: ``tail --from-step 2**63`` waited for it forever (reads refuse such a step)."""
    code, _, err = in_process(home, capsys, "tail", STREAM, "--from-step", step, "--timeout", "5")
    assert code == 2 and "--from-step" in err and str(2**63 - 1) in err, err


def test_tail_from_a_collected_step_says_where_it_starts(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``tail --from-step 1`` printed 'following ... from step 1' and then step 3: the steps GC collected were skipped
    without a word. The replay starts at the first kept step, and the line above it says so and why."""
    code, out, _ = in_process(home, capsys, "tail", STREAM, "--from-step", "1", "--max-steps", "2")
    header, *rows = out.strip().split("\nstep ")  # the header may be wrapped at the console's width
    assert code == 0 and " ".join(header.split()).startswith(
        f"following {STREAM} (branch main) from step 3 (steps below 3 are gone: collected by GC"), out
    assert [row.split()[0] for row in rows] == ["3", "4"], out
    code, out, _ = in_process(home, capsys, "tail", STREAM, "--from-step", "3", "--max-steps", "1")
    assert code == 0 and "from step 3; Ctrl-C" in out and "gone" not in out, out


@pytest.mark.parametrize("value", ["0", "-1"])
def test_gc_keep_last_below_one_names_the_option(home: Path, capsys: pytest.CaptureFixture[str], value: str) -> None:
    """``gc --keep-last 0`` said 'keep_last must be >= 1, got 0 (or None)': the Python argument, not the option."""
    code, _, err = in_process(home, capsys, "gc", STREAM, "--dry-run", "--keep-last", value)
    assert code == 2 and "--keep-last" in err and "None" not in err, err


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_lag_stale_after_is_a_count_of_report_intervals_not_seconds(home: Path, capsys: pytest.CaptureFixture[str],
                                                                   value: str) -> None:
    code, _, err = in_process(home, capsys, "lag", STREAM, "--stale-after", value)
    assert code == 2 and "--stale-after" in err and "report intervals" in err and "seconds" not in err, err


@pytest.mark.parametrize("name", [".x", "x.", ".", ""])
def test_a_stream_name_with_an_empty_part_says_so(home: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    """'x.' has a namespace, and the hint for '.x' was 'e.g. demo..x'."""
    code, _, err = in_process(home, capsys, "status", name)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "no empty part" in lines[0] and "demo." not in lines[0], err


def test_an_empty_catalog_suggests_the_demo_in_that_catalog(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """'no tables yet (try `lakestream demo`)': that demo makes its stream in the embedded default, not in the catalog
    (or home) the command was given, which stays empty."""
    from lakestream_iceberg.tools.cli import main

    monkeypatch.setenv("PYICEBERG_CATALOG__TEAM__URI", f"sqlite:///{tmp_path}/team.db")
    monkeypatch.setenv("PYICEBERG_CATALOG__TEAM__WAREHOUSE", str(tmp_path / "warehouse"))
    home = tmp_path / "a home"
    embedded_catalog(home)
    for args, hint in ((["--catalog", "team"], "`lakestream --catalog team demo`"),
                       (["--home", str(home)], f"`lakestream --home '{home}' demo`")):
        capsys.readouterr()
        assert main([*args, "status", "ns.x"]) == 1
        err = capsys.readouterr().err
        assert "no tables yet" in err and hint in err, err


def test_tail_whose_catalog_fails_until_its_timeout_is_an_error(home: Path) -> None:
    """``tail --timeout N`` retries a catalog it cannot poll (a restart), and when N ran out while every poll since
    failed it exited 0 as if the stream had been idle: a scheduled check passed with the catalog down."""
    import os
    import sqlite3
    import subprocess
    import sys

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "lakestream_iceberg", "--home", str(home), "tail", STREAM,
                             "--timeout", "10"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith(f"following {STREAM}")
        with sqlite3.connect(home / "catalog.db") as db:  # every poll fails from now on: no such table
            db.execute("ALTER TABLE iceberg_tables RENAME TO moved_away")
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert lines[-1].startswith("lakestream: error: tail: the catalog could not be polled"), err


def test_checkpoint_of_a_step_gc_collected_names_the_steps_left(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """'cannot checkpoint step 1: it was already collected by lifecycle GC' (said of a step before a fork too) did not
    name the steps that can be pinned."""
    code, _, err = in_process(home, capsys, "checkpoint", STREAM, "c1", "--step", "1")
    assert code == 1 and "the steps below 3 are gone" in err and "from 3 to 4" in err, err


def test_a_wrong_name_lists_the_streams_of_nested_namespaces(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The streams listed after 'no stream ...' were those of top-level namespaces only: a stream in team.vision was
    never named."""
    Stream.create(embedded_catalog(home), "team.vision.steps", schema=SCHEMA, world_size=1)
    code, _, err = in_process(home, capsys, "status", "team.steps")
    assert code == 1 and "tables there: " in err and "team.vision.steps" in err and STREAM in err, err


def test_repair_of_a_stream_nothing_was_published_to_has_nothing_to_repair(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A new stream's main has no Iceberg ref until its first step: ``status`` showed head step 0, ``repair`` failed
    with 'no branch main to repair; its branches: []'."""
    Stream.create(embedded_catalog(tmp_path), "ns.new", schema=SCHEMA, world_size=1)
    code, out, err = in_process(tmp_path, capsys, "repair", "ns.new", "--json")
    assert code == 0 and err == "", err
    assert json.loads(out) == {"branch": "main", "foreign": [], "rolled_back_to": None, "step": 0, "dry_run": False,
                               "rebased_on": None, "changes": [], "cleared": False}
    code, _, err = in_process(tmp_path, capsys, "repair", "ns.new", "--branch", "feat")
    assert code == 1 and "no branch 'feat'" in err, err


def test_status_of_a_new_stream_lists_main_among_its_branches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``status`` said 'branch main (branches: -)' before the first step, where every other command (and its errors:
    'Its branches are: main') counts main as a branch."""
    Stream.create(embedded_catalog(tmp_path), "ns.new", schema=SCHEMA, world_size=1)
    code, out, _ = in_process(tmp_path, capsys, "status", "ns.new", "--json")
    status = json.loads(out)
    assert code == 0 and (status["branch"], status["branches"], status["head_step"]) == ("main", ["main"], 0)


def test_repair_says_what_the_foreign_snapshots_it_rolls_back_did(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``repair`` of a foreign append printed only snapshot ids ('foreign snapshots 9015...', 'rolled back to 6624...'):
    an operator whose job appended rows learnt neither that nor that they left the branch. Each foreign snapshot is
    named with what it did (operation, Iceberg's counts), and the rollback says the changes leave the branch."""
    table = embedded_catalog(home).load_table(STREAM)
    table.append(table.scan(row_filter="_step == 4").to_arrow())
    rows = table.scan(row_filter="_step == 4").to_arrow().num_rows // 2
    code, out, err = in_process(home, capsys, "repair", STREAM, "--json", "--dry-run")
    report = json.loads(out)
    assert code == 0 and len(report["foreign"]) == 1, err
    assert report["changes"] == [f"append: added-data-files=1, added-records={rows}"], report
    code, out, _ = in_process(home, capsys, "repair", STREAM)
    flat = " ".join(out.split())
    assert code == 0 and f"append: added-data-files=1, added-records={rows}" in flat, out
    assert "left the branch" in flat, out


def test_gc_whose_sweep_is_refused_for_a_shared_folder_exits_1(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Another table keeping its metadata in the stream's own folder (a renamed table's folder taken by a new stream,
    a table created there by another engine): GC deletes nothing, and the warning alone let a scheduled ``lakestream
    gc`` exit 0 run after run while storage grew. It exits 1 naming the table."""
    catalog = embedded_catalog(home)
    stream = Stream.open(catalog, STREAM)
    catalog.create_table("ns.beside", schema=SCHEMA, location=stream.table.metadata.location)
    code, out, err = in_process(home, capsys, "gc", STREAM)
    assert code == 1 and "deletes no file: ns.beside of this catalog" in err and "Traceback" not in err, err
    code, out, err = in_process(home, capsys, "gc", STREAM, "--json")
    assert code == 1 and '"sweep_refused": "GC of' in out, out
