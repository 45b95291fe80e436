"""The intent file: what a producer stages to announce a written batch (see :mod:`lakestream_iceberg.write.staging`).

One row, one string column ``intent`` holding a JSON document, and the same document in the Parquet footer's key-value
metadata (``lakestream.intent``), where committers read it without decoding a page. Object stores that serve Iceberg
tables, such as S3 Tables buckets, accept only Parquet and Avro under a table's ``data/``. The name is
``<producer>@<seq:012d>-<token>.parquet``; a reader checks every field it parses (an intent is input read from
storage, not a trusted message) and raises ``ValueError`` for anything this module does not write.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from lakestream_iceberg.connect.integers import INT64_MAX
from lakestream_iceberg.write.writer import StagedBatch, StagedFile, check_producer_id

__all__ = ["INTENT_FORMAT", "INTENT_NAME", "Intent", "STAGING_DIR", "intent_name"]

INTENT_FORMAT = 3  # 3: declares files_age_s; 2: bound to the table UUID (format 1 intents are never published)
_READABLE_FORMATS = (2, 3)  # a format-2 intent (an older release's) is aged by the store's clock alone
STAGING_DIR = "_staging"  # under the table's data/ folder
PARQUET_MAGIC = b"PAR1"
_FOOTER_KEY = b"lakestream.intent"  # the intent's JSON, also in the footer's key-value metadata
_MAX_STAGED_AT = 1e15  # unix seconds: in ms, 18 digits, what lakestream.staged-at-ms holds (StreamState.parse)
_TOKEN = re.compile(r"^[A-Za-z0-9]{1,32}$")
INTENT_NAME = re.compile(r"^(?P<producer>[A-Za-z0-9][A-Za-z0-9._-]{0,127})@(?P<seq>[0-9]{12,19})-(?P<token>[A-Za-z0-9]{1,32})\.parquet$")


def intent_name(batch: StagedBatch) -> str:
    """The file name of a batch's intent: ``<producer>@<seq:012d>-<token>.parquet``."""
    return f"{batch.producer}@{batch.seq:012d}-{batch.token}.parquet"


@dataclass(frozen=True)
class Intent:
    """A staged batch: where its intent file is, and what it publishes."""

    path: str
    branch: str
    batch: StagedBatch
    allow_gap: bool
    staged_at: float  # unix seconds, by the owner's clock
    table_uuid: str
    modified: float | None = None  # the store's modification time of the intent file (set when listed)
    files_age_s: float = 0.0  # how long before staged_at the batch's data files were written (owner's clock)

    @property
    def staged_since(self) -> float:
        """When the intent existed at the latest: its declared time, or the store's, whichever is later."""
        return max(self.staged_at, self.modified or 0.0)

    def to_bytes(self) -> bytes:
        """The intent file: one row, one string column ``intent`` holding the JSON document, and the same document in
        the footer's key-value metadata (``lakestream.intent``), which a committer reads without decoding a page."""
        body = self.to_json()
        table = pa.table({"intent": [body]})
        sink = io.BytesIO()
        with pq.ParquetWriter(sink, table.schema, compression="none", store_schema=False) as writer:
            writer.write_table(table)
            writer.add_key_value_metadata({_FOOTER_KEY.decode(): body})
        return sink.getvalue()

    @classmethod
    def from_bytes(cls, path: str, raw: bytes) -> Intent:
        # The footer's copy: parsing the footer alone costs 11 us, decoding the row 160 us (once per listed intent per
        # committer process); an intent written before the footer copy is read from its row
        metadata = pq.read_metadata(pa.BufferReader(raw))
        if metadata.num_rows != 1:
            raise ValueError(f"an intent file holds one row, this one {metadata.num_rows}")
        body = (metadata.metadata or {}).get(_FOOTER_KEY)
        if body is not None:
            return cls.from_json(path, body.decode("utf-8"))
        column = pq.ParquetFile(pa.BufferReader(raw)).read(columns=["intent"]).column("intent")
        return cls.from_json(path, column[0].as_py())

    def to_json(self) -> str:
        """The intent's JSON document (what an intent file carries; a row of the catalog's intent table holds it)."""
        return json.dumps(
            {
                "format": INTENT_FORMAT, "table_uuid": self.table_uuid, "branch": self.branch,
                "producer": self.batch.producer, "seq": self.batch.seq,
                "token": self.batch.token, "allow_gap": self.allow_gap, "staged_at": self.staged_at,
                "files_age_s": self.files_age_s, "files": [f.to_json() for f in self.batch.files],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, path: str, raw: str) -> Intent:
        body = json.loads(raw)
        if not isinstance(body, dict) or body.get("format") not in _READABLE_FORMATS:
            raise ValueError(f"unknown intent format {body.get('format') if isinstance(body, dict) else body!r}")
        seq, token, staged_at = body["seq"], body["token"], body["staged_at"]
        if type(seq) is not int or not 0 <= seq <= INT64_MAX:  # a seq is a long, as the summary records it
            raise ValueError(f"seq {seq!r} is not an integer from 0 to {INT64_MAX}")
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise ValueError(f"token {token!r} is not 1-32 letters or digits")
        if type(staged_at) not in (int, float) or not isinstance(body["allow_gap"], bool):
            raise ValueError("staged_at must be a number and allow_gap a boolean")
        if not 0 <= staged_at < _MAX_STAGED_AT:  # NaN too: a carried batch's summary records it in ms (19 digits)
            raise ValueError(f"staged_at {staged_at!r} is not a unix time in seconds")
        files_age_s = body.get("files_age_s", 0.0)  # absent: an intent of an earlier release, aged by the store alone
        if type(files_age_s) not in (int, float) or not 0 <= files_age_s < float("inf"):
            raise ValueError(f"files_age_s {files_age_s!r} is not a non-negative number of seconds")
        if not isinstance(body["table_uuid"], str) or not isinstance(body["branch"], str):
            raise ValueError("table_uuid and branch must be strings")
        files = tuple(StagedFile.from_json(f) for f in body["files"])
        batch = StagedBatch(producer=check_producer_id(body["producer"]), seq=seq, files=files, token=token)
        return cls(path=path, branch=body["branch"], batch=batch, allow_gap=body["allow_gap"],
                   staged_at=float(staged_at), table_uuid=body["table_uuid"], files_age_s=float(files_age_s))
