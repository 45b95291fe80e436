"""lakestream vs MosaicML Streaming: one trainer rank reading the same samples into the same tensors.

    .venv/bin/python benchmarks/vs_streaming.py            # ~3 minutes on 2 cores; writes benchmarks/results/vs_streaming.json
    .venv/bin/python benchmarks/vs_streaming.py --smoke    # seconds; what tests/test_benchmarks_smoke.py runs

The samples: ``--steps`` (200) steps of ``--batch`` (256) samples, each an int64 id, 256-768 int32 tokens (ids below
50,000) and a 2-8 KiB blob (random bytes). The same rows are stored three ways:

* **lakestream**: one stream (world size 1, SQLite catalog, local warehouse), one step per global batch, Parquet
  uncompressed or zstd (``write.parquet.compression-codec``); read with
  ``DataLoader(LakestreamDataset(stream, follow=False), batch_size=None, num_workers=k)``, default collate
  (``TensorCollate()``: padded tokens, blobs as :class:`Blobs`) and ``TensorCollate(binary="packed")``;
* **MDS**: MosaicML Streaming 0.13 shards written by ``MDSWriter`` (``compression=None`` or ``"zstd"``), read with
  ``DataLoader(StreamingDataset(local=..., shuffle=False, batch_size=B), batch_size=B, num_workers=k)`` and a collate
  that builds the same tensors (ids, right-padded tokens plus lengths, the blobs as one uint8 tensor plus offsets in a
  ``Blobs``: 5 tensors a batch, torch's cheapest hand-over from its workers; a list of 256 blob tensors costs MDS
  several times more with workers);
* **colocated**: the rows as numpy arrays in the trainer's memory, a map-style dataset and
  ``DataLoader(batch_size=B, num_workers=k)`` with the same collate: no storage format at all (the floor a
  colocated ``DataLoader`` pays to assemble and ship batches, as in ``vs_colocated.py``, without its preprocessing).

Each cell's loader is made once, on its first pass, with ``persistent_workers=True`` when it has workers, and each
round iterates it again (an epoch): a training loop reads from one loader for hours (or one follow-mode iteration),
so the rounds measure the steady state, and the first pass what starting a loader costs. A pass reads every batch and
touches each tensor (one element of each). ``samples/s`` = samples / the pass's wall time (``iter`` to the last
batch); ``CPU us/sample`` = CPU seconds of the trainer process and its DataLoader workers (read from ``/proc`` while
they live) per sample; ``new loader: first batch ms`` = the first pass, from making the loader (its workers fork and,
for lakestream, reopen the stream) to its first batch; ``MB on disk`` = the stored bytes. The first pass also warms
the page cache. Rounds alternate the order of the cells; figures are medians over the rounds.

``mosaicml-streaming`` is a benchmark-only package: ``make bench`` installs it ``--no-deps`` into
``benchmarks/.bench-packages`` with the few packages ``streaming.base`` imports at run time (brotli, python-snappy,
cramjam, zstd, xxhash, catalogue); its package root imports transformers and torchvision, so this script imports
``streaming.base`` only, with ``transformers``' two batch types (used by ``StreamingDataLoader``, not here) stubbed.
Without it the MDS rows are skipped with the reason, the others run.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from _common import BENCH_DIR, RESULTS_DIR, Run, Table, alternating, bench_parser, cpu_s, dir_bytes, fill_defaults, int_list, live_children_cpu_s, machine  # noqa: E402

BENCH_PACKAGES = BENCH_DIR / ".bench-packages"
SCHEMA = pa.schema([("id", pa.int64()), ("tokens", pa.list_(pa.int32())), ("blob", pa.binary())])
CODECS = ("uncompressed", "zstd")


# ------------------------------------------------------------------------------------------------ the samples
def make_batches(steps: int, batch: int, seed: int = 0) -> list[dict[str, Any]]:
    """Per step: ``ids`` int64[B], ``tokens`` (flat int32 values, int64 offsets), ``blobs`` (flat uint8, offsets)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        t_len = rng.integers(256, 769, batch)
        b_len = rng.integers(2048, 8193, batch)
        out.append({
            "ids": np.arange(step * batch, (step + 1) * batch, dtype=np.int64),
            "tokens": rng.integers(0, 50_000, int(t_len.sum()), dtype=np.int32),
            "t_off": np.concatenate(([0], np.cumsum(t_len))).astype(np.int64),
            "blobs": np.frombuffer(rng.bytes(int(b_len.sum())), np.uint8),
            "b_off": np.concatenate(([0], np.cumsum(b_len))).astype(np.int64),
        })
    return out


def arrow_table(b: dict[str, Any]) -> pa.Table:
    tokens = pa.ListArray.from_arrays(pa.array(b["t_off"].astype(np.int32)), pa.array(b["tokens"]))
    blobs = pa.BinaryArray.from_buffers(pa.binary(), len(b["ids"]), [None, pa.py_buffer(b["b_off"].astype(np.int32)),
                                                                     pa.py_buffer(b["blobs"])])
    return pa.Table.from_arrays([pa.array(b["ids"]), tokens, blobs], schema=SCHEMA)


def rows(b: dict[str, Any]) -> Iterator[tuple[int, np.ndarray, bytes]]:
    t, to, bl, bo = b["tokens"], b["t_off"], b["blobs"], b["b_off"]
    for i, sample_id in enumerate(b["ids"].tolist()):
        yield sample_id, t[to[i]:to[i + 1]], bl[bo[i]:bo[i + 1]].tobytes()


def collate_samples(samples: list[tuple[int, np.ndarray, bytes]]) -> dict[str, Any]:
    """MDS's and the colocated loader's collate: the tensors lakestream's default collate gives (ids, right-padded
    tokens plus lengths, blobs as one uint8 tensor plus offsets in a ``Blobs``), built from per-sample rows as a
    DataLoader collate must. Five tensors a batch, so DataLoader workers ship them as cheaply as torch allows."""
    import torch

    from lakestream_iceberg.read.tensors import Blobs

    lengths = np.fromiter((len(s[1]) for s in samples), np.int64, len(samples))
    tokens = np.zeros((len(samples), int(lengths.max())), np.int32)
    for row, s in zip(tokens, samples, strict=True):
        row[: len(s[1])] = s[1]
    blob_offsets = np.zeros(len(samples) + 1, np.int64)
    np.cumsum([len(s[2]) for s in samples], out=blob_offsets[1:])
    blobs = np.frombuffer(bytearray(b"".join(s[2] for s in samples)), np.uint8)
    return {"sample_ids": torch.tensor([s[0] for s in samples], dtype=torch.int64), "tokens": torch.from_numpy(tokens),
            "tokens_lengths": torch.from_numpy(lengths),
            "blob": Blobs(values=torch.from_numpy(blobs), offsets=torch.from_numpy(blob_offsets))}


def mds_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return collate_samples([(int(s["id"]), s["tokens"], s["blob"]) for s in samples])


def touch(item: dict[str, Any]) -> int:
    """What the loop does with a batch: read one element of every tensor (blobs: of the first and last)."""
    total = int(item["sample_ids"][0]) + int(item["tokens"][0, 0]) + int(item["tokens_lengths"][0])
    blob = item["blob"]  # a list of uint8 tensors, Blobs, or (binary="packed") one flat uint8 tensor
    total += int(blob[0]) if getattr(blob, "dim", lambda: 0)() == 1 else int(blob[0][0]) + int(blob[len(blob) - 1][0])
    return len(item["sample_ids"])


# ------------------------------------------------------------------------------------------------ MosaicML Streaming
def import_streaming() -> tuple[Any, Any, str | None]:
    """``(MDSWriter, StreamingDataset, None)``, or ``(None, None, why not)``."""
    if BENCH_PACKAGES.is_dir() and str(BENCH_PACKAGES) not in sys.path:
        sys.path.append(str(BENCH_PACKAGES))
    spec = importlib.util.find_spec("streaming")
    if spec is None or not spec.submodule_search_locations:
        return None, None, (f"mosaicml-streaming is not installed (make bench installs it into {BENCH_PACKAGES}, "
                            "or: pip install --no-deps --target benchmarks/.bench-packages -r benchmarks/bench-requirements.txt)")
    if "streaming" not in sys.modules:  # the package root imports transformers and torchvision: skip it
        root = types.ModuleType("streaming")
        root.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = root
    have_transformers = "transformers" in sys.modules or importlib.util.find_spec("transformers") is not None
    for module, name in (("transformers.feature_extraction_utils", "BatchFeature"),
                         ("transformers.tokenization_utils_base", "BatchEncoding")):
        if not have_transformers and module not in sys.modules:
            sys.modules.setdefault("transformers", types.ModuleType("transformers"))
            stub = types.ModuleType(module)
            setattr(stub, name, type(name, (dict,), {}))
            sys.modules[module] = stub
    try:
        from streaming.base import MDSWriter, StreamingDataset
    except ImportError as exc:
        return None, None, f"streaming.base does not import: {exc}"
    logging.getLogger("streaming").setLevel(logging.ERROR)
    return MDSWriter, StreamingDataset, None


def write_mds(writer_cls: Any, out: Path, batches: list[dict[str, Any]], codec: str) -> None:
    columns = {"id": "int64", "tokens": "ndarray:int32", "blob": "bytes"}
    with writer_cls(out=str(out), columns=columns, compression=None if codec == "uncompressed" else codec) as writer:
        for b in batches:
            for sample_id, tokens, blob in rows(b):
                writer.write({"id": sample_id, "tokens": tokens, "blob": blob})


# ------------------------------------------------------------------------------------------------ the colocated floor
class InMemory:
    """A map-style dataset over the samples in memory (forked workers inherit it)."""

    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self.samples = [s for b in batches for s in rows(b)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, np.ndarray, bytes]:
        return self.samples[i]


# ------------------------------------------------------------------------------------------------ measuring
def trainer_cpu_s() -> float:
    """CPU seconds of this process, its reaped children and its live children (persistent DataLoader workers: their
    time is in RUSAGE_CHILDREN only once they exit, so it is read from /proc while they live)."""
    return cpu_s(children=True) + live_children_cpu_s()


class Cell:
    """One reader at one worker count: its loader is made on the first pass and iterated again for every later one
    (``persistent_workers=True``): a training loop reads for hours from one loader, so a pass measures what it sees
    in steady state, while the first pass's time to the first batch is what starting a loader costs."""

    def __init__(self, make_loader: Callable[[], Any]) -> None:
        self.make_loader, self.loader = make_loader, None

    def measure(self, expected: int) -> dict[str, float]:
        cpu0, wall0 = trainer_cpu_s(), time.perf_counter()
        if self.loader is None:
            self.loader = self.make_loader()
        first = None
        samples = 0
        for item in self.loader:
            samples += touch(item)
            if first is None:
                first = time.perf_counter() - wall0
        wall = time.perf_counter() - wall0
        del item
        cpu = trainer_cpu_s() - cpu0
        assert samples == expected, (samples, expected)
        return {"samples_per_s": samples / wall, "cpu_us_per_sample": cpu / samples * 1e6,
                "first_batch_ms": (first or 0) * 1e3, "wall_s": wall}

    def close(self) -> None:
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.loader = None


def main() -> None:
    ap = bench_parser(__doc__, out=RESULTS_DIR / "vs_streaming.json")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--codecs", default=",".join(CODECS))
    args = ap.parse_args()
    run = Run("vs_streaming", smoke=args.smoke)
    fill_defaults(args, steps=(200, 12), rounds=(7, 1))
    args.batch = 32 if args.smoke else args.batch
    workers = int_list(args.workers)
    codecs = args.codecs.split(",")

    import torch
    from pyiceberg.catalog.sql import SqlCatalog
    from torch.utils.data import DataLoader

    from lakestream_iceberg import Stream
    from lakestream_iceberg.read.dataset import LakestreamDataset, TensorCollate

    logging.getLogger("lakestream_iceberg").setLevel(logging.ERROR)  # the worker advice is this benchmark's subject
    torch.set_num_threads(1)
    mds_writer, mds_dataset, mds_missing = import_streaming()
    batches = make_batches(args.steps, args.batch)
    expected = args.steps * args.batch
    tmp = Path(tempfile.mkdtemp(prefix="lakestream-vs-streaming-"))
    cells: dict[str, Cell] = {}
    disk: dict[str, int] = {}
    try:
        catalog = SqlCatalog("bench", uri=f"sqlite:///{tmp}/catalog.db", warehouse=f"file://{tmp}/wh")
        setup = time.perf_counter()
        for codec in codecs:
            name = f"bench.s_{codec}"
            stream = Stream.create(catalog, name, schema=SCHEMA, world_size=1,
                                   properties={"write.parquet.compression-codec": codec})
            producer = stream.producer("bench")
            for b in batches:
                producer.commit([arrow_table(b)])
            disk[f"lakestream {codec}"] = sum(f.stat().st_size for f in (tmp / "wh").rglob("*.parquet")
                                              if f"s_{codec}" in str(f) and "_staging" not in str(f))
            for label, collate in (("default collate", None), ("binary=packed", TensorCollate(binary="packed"))):
                for k in workers:
                    def lake(stream: Any = stream, collate: Any = collate, k: int = k) -> Any:
                        ds = LakestreamDataset(stream, rank=0, world_size=1, collate=collate)
                        return DataLoader(ds, batch_size=None, num_workers=k, persistent_workers=k > 0)
                    cells[f"lakestream, {label}|{codec}|{k}"] = Cell(lake)
            if mds_writer is not None:
                out = tmp / f"mds-{codec}"
                write_mds(mds_writer, out, batches, codec)
                disk[f"MDS {codec}"] = dir_bytes(out)
                for k in workers:
                    def mds(out: Path = out, k: int = k) -> Any:
                        ds = mds_dataset(local=str(out), shuffle=False, batch_size=args.batch)
                        return DataLoader(ds, batch_size=args.batch, num_workers=k, collate_fn=mds_collate,
                                          persistent_workers=k > 0)
                    cells[f"MDS|{codec}|{k}"] = Cell(mds)
        memory = InMemory(batches)
        for k in workers:
            cells[f"colocated, in memory|-|{k}"] = Cell(
                lambda k=k: DataLoader(memory, batch_size=args.batch, num_workers=k, collate_fn=collate_samples,
                                       persistent_workers=k > 0))
        setup_s = time.perf_counter() - setup

        started: dict[str, dict[str, float]] = {}
        for key, cell in cells.items():  # makes each loader (its workers start) and warms the page cache
            started[key] = cell.measure(expected)
        results: dict[str, list[dict[str, float]]] = {key: [] for key in cells}
        for i in range(args.rounds):
            for key in alternating(list(cells), i):
                results[key].append(cells[key].measure(expected))
    finally:
        for cell in cells.values():
            cell.close()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(key: str, field: str) -> float:
        if field == "first_batch_ms":  # a new loader's: the first pass
            return started[key][field] if key in started else float("nan")
        return statistics.median(r[field] for r in results[key]) if key in results else float("nan")

    columns = ["reader", "codec"]
    for field in ("samples/s", "CPU us/sample", "new loader: first batch ms"):
        columns += [f"{field} {k}w" for k in workers]
    columns += ["MB on disk"]
    table = Table(f"one trainer rank, {args.steps} steps x {args.batch} samples (int64 id, 256-768 int32 tokens, "
                  "2-8 KiB blob); medians", columns)
    readers = sorted({key.split("|")[0] for key in cells}, key=lambda r: ("MDS" in r, "colocated" in r, r))
    for reader in readers:
        for codec in ([*codecs] if "colocated" not in reader else ["-"]):
            base = f"{reader}|{codec}"
            if f"{base}|{workers[0]}" not in cells:
                continue
            row: list[Any] = [reader, codec]
            for field in ("samples_per_s", "cpu_us_per_sample", "first_batch_ms"):
                row += [med(f"{base}|{k}", field) for k in workers]
            store = "lakestream" if reader.startswith("lakestream") else "MDS" if reader == "MDS" else None
            row.append(disk[f"{store} {codec}"] / 1e6 if store else None)
            table.add(*row)
    ratios = Table("ratios (samples/s, medians)", ["codec", "workers", "lakestream default: k workers / 0 workers",
                                                   "lakestream default / MDS", "lakestream default / colocated"])
    for codec in codecs:
        lake0 = med(f"lakestream, default collate|{codec}|0", "samples_per_s")
        for k in workers:
            lake = med(f"lakestream, default collate|{codec}|{k}", "samples_per_s")
            ratios.add(codec, k, lake / lake0, lake / med(f"MDS|{codec}|{k}", "samples_per_s"),
                       lake / med(f"colocated, in memory|-|{k}", "samples_per_s"))
    if mds_missing:
        table.note(f"MDS rows skipped: {mds_missing}")
    table.note(f"{args.rounds} rounds in alternating order after a warm-up pass; setup (writing both stores) {setup_s:.1f} s; "
               f"CPU = trainer process + its DataLoader workers")
    run.finish([table, ratios], {
        "machine": machine(),
        "config": {"steps": args.steps, "batch": args.batch, "rounds": args.rounds, "workers": workers, "codecs": codecs},
        "mds_skipped": mds_missing, "disk_bytes": disk, "runs": results, "first_pass": started,
    }, out=args.out, spaced=False, sep="\n")


if __name__ == "__main__":
    main()
