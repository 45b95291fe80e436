"""``Stream.create`` creates a missing namespace; when the table then cannot be created (a property or location the
catalog refuses), it drops that namespace again, and only that one: never a namespace that existed before the call or
that holds a table (another process's, created meanwhile). On the SQL catalog (SQLite) and the REST catalog
(SeaweedFS)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import NamespaceNotEmptyError, NoSuchTableError

from lakestream_iceberg import Stream
from lakestream_iceberg.errors import ConfigError, StreamExistsError
from lakestream_iceberg.write.create import drop_namespace_if_empty
from tests.backends import Backend, fresh_name, make_backend, seaweedfs_service  # noqa: F401 - fixture
from tests.support import SCHEMA, sqlite_catalog

WORLD = 2
KINDS = ("sqlite-local", "rest-seaweedfs")


def refused(backend: Backend, tmp_path: Path) -> dict[str, str]:
    """A location that passes lakestream's checks and that the catalog refuses once the namespace exists: under a file
    (the SQL catalog writes the first metadata file there, and fails), or outside the REST server's warehouse bucket."""
    if backend.kind.startswith("rest"):
        return {"location": f"s3://{fresh_name('no-such-bucket')}/t"}
    (tmp_path / "a-file").write_text("x")
    return {"location": f"file://{tmp_path}/a-file/t"}


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path):
    made = make_backend(request.param, request, tmp_path)
    try:
        yield made
    finally:
        made.close()


def namespaces(catalog: Catalog) -> set[str]:
    return {".".join(ns) for ns in catalog.list_namespaces()}


def test_a_refused_create_leaves_no_namespace_behind(backend: Backend, tmp_path: Path) -> None:
    """The namespace made for a stream the catalog then refused stayed behind, empty (and a REST catalog's refusal
    came out as pyiceberg's BadRequestError)."""
    catalog = backend.catalog()
    with pytest.raises(ConfigError, match="cannot create stream"):
        Stream.create(catalog, backend.identifier(), schema=SCHEMA, world_size=WORLD, **refused(backend, tmp_path))
    assert backend.namespace not in namespaces(catalog)
    stream = Stream.create(catalog, backend.identifier(), schema=SCHEMA, world_size=WORLD)  # and it can be made again
    assert stream.head_step() == 0
    stream.close()


def test_a_namespace_that_existed_is_kept(backend: Backend, tmp_path: Path) -> None:
    catalog = backend.catalog()
    catalog.create_namespace(backend.namespace)
    with pytest.raises(ConfigError, match="cannot create stream"):
        Stream.create(catalog, backend.identifier(), schema=SCHEMA, world_size=WORLD, **refused(backend, tmp_path))
    assert backend.namespace in namespaces(catalog)
    with pytest.raises(NoSuchTableError):
        catalog.load_table(backend.identifier())


def test_a_namespace_another_process_filled_meanwhile_keeps_its_table(backend: Backend) -> None:
    """The race the drop must lose: another process creates a table in the namespace between this call's namespace
    and its failed table. The catalogs refuse to drop a namespace that is not empty, and the cleanup takes that."""
    catalog, other = backend.catalog(), backend.catalog()
    catalog.create_namespace(backend.namespace)
    theirs = Stream.create(other, backend.identifier("theirs"), schema=SCHEMA, world_size=WORLD)
    with pytest.raises(NamespaceNotEmptyError):  # what the cleanup relies on, in both catalogs
        catalog.drop_namespace(backend.namespace)
    drop_namespace_if_empty(catalog, (backend.namespace,))
    assert backend.namespace in namespaces(catalog)
    assert Stream.open(catalog, backend.identifier("theirs")).head_step() == theirs.head_step() == 0
    theirs.close()


def test_a_location_the_catalog_cannot_write_leaves_no_namespace_behind(tmp_path: Path) -> None:
    """A location under a file: the SQL catalog writes the table's first metadata file there, and fails."""
    catalog = sqlite_catalog(str(tmp_path))
    (tmp_path / "a-file").write_text("x")
    name = fresh_name("ns")
    with pytest.raises(Exception, match="cannot create stream"):
        Stream.create(catalog, f"{name}.s", schema=SCHEMA, world_size=WORLD, location=f"file://{tmp_path}/a-file/t")
    assert name not in namespaces(catalog)


class DroppedMeanwhile(SqlCatalog):
    """A SQL catalog on which another process's create, which made the namespace and then failed, drops it between
    this process's namespace check and its table (the other side of the race above)."""

    drops = 1

    def create_table(self, identifier: Any, *args: Any, **kwargs: Any) -> Any:
        if self.drops:
            self.drops -= 1
            self.drop_namespace(Catalog.namespace_from(identifier))
        return super().create_table(identifier, *args, **kwargs)


def test_a_namespace_dropped_by_another_failed_create_is_made_again(tmp_path: Path) -> None:
    """This call found the namespace (another create had just made it), and that create failed and dropped it before
    this call's table went in: the catalog said the namespace does not exist."""
    other = sqlite_catalog(str(tmp_path))
    other.create_namespace("ns")
    catalog = DroppedMeanwhile("test", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    stream = Stream.create(catalog, "ns.stream", schema=SCHEMA, world_size=WORLD)
    assert catalog.drops == 0 and stream.head_step() == 0
    assert "ns" in namespaces(other)
    stream.close()


@pytest.mark.parametrize("version", ["9", "3", "0", "x", " 2", "2.0"])
def test_a_format_version_pyiceberg_cannot_write_is_refused_before_anything_is_made(backend: Backend,
                                                                                     version: str) -> None:
    """format-version 9 came out as pyiceberg's ValidationError and "x" as a warehouse that cannot be written;
    pyiceberg writes the manifests and snapshots of versions 1 and 2 only."""
    catalog = backend.catalog()
    with pytest.raises(ConfigError, match=r"format-version=.*Iceberg format version 1 or 2"):
        Stream.create(catalog, backend.identifier(), schema=SCHEMA, world_size=WORLD,
                      properties={"format-version": version})
    assert backend.namespace not in namespaces(catalog)
    stream = Stream.create(catalog, backend.identifier(), schema=SCHEMA, world_size=WORLD,
                           properties={"format-version": "1"})
    assert stream.table.metadata.format_version in (1, 2)  # a v1 table: pyiceberg upgrades what it reads to v2
    stream.close()


def test_a_format_version_given_for_an_existing_stream_is_checked_against_it(tmp_path: Path) -> None:
    """Stream.create of a stream that exists returned it without a word whatever format-version it was given (9, x,
    or another version than the stream's), where another value of any other property given is refused."""
    catalog = sqlite_catalog(str(tmp_path))
    Stream.create(catalog, "ns.fv", schema=SCHEMA, world_size=WORLD, properties={"format-version": "1"}).close()
    again = Stream.create(catalog, "ns.fv", schema=SCHEMA, world_size=WORLD, properties={"format-version": "1"})
    assert again.table.metadata.format_version == 1  # the same: opened as it is
    again.close()
    for version in ("9", "x"):
        with pytest.raises(ConfigError, match=r"format-version=.*Iceberg format version 1 or 2"):
            Stream.create(catalog, "ns.fv", schema=SCHEMA, world_size=WORLD, properties={"format-version": version})
    with pytest.raises(StreamExistsError, match=r"format-version=1 \(not '2'\)"):
        Stream.create(catalog, "ns.fv", schema=SCHEMA, world_size=WORLD, properties={"format-version": "2"})
