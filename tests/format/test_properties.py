"""The table-property declarations (format/properties.py): a bad value of every declared property is a ConfigError
naming it, a bool is no integer, StreamConfig is built from the declarations, and a change on a live stream takes
effect when the declaration says it does.

That a ``live`` property changed on a running stream applies from the next commit is shown with producers running by
tests/test_interop.py::test_a_retention_set_on_a_live_stream_applies_from_the_next_commit."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.exceptions import NoSuchTableError

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import ConfigError
from lakestream_iceberg.format.layout import StreamConfig
from lakestream_iceberg.format.properties import (
    ARROW_SCHEMA,
    COMMIT_TIMEOUT,
    CONFIG_FIELDS,
    GC_GRACE,
    GROUP_MAX_BATCHES,
    PROPERTIES,
    RETAIN_LAST,
    BoolProperty,
    Change,
    ChoiceProperty,
    DurationProperty,
    IntProperty,
    Property,
    TextProperty,
)
from tests.support import SCHEMA, batch, sqlite_catalog

WORLD = 2

# A value each kind of property refuses. A text property is checked by the code that uses it (codecs: a trial write);
# lakestream.arrow-schema is data read back (CorruptStateError, tests/test_input_checks.py).
BAD = {IntProperty: "12x", DurationProperty: "5s", BoolProperty: "yes", ChoiceProperty: "no-such-choice",
       TextProperty: "no-such-codec"}
CHECKED = [p for p in PROPERTIES if p is not ARROW_SCHEMA]


def bad_value(prop: Property[Any]) -> str:
    return BAD[type(prop)]


@pytest.mark.parametrize("prop", CHECKED, ids=lambda p: p.key)
def test_a_bad_value_of_every_declared_property_is_refused_naming_it(tmp_path: Path, prop: Property[Any]) -> None:
    catalog = sqlite_catalog(str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape(prop.key)):
        Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD, properties={prop.key: bad_value(prop)})
    with pytest.raises(NoSuchTableError):  # nothing was created
        catalog.load_table("ns.stream")


@pytest.mark.parametrize("prop", [p for p in CHECKED if p.field], ids=lambda p: p.key)
def test_a_bad_value_set_on_an_existing_stream_is_refused_when_it_is_opened(tmp_path: Path, prop: Property[Any]) -> None:
    """Another client (Spark's ALTER TABLE, pyiceberg) can store anything; the stream is refused naming the property
    instead of failing later in a commit."""
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    with stream.table.transaction() as tx:
        tx.set_properties({prop.key: bad_value(prop)})
    with pytest.raises(ConfigError, match=re.escape(prop.key)):
        Stream.open(catalog, "ns.stream")


@pytest.mark.parametrize(("prop", "raw", "message"), [
    (RETAIN_LAST, "1", ">= 2"),
    (COMMIT_TIMEOUT, "0", ">= 1"),
    (RETAIN_LAST, "2.5", "not an integer"),
    (RETAIN_LAST, "true", "not an integer"),  # a boolean string is no count
    (GROUP_MAX_BATCHES, "", "not an integer"),
], ids=lambda v: v.key if hasattr(v, "key") else repr(v))
def test_bounds_and_the_fix_are_in_the_message(prop: IntProperty, raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(prop.key)) as err:
        prop.get({prop.key: raw})
    assert message in str(err.value) and "set_properties" in str(err.value)  # what to do


@pytest.mark.parametrize(("settings", "name"), [
    ({"world_size": True}, "world_size"),  # isinstance(True, int) is true: refused all the same
    ({"world_size": 2, "retain_snapshots": False}, "retain_snapshots"),
    ({"world_size": 2, "commit_timeout_ms": 1.5}, "commit_timeout_ms"),
    ({"world_size": 2, "group_commit": 1}, "group_commit"),
    ({"world_size": 2, "group_commit": "false"}, "group_commit"),
    ({"world_size": 2, "layout": "zigzag"}, "layout"),
    ({"world_size": 2, "retain_last": 4}, "retain_last"),  # no such setting
    ({"layout": "packed"}, "world_size"),  # required
])
def test_stream_config_checks_python_values_as_their_declared_type(settings: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        StreamConfig(**settings)


def test_stream_config_is_the_declarations() -> None:
    """One attribute per declaration with a field, of the declared type, defaulting to the declared initial value,
    and written back under the declared key."""
    hints = typing.get_type_hints(StreamConfig)
    assert set(hints) == set(CONFIG_FIELDS)
    kinds = {IntProperty: int, DurationProperty: int, BoolProperty: bool, ChoiceProperty: str, TextProperty: str}
    assert {name: kinds[type(p)] for name, p in CONFIG_FIELDS.items()} == hints
    config = StreamConfig(world_size=3)
    written = config.to_properties()
    for name, prop in CONFIG_FIELDS.items():
        if prop.initial is not None:
            assert getattr(config, name) == prop.initial, name
        assert prop.key in written or not prop.own, prop.key
    assert StreamConfig.from_properties(written) == config
    assert "history.expire.max-snapshot-age-ms" not in written  # lakestream's "off" is not written (0 means "all")
    with pytest.raises(AttributeError):
        config.world_size = 4  # type: ignore[misc]


def test_durations_are_read_in_seconds_from_the_one_conversion() -> None:
    config = StreamConfig.from_properties({"lakestream.world-size": "1", COMMIT_TIMEOUT.key: "1500",
                                           GC_GRACE.key: "4000", "lakestream.io.retry-timeout-ms": "250"})
    assert (config.commit_timeout_s, config.gc_grace_s, config.io_retry_timeout_s) == (1.5, 4.0, 0.25)
    assert config.staged_max_age_s == 2.0  # the GC grace rule: grace less the longest commit it allows
    assert all(p.unit == "ms" and p.key.endswith("-ms") for p in PROPERTIES if isinstance(p, DurationProperty))
    assert GC_GRACE.timedelta(90_000).total_seconds() == 90


def test_a_typo_in_a_lakestream_key_is_refused_with_the_nearest_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean lakestream.snapshots.retain-last"):
        Stream.create(sqlite_catalog(str(tmp_path)), "ns.stream", schema=SCHEMA, world_size=WORLD,
                      properties={"lakestream.snapshot.retain-last": "64"})


def test_a_property_read_on_open_applies_to_streams_opened_after_the_change(tmp_path: Path) -> None:
    """``Change.REOPEN``: a process that has the stream open keeps the value it read; one that opens it again (a new
    trainer, a restarted producer) reads the new one, and commits of both go on."""
    assert GROUP_MAX_BATCHES.change is Change.REOPEN and COMMIT_TIMEOUT.change is Change.REOPEN
    catalog = sqlite_catalog(str(tmp_path))
    running = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    producer = running.producer("a")
    producer.commit(batch("a", 0, WORLD), seq=0)
    with Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream").table.transaction() as tx:
        tx.set_properties({GROUP_MAX_BATCHES.key: "4", COMMIT_TIMEOUT.key: "20000"})
    assert producer.commit(batch("a", 1, WORLD), seq=1).step == 2
    assert (running.config.group_max_batches, running.config.commit_timeout_s) == (32, 300.0)
    reopened = Stream.open(sqlite_catalog(str(tmp_path)), "ns.stream")
    assert (reopened.config.group_max_batches, reopened.config.commit_timeout_s) == (4, 20.0)
    assert reopened.producer("b").commit(batch("b", 0, WORLD), seq=0).step == 3
