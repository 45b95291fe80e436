"""The ``lakestream`` CLI as a user runs it: a subprocess on a real SQLite catalog, ``--json`` output parsed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from catalog import services
from lakestream_iceberg import Stream, load_catalog
from lakestream_iceberg.tools.config import embedded_catalog
from tests.backends import moto_service
from tests.support import SCHEMA, batch, sqlite_catalog

pytest.importorskip("duckdb")

__all__ = ["moto_service"]  # fixture used by name

WORLD = 2
STREAM = "ns.cli"
SCRIPT = shutil.which("lakestream", path=str(Path(sys.executable).parent))


def _command() -> list[str]:
    return [SCRIPT] if SCRIPT else [sys.executable, "-m", "lakestream_iceberg.tools.cli"]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded catalog in a temp dir, holding ns.cli with 6 steps from two producers."""
    root = tmp_path_factory.mktemp("lakestream-home")
    stream = Stream.create(embedded_catalog(root), STREAM, schema=SCHEMA, world_size=WORLD)
    producers = [stream.producer("prep-0"), stream.producer("prep-1")]
    for seq in range(3):
        for producer in producers:
            producer.commit(batch(producer.producer_id, seq, WORLD), seq=seq)
    return root


@pytest.fixture(scope="module")
def env(home: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """No ~/.pyiceberg.yaml, no developer PYICEBERG_* variables; the embedded catalog is ``home``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYICEBERG_", "LAKESTREAM_"))}
    clean.update(PYICEBERG_HOME=str(tmp_path_factory.mktemp("pyiceberg-home")), LAKESTREAM_HOME=str(home),
                 COLUMNS="160", PYTHONWARNINGS="ignore")
    return clean


def run(env: dict[str, str], *args: str, ok: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*_command(), *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def run_many(env: dict[str, str], *commands: tuple[str, ...], timeout: float = 90) -> list[subprocess.CompletedProcess[str]]:
    """Independent read-only commands, two at a time (each is mostly interpreter start-up)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(run, env, *c, ok=False, timeout=timeout) for c in commands]
        return [f.result() for f in futures]


def main_inprocess(home: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Variations of a command already covered as a subprocess run in-process (interpreter start-up is the cost)."""
    from lakestream_iceberg.tools.cli import main

    capsys.readouterr()
    code = main(["--home", str(home), *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def run_json(env: dict[str, str], *args: str):
    return json.loads(run(env, *args).stdout)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lakestream: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0]


def test_entry_point_is_installed() -> None:
    assert SCRIPT, "the lakestream console script is missing: run .venv/bin/pip install -e ."


def test_status_json_and_human(env: dict[str, str], home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = run_json(env, "status", STREAM, "--json")
    assert status["stream"] == STREAM and status["head_step"] == 6 and status["world_size"] == WORLD
    assert status["layout"] == "per-rank"
    assert status["staged_batches"] == 0
    assert [(p["producer"], p["last_seq"], p["lag"]) for p in status["producers"]] == [("prep-0", 2, 1), ("prep-1", 2, 0)]
    assert status["storage"]["data_files"] == 6 * WORLD and status["storage"]["bytes"] > 0
    assert status["metadata_bytes"] > 0 and status["snapshots_retained"] >= 1
    code, out, _ = main_inprocess(home, capsys, "status", STREAM)
    assert code == 0 and "head step" in out and "prep-1" in out


def test_status_shows_the_producers_committing_now_among_thousands(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """More producer ids than the human table shows (MAX_HUMAN_ROWS): the table lists the most recent first, and says
    how many there are. By id it listed 50 retired ones (a-*) and none of those committing now (z-*)."""
    from lakestream_iceberg.tools.output import MAX_HUMAN_ROWS

    stream = Stream.create(embedded_catalog(tmp_path), STREAM, schema=SCHEMA, world_size=WORLD)
    retired = [f"a-{i:03d}" for i in range(MAX_HUMAN_ROWS + 5)]
    for pid in [*retired, "z-0", "z-1"]:
        stream.producer(pid).commit(batch(pid, 0, WORLD), seq=0)
    code, out, _ = main_inprocess(tmp_path, capsys, "status", STREAM)
    assert code == 0
    shown = re.findall(r"\b[az]-\d+\b", out)
    assert shown[:2] == ["z-1", "z-0"] and len(shown) == MAX_HUMAN_ROWS, shown
    assert f"producers ({len(retired) + 2:,}, " in out
    code, out, _ = main_inprocess(tmp_path, capsys, "status", STREAM, "--json")
    assert [p["producer"] for p in json.loads(out)["producers"]] == sorted([*retired, "z-0", "z-1"])  # every one, by id


def test_checkpoints_shows_the_newest_among_hundreds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """More checkpoints than the human table shows (MAX_HUMAN_ROWS): the newest first, the count in the title. In the
    listing's order (the oldest first) the table showed the first 50 and none of those a trainer resumes from."""
    from lakestream_iceberg.tools.output import MAX_HUMAN_ROWS

    stream = Stream.create(embedded_catalog(tmp_path), STREAM, schema=SCHEMA, world_size=WORLD)
    producer = stream.producer("p")
    count = MAX_HUMAN_ROWS + 5
    for seq in range(count):
        producer.commit(batch("p", seq, WORLD), seq=seq)
        stream.checkpoint(f"ck-{seq + 1:03d}", step=seq + 1)
    code, out, _ = main_inprocess(tmp_path, capsys, "checkpoints", STREAM)
    assert code == 0
    shown = re.findall(r"\bck-\d+\b", out)
    assert shown[:2] == [f"ck-{count:03d}", f"ck-{count - 1:03d}"] and len(shown) == MAX_HUMAN_ROWS, shown
    assert f"({count:,}; the newest first)" in out
    code, out, _ = main_inprocess(tmp_path, capsys, "checkpoints", STREAM, "--json")
    assert [c["name"] for c in json.loads(out)] == [f"ck-{i + 1:03d}" for i in range(count)]  # every one, as listed


def test_status_lists_every_declared_table_property(env: dict[str, str], home: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``lakestream status`` lists the properties of format/properties.py, in order, with the table's value, or the
    declared default where the table does not set it."""
    from lakestream_iceberg.format.properties import PROPERTIES

    code, out, _ = main_inprocess(home, capsys, "status", STREAM, "--json")
    rows = {p["property"]: p for p in json.loads(out)["properties"]}
    assert code == 0 and list(rows) == [p.key for p in PROPERTIES]
    assert rows["lakestream.world-size"] | {"default": None} == {
        "property": "lakestream.world-size", "value": str(WORLD), "set": True, "unit": "ranks", "default": None,
        "live": "no, fixed when the stream is created", "live_short": "no"}
    codec = rows["write.parquet.compression-codec"]
    assert not codec["set"] and codec["value"] == "zstd" and codec["default"] == "zstd (Iceberg's)"
    assert rows["lakestream.snapshots.retain-last"]["live"] == "yes, from the next commit"
    assert rows["lakestream.arrow-schema"]["set"] and "chars)" in rows["lakestream.arrow-schema"]["value"]
    human = run(env, "status", STREAM).stdout  # COLUMNS=160: each property on one line with its value
    for key, found in rows.items():
        shown = found["value"] if found["set"] else f"({found['value']})"
        assert re.search(rf"{re.escape(key)}\s.*{re.escape(shown)}", human), (key, shown)


def test_sql_json_as_written_in_the_issue(env: dict[str, str], home: Path, tmp_path: Path) -> None:
    assert run_json(env, "sql", STREAM, "SELECT count(*) FROM batches", "--json") == [{"count_star()": 6}]
    assert run_json(env, "--json", "sql", STREAM, "SELECT producer, count(*) AS n FROM batches GROUP BY 1 ORDER BY 1") == [
        {"producer": "prep-0", "n": 3}, {"producer": "prep-1", "n": 3}]
    # --catalog NAME from $PYICEBERG_HOME/.pyiceberg.yaml (a second catalog on the same SQLite file).
    yaml_home = tmp_path / "yaml-home"
    yaml_home.mkdir()
    (yaml_home / ".pyiceberg.yaml").write_text(
        f"catalog:\n  team:\n    type: sql\n    uri: sqlite:///{home}/catalog.db\n    warehouse: file://{home}/warehouse\n")
    team = Stream.create(sqlite_catalog(str(home), name="team"), "ns.team", schema=SCHEMA, world_size=WORLD)
    team.producer("p").commit(batch("p", 0, WORLD))
    named = {**env, "PYICEBERG_HOME": str(yaml_home)}
    assert run_json(named, "--catalog", "team", "sql", "ns.team", "SELECT count(*) FROM batches", "--json") == [
        {"count_star()": 1}]


def test_sql_human_table_and_samples_range(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = main_inprocess(home, capsys, "sql", STREAM, "SELECT step, producer, seq FROM batches ORDER BY step")
    assert code == 0 and "prep-0" in out and "step" in out
    code, out, _ = main_inprocess(home, capsys, "sql", STREAM, "SELECT DISTINCT _step FROM samples ORDER BY 1",
                                  "--steps", "2:3", "--json")
    rows = json.loads(out)
    assert [r["_step"] for r in rows] in ([2, 3], [2], [3])  # a step may hold only empty shards


def test_sql_json_keeps_every_column_of_a_join(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two columns of one name (a join's ``step``, ``producer``, ...) were one JSON key: the first one's values were
    lost without a word. They are named as DuckDB's own JSON export (``COPY ... (FORMAT json)``) names them."""
    code, out, _ = main_inprocess(home, capsys, "sql", STREAM, "SELECT 1 AS a, 2 AS a, 3 AS a_1, 4 AS a", "--json")
    assert code == 0 and json.loads(out) == [{"a": 1, "a_1": 2, "a_1_1": 3, "a_2": 4}]  # as COPY ... (FORMAT json)
    code, out, _ = main_inprocess(home, capsys, "sql", STREAM, "SELECT * FROM batches b JOIN files f ON b.step = f.step "
                                  "AND f.rank = 0 ORDER BY b.step LIMIT 1", "--json")
    (row,) = json.loads(out)
    assert code == 0 and row["step"] == row["step_1"] == 1 and "rank" in row


def test_sql_reads_the_consumer_positions_only_for_a_query_that_names_them(
        home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``lakestream sql`` built every view before running the query, the ``consumers`` view too: every recorded
    position of every group (kept 7 days), each parsed and checked, one GET per rank where positions are objects. With
    20,000 ranks of 3 groups recorded, ``SELECT count(*) FROM batches`` on 1,000 steps took 5 s instead of 0.15 s. The
    positions are read, as the samples are, when the query names the view."""
    from lakestream_iceberg.connect.positions import PositionStore

    listings: list[object] = []
    rows = PositionStore.rows
    monkeypatch.setattr(PositionStore, "rows", lambda self, **k: listings.append(k) or rows(self, **k))
    code, out, _ = main_inprocess(home, capsys, "sql", STREAM, "SELECT count(*) AS n FROM batches", "--json")
    assert (code, json.loads(out), listings) == (0, [{"n": 6}], [])
    code, out, _ = main_inprocess(home, capsys, "sql", STREAM, "SELECT count(*) AS n FROM consumers", "--json")
    assert (code, json.loads(out), len(listings)) == (0, [{"n": 0}], 1)
    code, out, _ = main_inprocess(home, capsys, "sql", STREAM, "SELECT (SELECT count(*) FROM consumers) AS c, "
                                  "(SELECT count(*) FROM samples) > 0 AS s", "--json")
    assert (code, json.loads(out)) == (0, [{"c": 0, "s": True}])
    code, _, err = main_inprocess(home, capsys, "sql", STREAM, "SELECT * FROM consumer", "--json")  # a typo: one error
    assert code == 1 and "consumer" in err and len(err.strip().splitlines()) == 1, err


def test_user_mistakes_are_one_line(env: dict[str, str], home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad_sql, missing, no_catalog = run_many(
        env, ("sql", STREAM, "SELEC nonsense"), ("status", "ns.missing"), ("--catalog", "nowhere", "status", STREAM))
    assert_one_line_error(bad_sql, "SQL error")
    assert_one_line_error(missing, "no stream 'ns.missing'", STREAM)
    assert_one_line_error(no_catalog, "nowhere", "PYICEBERG_CATALOG__NOWHERE__URI")
    for args, needle in [
        (("sql", STREAM, "SELECT nope FROM batches", "--json"), "nope"),
        (("status", "nonamespace"), "NAMESPACE.NAME"),
        (("sql", STREAM, "SELECT 1", "--steps", "x:y"), "--steps"),
        (("checkpoint", STREAM, "bad name!", "--step", "1"), "invalid"),
    ]:
        code, out, err = main_inprocess(home, capsys, *args)
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith("lakestream: error: ") and needle in lines[0], err
    with pytest.raises(SystemExit) as exit_info:
        main_inprocess(home, capsys, "frobnicate")
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_sql_as_a_table_does_not_fetch_the_rows_it_does_not_show(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A table shows 50 rows, but every row was fetched into Python first: 3 GB and 12 s for 10 million rows."""
    import tracemalloc

    tracemalloc.start()
    try:
        code, out, _ = main_inprocess(home, capsys, "sql", STREAM, "SELECT range AS n FROM range(1000000)")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 0 and "50 shown" in out, out
    assert peak < 40e6, f"{peak / 1e6:.0f} MB of Python objects to print 50 rows"


def test_checkpoint_checkpoints_and_gc(env: dict[str, str], home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    created = run_json(env, "checkpoint", STREAM, "ck3", "--step", "3", "--json")
    assert (created["name"], created["step"], created["branch"]) == ("ck3", 3, "main")
    listed = run_json(env, "checkpoints", STREAM, "--json")
    assert [(c["name"], c["step"]) for c in listed] == [("ck3", 3)]
    code, out, _ = main_inprocess(home, capsys, "checkpoints", STREAM)
    assert code == 0 and "ck3" in out
    code, _, err = main_inprocess(home, capsys, "checkpoint", STREAM, "ck3", "--step", "4")
    assert code == 1 and "ck3" in err and len(err.strip().splitlines()) == 1
    code, out, _ = main_inprocess(home, capsys, "status", STREAM, "--json")
    assert json.loads(out)["consumer_lag"] == 3

    plan = run_json(env, "gc", STREAM, "--dry-run", "--json")
    assert plan["dry_run"] is True and plan["collected_below"] == {"main": 3}
    code, out, _ = main_inprocess(home, capsys, "sql", STREAM, "SELECT min(step) AS s FROM files", "--json")
    assert json.loads(out) == [{"s": 1}]  # the dry run deleted nothing
    code, out, _ = main_inprocess(home, capsys, "gc", STREAM, "--dry-run")
    assert code == 0 and "dry run" in out
    done = run_json(env, "gc", STREAM, "--keep-last", "1", "--json")
    assert done["dry_run"] is False and done["collected_below"] == {"main": 3}
    code, out, _ = main_inprocess(home, capsys, "sql", STREAM, "SELECT min(step) AS s FROM files", "--json")
    assert json.loads(out) == [{"s": 3}]


def test_tail_follows_new_steps(env: dict[str, str], home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    replay = [json.loads(line) for line in run(env, "tail", STREAM, "--from-step", "5", "--max-steps", "2", "--json",
                                               "--timeout", "30").stdout.splitlines()]
    assert [r["step"] for r in replay] == [5, 6] and all(r["producer"] for r in replay)

    stream = Stream.open(embedded_catalog(home), STREAM)
    proc = subprocess.Popen([*_command(), "tail", STREAM, "--from-step", "7", "--max-steps", "2", "--timeout", "40",
                             "--json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        producer = stream.producer("prep-0")
        for _ in range(2):
            producer.commit(batch("prep-0", producer.next_seq, WORLD))
        stdout, stderr = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    live = [json.loads(line) for line in stdout.splitlines()]
    assert [(r["step"], r["producer"], r["seq"]) for r in live] == [(7, "prep-0", 3), (8, "prep-0", 4)]
    assert all(r["samples"] == sum(r["samples_per_rank"]) for r in live)

    code, out, _ = main_inprocess(home, capsys, "tail", STREAM, "--timeout", "0.5")  # nothing new: stops at the timeout
    lines = out.strip().splitlines()
    assert code == 0 and len(lines) == 1 and lines[0].startswith("following ns.cli")
    code, out, _ = main_inprocess(home, capsys, "tail", STREAM, "--from-step", "7", "--max-steps", "1")
    assert code == 0 and "prep-0 seq 3" in out


def test_piped_output_keeps_each_line_whole_at_80_columns(env: dict[str, str], home: Path) -> None:
    """Piped (``lakestream tail S | grep prep-1``, ``> log``), rich writes 80 columns: each step of ``tail`` was cut in
    two (its timestamp on a line of its own), and ``status`` cut the stream's location with an ellipsis."""
    narrow = {**env, "COLUMNS": "80"}
    out = run(narrow, "tail", STREAM, "--from-step", "1", "--max-steps", "2", "--timeout", "30").stdout.splitlines()
    # (earlier tests of this module may have collected the first steps: tail starts at the first kept one)
    assert len(out) == 3 and out[0].startswith("following ns.cli") and out[0].endswith("Ctrl-C to stop"), out
    assert all(re.match(r"step +\d+ +prep-\d seq \d+ .*  attempts \S+  (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\+00:00|-)$",
                        line) for line in out[1:]), out
    status = run(narrow, "status", STREAM).stdout
    location = json.loads(run(narrow, "status", STREAM, "--json").stdout)["location"]
    assert len(location) > 60 and "\u2026" not in status
    assert location in "".join(line.strip() for line in status.splitlines() if not line.startswith(("stream", "world"))), status
    lag = run(narrow, "lag", STREAM, "--group", "nobody-" + "x" * 40).stdout.splitlines()
    assert len(lag) == 1 and lag[0].startswith("no recorded positions"), lag


@pytest.mark.parametrize("args", [("status", STREAM), ("tail", STREAM, "--from-step", "1", "--max-steps", "2"),
                                  ("sql", STREAM, "SELECT * FROM batches", "--json")])
def test_a_reader_of_stdout_that_went_away_is_no_error(env: dict[str, str], args: tuple[str, ...]) -> None:
    """``lakestream status | head -1``: rich exited 1 without a word when the pipe closed (JSON output exited 0)."""
    proc = subprocess.Popen([*_command(), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first line: every write meets a closed pipe
    try:
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 0 and err == "", err
    finally:
        if proc.poll() is None:
            proc.kill()


# ----------------------------------------------------------------------------- arguments checked before anything runs
def in_process(home: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``main()`` in this process (no interpreter start-up): the exit code and stderr."""
    from lakestream_iceberg.tools.cli import main

    capsys.readouterr()
    try:
        code = main(["--home", str(home), *args])
    except SystemExit as exc:  # argparse refuses a malformed option: usage + exit 2
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", [["status", STREAM], ["sql", STREAM, "SELECT count(*) FROM batches"],
                                     ["tail", STREAM, "--timeout", "0.1"]])
def test_a_branch_the_stream_does_not_have_is_an_error_not_an_empty_stream(home: Path, capsys: pytest.CaptureFixture[str],
                                                                          command: list[str]) -> None:
    code, err = in_process(home, capsys, *command, "--branch", "mian")  # showed head step 0 / empty views, exit 0
    assert code == 1 and "no branch 'mian'" in err and "Traceback" not in err


@pytest.mark.parametrize("option", [["--max-steps", "0"], ["--max-steps", "-1"], ["--from-step", "0"],
                                    ["--from-step", "x"], ["--poll", "-1"], ["--poll", "nan"], ["--timeout", "-5"],
                                    ["--timeout", "nan"], ["--timeout", "inf"]])
def test_tail_refuses_numbers_it_cannot_use(home: Path, capsys: pytest.CaptureFixture[str], option: list[str]) -> None:
    code, err = in_process(home, capsys, "tail", STREAM, "--timeout", "0.1", *option)  # --timeout nan waited forever
    assert code == 2 and option[0] in err


@pytest.mark.parametrize("steps", ["5:1", "0", "-5:3", "0:2"])
def test_sql_refuses_a_step_range_that_is_not_one(home: Path, capsys: pytest.CaptureFixture[str], steps: str) -> None:
    code, err = in_process(home, capsys, "sql", STREAM, "SELECT count(*) FROM samples", f"--steps={steps}")
    assert code == 1 and "--steps" in err  # an empty or silently clipped samples view, exit 0


def test_a_file_that_is_not_a_catalog_database_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "catalog.db").write_bytes(b"this is not a sqlite database" * 10)
    code, err = in_process(tmp_path, capsys, "status", "ns.x")  # a raw sqlalchemy DatabaseError
    assert code == 1 and err.startswith("lakestream: error: the embedded catalog") and "move it aside" in err


@pytest.mark.parametrize("name", ["with space", "\u00fcn\u00ef", "q?x=1", "h#x", "p%41"])
def test_the_embedded_catalog_keeps_everything_in_its_home_whatever_the_path_holds(tmp_path: Path, name: str,
                                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The warehouse was the home's file URI, which pyiceberg never decodes: a space or a non-ASCII letter put the data
    in a sibling folder named with %20; a ? or # in the SQLite URL put the database elsewhere; a %41 opened none."""
    home = tmp_path / name
    stream = Stream.create(embedded_catalog(home), "ns.q", schema=SCHEMA, world_size=1)
    stream.producer("p").commit([batch("p", 0, 1)[0]], seq=0)
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert (home / "catalog.db").is_file() and any((home / "warehouse" / "ns" / "q" / "data").rglob("*.parquet"))
    code, out, _ = main_inprocess(home, capsys, "status", "ns.q", "--json")
    assert code == 0 and json.loads(out)["head_step"] == 1


@pytest.mark.parametrize("option", [["--catalog", ""], ["--catalog", "  "], ["--home", ""]])
def test_an_empty_catalog_or_home_is_an_error_not_the_embedded_default(home: Path, capsys: pytest.CaptureFixture[str],
                                                                         option: list[str]) -> None:
    """``--catalog "$CATALOG"`` with the variable unset selected the embedded catalog and showed another lake."""
    from lakestream_iceberg.tools.cli import main

    capsys.readouterr()
    code = main(["status", STREAM, *option])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("lakestream: error:") and option[0] in err and "Traceback" not in err


def test_a_stream_name_with_an_empty_part_is_a_one_line_error(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = in_process(home, capsys, "status", "a..b")
    assert code == 1 and err.startswith("lakestream: error:") and "namespace.name" in err


@pytest.mark.parametrize(("uri", "shown"), [("http://127.0.0.1:1", "REST catalog http://127.0.0.1:1"),
                                            ("postgresql+psycopg2://lake:sekret@127.0.0.1:1/cat", "127.0.0.1:1"),
                                            ("postgresql+psycopg2://lake:sek/ret@127.0.0.1:1/cat", "lake:****@127.0.0.1:1")])
def test_an_unreachable_catalog_is_named_by_its_uri_and_never_shows_a_password(env: dict[str, str], uri: str,
                                                                               shown: str) -> None:
    """The uri comes from pyiceberg's config (here PYICEBERG_CATALOG__PROD__URI), not from the command line: the
    message said 'cannot connect to the REST catalog the REST catalog' instead of naming it."""
    proc = run({**env, "PYICEBERG_CATALOG__PROD__URI": uri}, "--catalog", "prod", "status", STREAM, ok=False)
    assert proc.returncode == 1 and shown in proc.stderr, proc.stderr
    assert "sekret" not in proc.stderr and "sek/ret" not in proc.stderr, proc.stderr  # SQLAlchemy allows "/" in it


@pytest.mark.parametrize(("yaml", "needles"), [
    ("catalog: oops\n", ("could not load catalog 'prod'", "needs to be an object")),
    ("catalog:\n  prod: oops\n", ("could not load catalog 'prod'", "needs to be an object")),
    # pyiceberg parses the file when it is imported, before the command line runs: strictyaml's traceback
    ("catalog:\n  prod:\n    uri: sqlite:///x.db\n   warehouse: [x\n", (".pyiceberg.yaml cannot be read", "line 4, column 4")),
    ('catalog: {prod: {uri: "sqlite:///x.db"}}\n', (".pyiceberg.yaml cannot be read", "flow mapping")),
    (b"catalog:\n  prod:\n    uri: caf\xe9\n", (".pyiceberg.yaml cannot be read", "utf-8")),
    # pyiceberg's import raised AttributeError ("'str' object has no attribute 'items'") for a file of no mapping
    ("", (".pyiceberg.yaml holds no settings", "empty or holds comments only")),  # `touch .pyiceberg.yaml`
    ("# catalog:\n#   prod:\n", (".pyiceberg.yaml holds no settings", "empty or holds comments only")),
    ("- catalog\n", (".pyiceberg.yaml holds a list where a mapping of settings belongs",)),
])
def test_a_malformed_catalog_configuration_is_a_one_line_error(env: dict[str, str], tmp_path: Path, yaml: str | bytes,
                                                               needles: tuple[str, ...]) -> None:
    """pyiceberg's ValueError for a catalog entry that is not a mapping was raised again while the error message was
    being made (reading the configuration to redact it): a traceback."""
    path = tmp_path / ".pyiceberg.yaml"
    path.write_bytes(yaml if isinstance(yaml, bytes) else yaml.encode())
    proc = run({**env, "PYICEBERG_HOME": str(tmp_path)}, "--catalog", "prod", "status", STREAM, ok=False)
    assert_one_line_error(proc, *needles)
    if "cannot be read" in needles[0] or "holds" in needles[0]:  # a library import gets the same error, from the
        # project's hierarchy
        imported = subprocess.run([sys.executable, "-c", "import lakestream_iceberg"], capture_output=True, text=True,
                                  env={**env, "PYICEBERG_HOME": str(tmp_path)}, timeout=120)
        assert imported.returncode == 1 and imported.stderr.strip().splitlines()[-1].startswith(
            f"lakestream_iceberg.errors.ConfigError: {path} {needles[0].split('.pyiceberg.yaml ')[1]}"), imported.stderr


@pytest.mark.parametrize("yaml", ["catalog: oops\n", "catalog:\n  prod: oops\n", "catalog:\n  - prod\n"])
def test_a_catalog_entry_that_is_no_mapping_with_its_variable_set_is_a_one_line_error(
        env: dict[str, str], tmp_path: Path, yaml: str) -> None:
    """"could not load catalog 'prod'" advises PYICEBERG_CATALOG__PROD__URI; with that variable set, pyiceberg's import
    failed merging it into the file's text or list (a ValueError "Incompatible configurations, merging dict with a
    value"): a traceback from the command line and from ``import lakestream_iceberg``, before any project code ran."""
    (tmp_path / ".pyiceberg.yaml").write_text(yaml)
    broken = {**env, "PYICEBERG_HOME": str(tmp_path), "PYICEBERG_CATALOG__PROD__URI": "sqlite:///x.db"}
    proc = run(broken, "--catalog", "prod", "status", STREAM, ok=False)
    assert_one_line_error(proc, ".pyiceberg.yaml", "PYICEBERG_CATALOG__PROD__URI", "catalog:")
    imported = subprocess.run([sys.executable, "-c", "import lakestream_iceberg"], capture_output=True, text=True,
                              env=broken, timeout=120)
    assert imported.returncode == 1 and imported.stderr.strip().splitlines()[-1].startswith(
        "lakestream_iceberg.errors.ConfigError: "), imported.stderr


def test_a_catalog_not_configured_says_what_to_set_and_how_to_do_without(env: dict[str, str]) -> None:
    """load_catalog now raises its own ConfigError for a catalog not configured (it raised pyiceberg's ValueError);
    the command line keeps its advice, which passes no settings to load_catalog."""
    proc = run(env, "--catalog", "prod", "status", STREAM, ok=False)
    assert_one_line_error(proc, "could not load catalog 'prod': URI missing", "PYICEBERG_CATALOG__PROD__URI",
                          "drop --catalog to use the embedded default")
    assert "load_catalog" not in proc.stderr


def test_a_file_the_storage_lost_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A storage failure (here: files deleted behind the catalog's back; an unreachable endpoint raises the same
    OSError) was a pyarrow traceback."""
    stream = Stream.create(embedded_catalog(tmp_path), "ns.lost", schema=SCHEMA, world_size=1)
    stream.producer("p").commit([batch("p", 0, 1)[0]], seq=0)
    Stream.create(embedded_catalog(tmp_path), "ns.gone", schema=SCHEMA, world_size=1)
    shutil.rmtree(tmp_path / "warehouse" / "ns" / "lost" / "data")
    shutil.rmtree(tmp_path / "warehouse" / "ns" / "gone" / "metadata")
    for args, start, needle in [
        (("sql", "ns.lost", "SELECT count(*) FROM samples"), "lakestream: error: a file that the stream's current head "
         "lists is missing from storage", "/data/p/"),  # MissingFileError: says what to do
        (("status", "ns.gone"), "lakestream: error: FileNotFoundError", ".metadata.json"),
    ]:
        code, err = in_process(tmp_path, capsys, *args)
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith(start), err
        assert needle in lines[0]


def test_gc_has_no_branch_to_ignore_and_checkpoints_lists_the_branch_asked(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """GC is table-wide: ``gc --branch feat`` accepted the branch, ignored it and collected main's steps too; and
    ``checkpoints --branch feat`` listed main's. ``--keep-last`` said "keep the newest K steps": it keeps K
    checkpoints and releases the others."""
    from lakestream_iceberg.tools.cli import main

    stream = Stream.create(embedded_catalog(tmp_path), "ns.br", schema=SCHEMA, world_size=1)
    producer = stream.producer("p")
    for seq in range(3):
        producer.commit(batch("p", seq, 1), seq=seq)
    stream.checkpoint("c2", step=2)
    stream.fork("c2", branch="feat")
    stream.checkpoint("f2", step=2, branch="feat")
    code, err = in_process(tmp_path, capsys, "gc", "ns.br", "--branch", "feat", "--dry-run")
    assert code == 2 and "--branch" in err
    code, out, _ = main_inprocess(tmp_path, capsys, "checkpoints", "ns.br", "--branch", "feat", "--json")
    assert code == 0 and [(c["name"], c["branch"]) for c in json.loads(out)] == [("f2", "feat")]
    code, out, _ = main_inprocess(tmp_path, capsys, "checkpoints", "ns.br", "--json")
    assert code == 0 and sorted(c["name"] for c in json.loads(out)) == ["c2", "f2"]
    with pytest.raises(SystemExit):
        main(["gc", "--help"])
    gc_help = " ".join(capsys.readouterr().out.split())
    assert "--keep-last K retain the newest K checkpoints of each branch and release the others" in gc_help


def test_a_misspelt_home_makes_no_catalog_there(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`lakestream status demo.x --home /data/lakestrem` made /data/lakestrem/catalog.db and its warehouse, and said
    the (new, empty) catalog had no tables; only `lakestream demo` makes a home."""
    from lakestream_iceberg.tools.cli import main

    missing = tmp_path / "typo" / "home"
    for args in (["status", STREAM], ["checkpoints", STREAM], ["lag", STREAM], ["gc", STREAM, "--dry-run"]):
        capsys.readouterr()
        assert main(["--home", str(missing), *args]) == 1
        err = capsys.readouterr().err
        assert err.startswith("lakestream: error: no lakestream home at") and "--home" in err, err
    assert not (tmp_path / "typo").exists()


def test_gc_keep_within_retains_the_young_checkpoints_keep_last_would_release(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The API's keep_within had no CLI option: ``lakestream gc`` could only keep the newest K checkpoints, or all."""
    stream = Stream.create(embedded_catalog(tmp_path), "ns.kw", schema=SCHEMA, world_size=1)
    producer = stream.producer("p")
    for seq in range(4):
        producer.commit(batch("p", seq, 1), seq=seq)
    stream.checkpoint("c2", step=2)
    stream.checkpoint("c3", step=3)
    code, out, _ = main_inprocess(tmp_path, capsys, "gc", "ns.kw", "--keep-last", "1", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["released_checkpoints"] == ["c2"]
    code, out, _ = main_inprocess(tmp_path, capsys, "gc", "ns.kw", "--keep-last", "1", "--keep-within", "1h",
                                  "--dry-run", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["released_checkpoints"] == [] and plan["collected_below"] == {"main": 2}
    code, out, _ = main_inprocess(tmp_path, capsys, "gc", "ns.kw", "--keep-within", "2w", "--json")
    assert code == 0 and json.loads(out)["collected_below"] == {"main": 2}
    assert [c.name for c in stream.refresh().checkpoints()] == ["c2", "c3"]
    for bad in ("0d", "7", "1.5h", "-3h", "7x", "1e3s"):
        code, err = in_process(tmp_path, capsys, "gc", "ns.kw", f"--keep-within={bad}", "--dry-run")
        assert code == 2 and "--keep-within" in err and "not an age" in err, (bad, err)


def test_gc_keep_within_past_what_python_holds_is_a_usage_error(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--keep-within 999999999w`` (past timedelta's 999,999,999 days) raised a raw OverflowError traceback, and
    ``1000000000s`` (ten digits, about 32 years) was called 'not an age'."""
    stream = Stream.create(embedded_catalog(tmp_path), "ns.kwo", schema=SCHEMA, world_size=1)
    stream.producer("p").commit(batch("p", 0, 1), seq=0)
    for big in ("999999999w", "9999999999d", "999999999999999999s"):
        code, err = in_process(tmp_path, capsys, "gc", "ns.kwo", f"--keep-within={big}", "--dry-run")
        assert code == 2 and "--keep-within" in err and "999999999 days" in err, (big, err)
    code, out, _ = main_inprocess(tmp_path, capsys, "gc", "ns.kwo", "--keep-within", "1000000000s", "--dry-run",
                                  "--json")
    assert code == 0 and json.loads(out)["dry_run"] is True


@pytest.mark.services
def test_a_misspelt_storage_secret_variable_is_a_one_line_error_naming_the_setting(
        env: dict[str, str], tmp_path: Path, moto_service: Any) -> None:
    """``PYICEBERG_CATALOG__PROD__S3_SECRET_ACCESS_KEY`` (one ``_`` short after ``S3``) is read by pyiceberg as
    ``s3-secret-access-key``, which nothing reads: the key id was set and the secret not, and pyarrow's ``ValueError``
    ("both access_key and secret_key must be provided") came out of ``lakestream status`` as a traceback."""
    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"s3://{moto_service.bucket}/{tmp_path.name}",
             **moto_service.s3_properties()}
    catalog = load_catalog("prod", **props)
    catalog.create_namespace("ns")
    Stream.create(catalog, STREAM, schema=SCHEMA, world_size=WORLD)
    settings = {k: v for k, v in props.items() if k != "s3.secret-access-key"}
    typo = {**env, **services.catalog_env("prod", settings),
            "PYICEBERG_CATALOG__PROD__S3_SECRET_ACCESS_KEY": moto_service.secret_key}
    proc = run(typo, "--catalog", "prod", "status", STREAM, ok=False)
    assert proc.returncode == 1 and proc.stderr.startswith("lakestream: error:"), proc.stderr
    assert "s3.secret-access-key" in proc.stderr and "s3-secret-access-key" in proc.stderr, proc.stderr
    assert moto_service.secret_key not in proc.stderr


def _open_sqlite_connections() -> set[int]:
    """The ids of this process's SQLite connections that are open (a closed one refuses every call)."""
    import gc
    import sqlite3

    found = set()
    for obj in gc.get_objects():
        if isinstance(obj, sqlite3.Connection):
            try:
                obj.total_changes  # noqa: B018 - raises ProgrammingError once closed
            except sqlite3.ProgrammingError:
                continue
            found.add(id(obj))
    return found


@pytest.mark.parametrize("args", [("status", STREAM), ("checkpoints", STREAM), ("sql", STREAM, "select count(*) from batches"),
                                  ("lag", STREAM)])
def test_a_command_closes_the_catalog_it_opened(home: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...]) -> None:
    """Connections left open for the interpreter's exit to collect: Python 3.13 reports every one as a ResourceWarning
    (`lakestream demo` printed one), and a long-lived caller of ``main`` would keep them."""
    before = _open_sqlite_connections()
    code, _, _ = main_inprocess(home, capsys, *args)
    assert code == 0
    left = _open_sqlite_connections() - before
    assert not left, f"{len(left)} SQLite connection(s) of the catalog still open after `lakestream {args[0]}`"


def test_commands_run_at_once_in_threads_close_each_their_own_catalogs(tmp_path: Path) -> None:
    """Two threads of a long-lived process run a command each (``main()``), one starting while the other runs. The
    catalogs a command loads were gathered in one list for the whole process: the first to end closed the other's
    catalogs under it (on a REST catalog its session), and the second ended with TypeError (None is not iterable),
    its catalog left open and every catalog the process loaded after it gathered for ever."""
    import threading

    from lakestream_iceberg.tools.config import CatalogSpec, closing_catalogs, load

    entered, loaded, first_done = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []
    used_after: list[object] = []
    before = _open_sqlite_connections()

    def first() -> None:
        try:
            with closing_catalogs():
                entered.set()
                load(CatalogSpec(home=str(tmp_path / "one"))).list_namespaces()
                assert loaded.wait(30)  # the second command has loaded its catalog meanwhile
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            first_done.set()

    def second() -> None:
        try:
            assert entered.wait(30)
            with closing_catalogs():
                catalog = load(CatalogSpec(home=str(tmp_path / "two")))
                catalog.list_namespaces()
                loaded.set()
                assert first_done.wait(30)  # the first command ended: this one goes on with its catalog
                used_after.append(catalog.list_namespaces())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert used_after == [[]]
    left = _open_sqlite_connections() - before
    assert not left, f"{len(left)} SQLite connection(s) still open after both commands ended"
