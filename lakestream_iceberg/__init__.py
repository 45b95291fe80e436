"""lakestream_iceberg: a brokerless training-data plane on Apache Iceberg.

Producers publish each global training step as one Iceberg snapshot (a Transactional Global Batch); trainer ranks read
their own shard of each step, in step order. See docs/concepts.md for the model.
"""

# ruff: noqa: E402 - the configuration file is checked before the imports below make pyiceberg parse it
from lakestream_iceberg.connect.config_file import check_config_file

check_config_file()  # before pyiceberg parses .pyiceberg.yaml at import: a file it cannot parse is one clear error

from lakestream_iceberg.connect.diagnose import load_catalog
from lakestream_iceberg.errors import *  # noqa: F403
from lakestream_iceberg.errors import __all__ as _errors
from lakestream_iceberg.lifecycle.checkpoint import Checkpoint
from lakestream_iceberg.lifecycle.gc import GCReport
from lakestream_iceberg.lifecycle.repair import RepairReport
from lakestream_iceberg.read.handoff import recommended_workers  # needs no torch
from lakestream_iceberg.read.tensors import Blobs, TensorCollate  # needs no torch
from lakestream_iceberg.stream import Stream
from lakestream_iceberg.write.producer import CommitResult, Producer

# LakestreamDataset subclasses torch's IterableDataset, so torch loads on first access (module __getattr__), and it
# stays out of __all__: `from lakestream_iceberg import *` must work without the torch extra.
__all__ = ["Blobs", "Checkpoint", "CommitResult", "GCReport", "Producer", "RepairReport", "Stream", "TensorCollate", "load_catalog",
           "recommended_workers",
           *_errors]


def __getattr__(name: str) -> object:
    if name == "LakestreamDataset":
        from lakestream_iceberg.read.dataset import LakestreamDataset

        return LakestreamDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "LakestreamDataset"])
__version__ = "0.1.0"
