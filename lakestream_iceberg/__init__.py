"""lakestream_iceberg: a brokerless training-data plane on Apache Iceberg.

Producers publish each global training step as one Iceberg snapshot (a Transactional Global Batch); trainer ranks read
their own shard of each step, in step order. See README.md for the model.
"""

from lakestream_iceberg.errors import *  # noqa: F403
from lakestream_iceberg.errors import __all__ as _errors
from lakestream_iceberg.checkpoint import Checkpoint
from lakestream_iceberg.lifecycle import GCReport
from lakestream_iceberg.producer import CommitResult, Producer
from lakestream_iceberg.stream import Stream

__all__ = ["Checkpoint", "CommitResult", "GCReport", "Producer", "Stream", *_errors]
__version__ = "0.1.0"
