"""lakestream vs colocated data loading: the same synthetic training loop fed two ways.

The trainer runs a fixed compute time per step (``--compute-ms``, default 50 ms) standing in for the GPU: a sleep, since
a GPU step does not occupy the host CPU (``--compute matmul`` burns the CPU instead). Each step consumes a batch of
``--batch`` samples; a sample is real preprocessing work on synthetic raw data made at start-up:

* an image: a 384x384 JPEG (~70 KB) decoded with PIL, random-resized-cropped and resized to 3x128x128 uint8;
* a text: ~250 words, lower-cased, split with a regex and WordPiece-tokenized (greedy longest match) over a generated
  vocabulary of ~9,000 pieces, truncated/padded to 128 int32 ids.

Feeds:

(a) colocated: ``torch.utils.data.DataLoader(num_workers=k)`` whose workers preprocess in the trainer's process tree;
(b) lakestream: producer processes preprocess and commit each batch as one step; the trainer reads it with
    ``LakestreamDataset`` (``lakestream_iceberg.read.dataset``). ``prefilled``: the producers ran ahead of time (preprocessing
    is off the trainer's critical path, as on separate CPU hosts); ``concurrent``: the producers run while the trainer
    trains, on the same 2 cores (they compete with it for the CPU, exactly as the DataLoader workers do).

Failure isolation: kill -9 one preprocessing worker mid-run (a DataLoader worker; a lakestream producer, restarted a few
seconds later) and report what the training loop sees. The lakestream victim waits at half its quota until it is killed,
so the kill always lands on a live producer with work left, however fast the producers run.

Run: ``.venv/bin/python benchmarks/vs_colocated.py`` (about 2-3 minutes on 2 cores) or ``--smoke`` (seconds).
"""

from __future__ import annotations

import argparse
import gc
import io
import math
import multiprocessing as mp
import multiprocessing.forkserver
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from _common import RESULTS_DIR, Run, Table, bench_parser, collect_reports, cpu_s, fill_defaults, int_list, kill_all, machine, percentile, sqlite_catalog  # noqa: E402

# Producer processes come from a forkserver, never from a fork of the benchmark: a fork copies the locks other threads
# hold at that instant (a producer restarted from the failure run's timer thread hung forever on an RLock the training
# loop held) and the trainer's open SQLite connections to the catalog (SQLite's locks do not survive fork(): a child
# that opens the same file again may read and write it without holding them). The server has neither.
CTX = mp.get_context("forkserver")
FORKSERVER_PRELOAD = ["__main__", "lakestream_iceberg", "pyiceberg.catalog.sql", "PIL.Image"]
NAME = "bench.train"
IMG = 128
SEQ = 128
SCHEMA = pa.schema([("sample_id", pa.int64()), ("image", pa.binary()), ("tokens", pa.list_(pa.int32()))])

# ------------------------------------------------------------------------------------------------ raw data + preprocessing

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


class RawData:
    """Synthetic raw samples (JPEG bytes, text) and the vocabulary; built once (inherited by the forked DataLoader workers, pickled to the producers)."""

    def __init__(self, n_images: int, n_texts: int, seed: int = 0) -> None:
        from PIL import Image

        rng = np.random.default_rng(seed)
        self.jpegs: list[bytes] = []
        size = 384
        y, x = np.mgrid[0:size, 0:size]
        for _ in range(n_images):
            a, b, c = rng.uniform(0.2, 1.0, 3)
            base = np.stack([(x * a) % 256, (y * b) % 256, ((x + y) * c / 2) % 256], -1)
            pixels = (base + rng.normal(0, 20, base.shape)).clip(0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, "JPEG", quality=90)
            self.jpegs.append(buf.getvalue())
        words = sorted({"".join(rng.choice(_SYLLABLES, size=rng.integers(1, 5))) for _ in range(20_000)})
        pieces = set(_SYLLABLES) | {"##" + s for s in _SYLLABLES} | set(words[:: max(1, len(words) // 8000)])
        self.vocab = {p: i + 2 for i, p in enumerate(sorted(pieces))}  # 0 = [PAD], 1 = [UNK]
        zipf = 1.0 / np.arange(1, len(words) + 1)
        zipf /= zipf.sum()
        self.texts: list[str] = []
        for _ in range(n_texts):
            chosen = rng.choice(len(words), size=250, p=zipf)
            parts = [words[i] + ("." if rng.random() < 0.07 else "," if rng.random() < 0.05 else "") for i in chosen]
            self.texts.append(" ".join(parts).capitalize())


_TOKEN = re.compile(r"\w+|[^\w\s]")


def wordpiece(text: str, vocab: dict[str, int], max_len: int = SEQ) -> np.ndarray:
    """Greedy longest-match-first WordPiece, as in BERT's tokenizer (pure Python: real CPU work)."""
    ids: list[int] = []
    for word in _TOKEN.findall(text.lower()):
        start, n = 0, len(word)
        while start < n:
            end = n
            piece_id = None
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                piece_id = vocab.get(piece)
                if piece_id is not None:
                    break
                end -= 1
            if piece_id is None:
                ids.append(1)
                break
            ids.append(piece_id)
            start = end
        if len(ids) >= max_len:
            break
    out = np.zeros(max_len, np.int32)
    out[: min(max_len, len(ids))] = ids[:max_len]
    return out


def preprocess(raw: RawData, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``index``: decode + random-resized-crop + resize the image, tokenize the text."""
    from PIL import Image

    rng = np.random.default_rng(index)
    image = Image.open(io.BytesIO(raw.jpegs[index % len(raw.jpegs)]))
    image = image.convert("RGB")
    w, h = image.size
    scale = rng.uniform(0.5, 1.0)
    cw, ch = int(w * scale), int(h * scale)
    left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    image = image.resize((IMG, IMG), Image.BILINEAR, box=(left, top, left + cw, top + ch))
    pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
    if rng.random() < 0.5:
        pixels = pixels[:, :, ::-1]
    tokens = wordpiece(raw.texts[index % len(raw.texts)], raw.vocab)
    return np.ascontiguousarray(pixels), tokens


def make_batch_table(raw: RawData, first: int, batch: int) -> pa.Table:
    ids, images, tokens = [], [], []
    for i in range(first, first + batch):
        img, tok = preprocess(raw, i)
        ids.append(i)
        images.append(img.tobytes())
        tokens.append(tok)
    flat = pa.array(np.concatenate(tokens), pa.int32())
    offsets = pa.array(np.arange(0, (batch + 1) * SEQ, SEQ, dtype=np.int32))
    return pa.table({"sample_id": pa.array(ids, pa.int64()), "image": pa.array(images, pa.binary()),
                     "tokens": pa.ListArray.from_arrays(offsets, flat)}, schema=SCHEMA)


# ------------------------------------------------------------------------------------------------ feeds


class MapDataset:
    """A map-style torch dataset over the raw data (``torch.utils.data.Dataset`` protocol)."""

    def __init__(self, raw: RawData, length: int) -> None:
        self.raw, self.length = raw, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        img, tok = preprocess(self.raw, index)
        return {"sample_id": index, "image": torch.from_numpy(img), "tokens": torch.from_numpy(tok)}


def lake_collate(shard: Any) -> dict[str, Any]:
    """StepShard -> the same tensors the DataLoader's default collate produces."""
    import torch

    table = shard.table
    n = table.num_rows
    image = table.column("image").combine_chunks()
    offs = np.frombuffer(image.buffers()[1], np.int32, count=n + 1, offset=image.offset * 4)
    pixels = np.frombuffer(image.buffers()[2], np.uint8)[offs[0]:offs[-1]].reshape(n, 3, IMG, IMG)
    tokens = table.column("tokens").combine_chunks()
    values = tokens.values.to_numpy(zero_copy_only=False)[tokens.offsets[0].as_py():tokens.offsets[-1].as_py()]
    return {"sample_id": torch.from_numpy(table.column("sample_id").to_numpy().copy()),
            "image": torch.from_numpy(pixels.copy()), "tokens": torch.from_numpy(values.reshape(n, SEQ).copy()),
            "step": shard.step}


def producer_main(root: str, idx: int, producers: int, quota: int, batch: int, raw: RawData, out: Any,
                  hold: tuple[int, Any] | None = None) -> None:
    """Producer ``prep-idx``: its seq ``s`` is global batch ``s * producers + idx``; resumes from the table's next_seq.

    ``hold=(seq, held)``: the failure run's victim. Before preparing batch ``seq`` it sets the event ``held`` and waits
    to be killed, so the kill always lands on a live worker with work left (a worker that already finished its quota
    would be no failure at all, and its pid may be gone: the forkserver reaps its children).
    """
    try:
        from lakestream_iceberg import Stream

        stream = Stream.open(sqlite_catalog(root), NAME)
        producer = stream.producer(f"prep-{idx}")
        seq = producer.next_seq
        gc.freeze()  # set up: what it holds stays out of full collections (docs/guide/producers.md)
        first_seq = seq
        started = time.monotonic()
        prep_s = 0.0
        while seq < quota:
            if hold is not None and seq == hold[0]:
                hold[1].set()
                time.sleep(3600)  # the parent kills this process; it never wakes up in a run that works
            t0 = time.monotonic()
            table = make_batch_table(raw, (seq * producers + idx) * batch, batch)
            prep_s += time.monotonic() - t0
            producer.commit([table], seq=seq)
            seq += 1
        out.put({"idx": idx, "first_seq": first_seq, "batches": seq - first_seq, "prep_s": prep_s,
                 "wall_s": time.monotonic() - started})
    except BaseException:  # noqa: BLE001 - report to the parent
        out.put({"idx": idx, "error": traceback.format_exc()})


# ------------------------------------------------------------------------------------------------ the training loop


class ChildExitGuard:
    """Confines torch's "DataLoader worker is killed" error to the training loop that handles it.

    A ``DataLoader`` with workers installs a SIGCHLD handler (``torch.utils.data._utils.signal_handling``) that raises
    ``RuntimeError`` once per iterator when a child exits while one of the iterator's workers is dead and not yet
    reaped. Python runs it in the main thread between two bytecodes of whatever code runs then, so the benchmark's
    deliberate worker kill can surface anywhere: the worker's death also reaches the loop through the data path (the
    batch it was handing over by file descriptor fails with ``EOFError``/``ConnectionResetError`` as soon as its files
    are closed, before it is a zombie), the loop stops on that error, and the handler's one raise then lands after the
    loop (e.g. in ``resource.getrusage``). This guard wraps torch's handler: it lets it raise only while ``armed`` (the
    training loop's ``try``), disarms itself as it raises (so the loop's ``except`` cannot be interrupted by a second
    one), and outside the loop records the error in ``outside`` instead.
    """

    def __init__(self) -> None:
        self.armed = False
        self.outside: list[str] = []
        self._inner: Any = None

    def install(self) -> None:
        """Wrap the current SIGCHLD handler (torch's, once a DataLoader iterator started workers); idempotent."""
        current = signal.getsignal(signal.SIGCHLD)
        if current == self._handle or not callable(current):
            return
        self._inner = current
        signal.signal(signal.SIGCHLD, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        try:
            self._inner(signum, frame)
        except Exception as exc:  # noqa: BLE001 - torch's "worker ... is killed by signal"
            if self.armed:
                self.armed = False
                raise
            self.outside.append(f"{type(exc).__name__}: {exc}")


CHILD_EXIT = ChildExitGuard()


def compute(seconds: float, kind: str) -> None:
    if kind == "sleep":
        time.sleep(seconds)
        return
    import torch

    a = torch.ones(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = (a @ a).clamp_(-1, 1)


def train(batches: Any, *, steps: int, warmup: int, compute_s: float, compute_kind: str,
          on_step: Any = None) -> dict[str, Any]:
    """Run ``steps`` steps; per step: wait for the batch (data time), touch it, compute."""
    it = iter(batches)
    CHILD_EXIT.install()  # after iter(): a DataLoader iterator with workers installs torch's SIGCHLD handler there
    data_s: list[float] = []
    step_end: list[float] = []
    seen: list[int] = []
    error = None
    error_at = None
    t_start = time.monotonic()
    cpu0 = cpu_s()
    t_first = None
    try:
        try:
            CHILD_EXIT.armed = True  # a worker's death may surface as an exception only from here ...
            for step in range(steps):
                if on_step is not None:
                    on_step(step, it)
                t0 = time.monotonic()
                try:
                    item = next(it)
                except StopIteration:
                    error = f"data ran out after {step} steps"
                    break
                images, tokens = item["image"], item["tokens"]
                checksum = int(images[:, 0, 0, 0].sum()) + int(tokens[:, 0].sum())  # the trainer touches the data
                del checksum
                seen.extend(int(i) for i in item["sample_id"])
                t1 = time.monotonic()
                if t_first is None:
                    t_first = t1 - t_start
                data_s.append(t1 - t0)
                compute(compute_s, compute_kind)
                step_end.append(time.monotonic())
        finally:
            CHILD_EXIT.armed = False  # ... to here (a raise in this finally still reaches the except below)
    except Exception as exc:  # noqa: BLE001 - a data-feed failure ends training (data path or SIGCHLD handler)
        error = f"{type(exc).__name__}: {(str(exc).splitlines() or [repr(exc)])[0][:300]}"  # EOFError() has no message
        error_at = time.monotonic()
    cpu = cpu_s() - cpu0
    done = len(step_end)
    steady = data_s[warmup:]
    wall = (step_end[-1] - step_end[warmup - 1]) if done > warmup else math.nan
    return {
        "steps_done": done,
        "error": error,
        "error_at": error_at,
        "first_batch_s": t_first,
        "steps_per_s": (done - warmup) / wall if done > warmup else math.nan,
        "data_ms_mean": 1000 * sum(steady) / len(steady) if steady else math.nan,
        "data_ms_p50": 1000 * percentile(steady, 50),
        "data_ms_p99": 1000 * percentile(steady, 99),
        "data_ms_max": 1000 * max(steady) if steady else math.nan,
        "stall_fraction": sum(steady) / wall if done > warmup else math.nan,
        "trainer_cpu_ms_per_step": 1000 * cpu / max(1, done),
        "unique_samples": len(set(seen)),
        "loadavg_1m_after": os.getloadavg()[0],
        "samples": len(seen),
        "data_s": data_s,
        "step_end": step_end,
    }


# ------------------------------------------------------------------------------------------------ runs


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="vs_colocated-"))
        t = time.monotonic()
        self.raw = RawData(args.raw_images, args.raw_texts)
        self.raw_build_s = time.monotonic() - t

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def train_kw(self) -> dict[str, Any]:
        return {"warmup": self.args.warmup, "compute_s": self.args.compute_ms / 1000, "compute_kind": self.args.compute}

    def prep_cost(self) -> dict[str, float]:
        """Single-core preprocessing cost of one batch, measured here (the budget every feed must meet)."""
        n = max(2, self.args.batch // 4)
        t = time.perf_counter()
        for i in range(n):
            preprocess(self.raw, 10_000 + i)
        per_sample = (time.perf_counter() - t) / n
        return {"per_sample_ms": per_sample * 1000, "per_batch_ms": per_sample * self.args.batch * 1000}

    # -- (a) colocated ------------------------------------------------------------------------------------------------
    def loader(self, workers: int, steps: int) -> Any:
        import torch

        return torch.utils.data.DataLoader(MapDataset(self.raw, steps * self.args.batch), batch_size=self.args.batch,
                                           num_workers=workers, prefetch_factor=2 if workers else None,
                                           multiprocessing_context="fork" if workers else None)

    def colocated(self, workers: int) -> dict[str, Any]:
        result = train(self.loader(workers, self.args.steps), steps=self.args.steps, **self.train_kw())
        result.update(feed=f"colocated DataLoader num_workers={workers}", workers=workers)
        return result

    def colocated_failure(self) -> dict[str, Any]:
        kill_step = self.args.kill_step
        killed: dict[str, Any] = {}

        def on_step(step: int, it: Any) -> None:
            if step == kill_step and not killed:
                pid = it._workers[0].pid  # noqa: SLF001 - the benchmark plays the OOM killer
                os.kill(pid, signal.SIGKILL)
                killed.update(pid=pid, at=time.monotonic())

        workers = self.args.workers[-1]
        result = train(self.loader(workers, self.args.fail_steps), steps=self.args.fail_steps, on_step=on_step,
                       **self.train_kw())
        ended = result["error_at"] or (result["step_end"][-1] if result["step_end"] else math.nan)
        result.update(feed=f"colocated DataLoader num_workers={workers}, worker 0 killed at step {kill_step}",
                      kill_step=kill_step, seconds_from_kill_to_end=ended - killed.get("at", math.nan),
                      training_survived=result["steps_done"] == self.args.fail_steps and result["error"] is None)
        return result

    # -- (b) lakestream ------------------------------------------------------------------------------------------------
    def new_stream(self, label: str) -> str:
        from lakestream_iceberg import Stream

        root = self.tmp / label
        (root / "warehouse").mkdir(parents=True)
        catalog = sqlite_catalog(str(root))
        Stream.create(catalog, NAME, schema=SCHEMA, world_size=1)
        catalog.engine.dispose()
        return str(root)

    def start_producers(self, root: str, quota: int, out: Any, only: list[int] | None = None,
                        hold: tuple[int, Any] | None = None) -> list[Any]:
        """Start producer processes; ``hold`` (see ``producer_main``) goes to the first one started."""
        procs = []
        for idx in (only if only is not None else range(self.args.producers)):
            proc = CTX.Process(target=producer_main, args=(root, idx, self.args.producers, quota, self.args.batch, self.raw, out,
                                                           hold if not procs else None),
                               daemon=True)
            proc.start()
            procs.append(proc)
        return procs

    def dataset(self, root: str, *, follow: bool) -> Any:
        from lakestream_iceberg import Stream
        from lakestream_iceberg.read.dataset import LakestreamDataset

        stream = Stream.open(sqlite_catalog(root), NAME)
        return LakestreamDataset(stream, rank=0, world_size=1, follow=follow, timeout=120.0, prefetch=2, poll_s=0.01,
                                 max_poll_s=0.05, collate=lake_collate)

    def collect(self, out: Any, n: int, timeout: float) -> list[dict[str, Any]]:
        return collect_reports(out, n, timeout_s=timeout, what="producer")

    def lake_prefilled(self) -> dict[str, Any]:
        root = self.new_stream("prefilled")
        quota = math.ceil(self.args.steps / self.args.producers)
        out = CTX.Queue()
        t = time.monotonic()
        procs = self.start_producers(root, quota, out)
        try:
            reports = self.collect(out, len(procs), timeout=600)
        finally:
            kill_all(procs)
        prefill_s = time.monotonic() - t
        result = train(self.dataset(root, follow=False), steps=self.args.steps, **self.train_kw())
        result.update(feed=f"lakestream, prefilled by {self.args.producers} producer processes", prefill_s=prefill_s,
                      producer_prep_s=sum(r["prep_s"] for r in reports),
                      producer_batches=sum(r["batches"] for r in reports))
        shutil.rmtree(root, ignore_errors=True)
        return result

    def lake_concurrent(self, *, fail: bool = False) -> dict[str, Any]:
        steps = self.args.fail_steps if fail else self.args.steps
        root = self.new_stream("failure" if fail else "concurrent")
        quota = math.ceil(steps / self.args.producers)
        out = CTX.Queue()
        held = CTX.Event()
        hold_seq = quota // 2  # the victim commits batches 0..hold_seq-1 (none when its quota is 1), then waits for the kill
        procs = self.start_producers(root, quota, out, hold=(hold_seq, held) if fail else None)
        events: dict[str, Any] = {}

        def restart() -> None:
            procs.extend(self.start_producers(root, quota, out, only=[0]))
            events["restart_at"] = time.monotonic()

        def on_step(step: int, it: Any) -> None:
            if fail and step == self.args.kill_step and "kill_at" not in events:
                # Wait for observed progress: the victim has committed its first hold_seq batches and is alive.
                deadline = time.monotonic() + 600
                while not held.wait(0.5):
                    if not procs[0].is_alive():
                        raise RuntimeError(f"producer prep-0 exited (code {procs[0].exitcode}) before the kill")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"producer prep-0 did not commit its first {hold_seq} batches in 600 s")
                procs[0].kill()
                procs[0].join(60)
                events["kill_at"] = time.monotonic()
                events["victim_exitcode"] = procs[0].exitcode
                timer = threading.Timer(self.args.restart_after_s, restart)
                timer.daemon = True
                timer.start()
                events["timer"] = timer

        try:
            result = train(self.dataset(root, follow=True), steps=steps, on_step=on_step, **self.train_kw())
            reports = self.collect(out, self.args.producers, timeout=120)
        finally:
            if "timer" in events:
                events["timer"].join(30)
            kill_all(procs)
        label = f"lakestream, {self.args.producers} producer processes concurrent with the trainer"
        if fail:
            kill_at, restart_at = events.get("kill_at", math.nan), events.get("restart_at", math.nan)
            ends = np.array(result["step_end"])
            data = np.array(result["data_s"])
            during = data[(ends > kill_at) & (ends <= (restart_at if not math.isnan(restart_at) else math.inf))]
            before = ends[ends <= kill_at]
            after = ends[ends > kill_at]
            result.update(
                kill_step=self.args.kill_step,
                victim_exitcode=events.get("victim_exitcode"),
                victim_batches_before_kill=hold_seq,
                restart_after_s=self.args.restart_after_s,
                restarted_producer=next((r for r in reports if r["idx"] == 0), None),
                steps_while_producer_down=int(len(during)),
                data_ms_max_while_down=float(during.max() * 1000) if len(during) else math.nan,
                steps_per_s_before_kill=float((len(before) - 1) / (before[-1] - before[0])) if len(before) > 1 else math.nan,
                steps_per_s_after_kill=float((len(after) - 1) / (after[-1] - after[0])) if len(after) > 1 else math.nan,
                training_survived=result["steps_done"] == steps and result["error"] is None,
            )
            label += (f", prep-0 killed at step {self.args.kill_step} with {quota - hold_seq} of its {quota} batches left, "
                      f"restarted {self.args.restart_after_s:.0f} s later")
        result.update(feed=label, producer_batches=sum(r["batches"] for r in reports))
        shutil.rmtree(root, ignore_errors=True)
        return result


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = bench_parser(__doc__, out=RESULTS_DIR / "vs_colocated.json")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 150)")
    ap.add_argument("--batch", type=int, default=None, help="samples per step (default 64)")
    ap.add_argument("--compute-ms", type=float, default=None, help="compute time per step (default 50)")
    ap.add_argument("--compute", choices=["sleep", "matmul"], default="sleep")
    ap.add_argument("--workers", default=None, help="DataLoader num_workers values (default 1,2)")
    ap.add_argument("--producers", type=int, default=2, help="lakestream producer processes (default 2)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    fill_defaults(args, steps=(150, 12), batch=(64, 8), compute_ms=(50.0, 20.0), workers=("1,2", "2"))  # smoke: one colocated run
    args.workers = int_list(args.workers)
    args.warmup = 2 if smoke else 5
    args.fail_steps = 16 if smoke else 120
    args.kill_step = 6 if smoke else 30
    args.restart_after_s = 1.0 if smoke else 3.0
    args.raw_images, args.raw_texts = (8, 8) if smoke else (64, 64)
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    torch.set_num_threads(1)
    args = parse_args(argv)
    run = Run("vs_colocated", smoke=args.smoke)
    CTX.set_forkserver_preload(FORKSERVER_PRELOAD)
    multiprocessing.forkserver.ensure_running()  # boots (imports) now, not inside the first timed producer start
    bench = Bench(args)
    runs: list[dict[str, Any]] = []
    try:
        cost = bench.prep_cost()
        print(f"vs_colocated: batch {args.batch}, {args.steps} steps, compute {args.compute_ms:.0f} ms ({args.compute}); "
              f"preprocessing {cost['per_sample_ms']:.2f} ms/sample = {cost['per_batch_ms']:.0f} ms/batch on one core"
              f"{' [smoke]' if args.smoke else ''}", flush=True)
        for workers in args.workers:
            runs.append(bench.colocated(workers))
            _progress(runs[-1])
        runs.append(bench.lake_prefilled())
        _progress(runs[-1])
        runs.append(bench.lake_concurrent())
        _progress(runs[-1])
        fail_colocated = bench.colocated_failure()
        _progress(fail_colocated)
        fail_lake = bench.lake_concurrent(fail=True)
        _progress(fail_lake)
    finally:
        bench.close()

    best_colocated = max((r for r in runs if r.get("workers") is not None), key=lambda r: r["steps_per_s"])
    table = Table(f"trainer side, {args.steps} steps of {args.batch} samples, {args.compute_ms:.0f} ms compute/step "
                  f"({args.compute}); first {args.warmup} steps excluded; ratio = steps/s over the best colocated run",
                  ["feed", "steps/s", "data ms/step mean", "data ms p99", "stall fraction", "trainer CPU ms/step",
                   "first batch s", "ratio"])
    for r in runs:
        table.add(r["feed"], r["steps_per_s"], r["data_ms_mean"], r["data_ms_p99"], r["stall_fraction"],
                  r["trainer_cpu_ms_per_step"], r["first_batch_s"], r["steps_per_s"] / best_colocated["steps_per_s"])
    prefilled = next(r for r in runs if "prefilled" in r["feed"])
    table.note(f"ideal (compute only): {1000 / args.compute_ms:.2f} steps/s. Preprocessing costs {cost['per_batch_ms']:.0f} ms "
               f"per batch on one core; this machine has {os.cpu_count()} cores, shared by the trainer, the workers or "
               f"producers, and other processes.")
    table.note(f"prefilled: the {args.producers} producers spent {prefilled['prefill_s']:.1f} s of wall time before training "
               "started (not in steps/s); on 2 cores the concurrent rows are the like-for-like comparison.")
    ftable = Table(f"failure isolation: a preprocessing worker is killed (SIGKILL) at step {args.kill_step} of {args.fail_steps}",
                   ["feed", "training survived?", "steps done", "what the trainer saw", "steps/s",
                    "max data ms while the killed worker was down"])
    ftable.add(fail_colocated["feed"], "YES" if fail_colocated["training_survived"] else "NO", fail_colocated["steps_done"],
               fail_colocated["error"] or "nothing", fail_colocated["steps_per_s"], math.nan)
    restarted = fail_lake.get("restarted_producer") or {}
    ftable.add(fail_lake["feed"], "YES" if fail_lake["training_survived"] else "NO", fail_lake["steps_done"],
               fail_lake["error"] or (f"{fail_lake['steps_while_producer_down']} steps fed by prep-1 alone while prep-0 was "
                                      f"down; prep-0 resumed at seq {restarted.get('first_seq')}"),
               fail_lake["steps_per_s"], fail_lake["data_ms_max_while_down"])
    ftable.note(f"colocated: the error reached the training loop {fail_colocated['seconds_from_kill_to_end']:.2f} s after the "
                "kill; the DataLoader iterator is dead and the epoch's position is lost (restart from a checkpoint).")
    ftable.note(f"lakestream: steps/s {fail_lake['steps_per_s_before_kill']:.2f} before the kill, "
                f"{fail_lake['steps_per_s_after_kill']:.2f} after; unique samples {fail_lake['unique_samples']} of "
                f"{fail_lake['samples']} delivered (no batch lost or repeated).")
    strip = ("data_s", "step_end")
    run.finish([table, ftable], {
        "config": {k: getattr(args, k) for k in ("steps", "batch", "compute_ms", "compute", "workers", "producers", "warmup",
                                                 "fail_steps", "kill_step", "restart_after_s", "raw_images", "raw_texts")},
        "machine": machine(),
        "preprocessing": {**cost, "image": f"JPEG 384x384 -> random-resized-crop -> 3x{IMG}x{IMG} uint8",
                          "text": f"~250 words -> regex + WordPiece over {len(bench.raw.vocab)} pieces -> {SEQ} int32"},
        "runs": [{k: v for k, v in r.items() if k not in strip} for r in runs],
        "failure": {"colocated": {k: v for k, v in fail_colocated.items() if k not in strip},
                    "lakestream": {k: v for k, v in fail_lake.items() if k not in strip}},
        "sigchld_errors_outside_training_loop": CHILD_EXIT.outside,
    }, out=args.out)
    return 0


def _progress(r: dict[str, Any]) -> None:
    print(f"  {r['feed']}: {r['steps_per_s']:.2f} steps/s, data {r['data_ms_mean']:.1f} ms/step, "
          f"stall {r['stall_fraction']:.2f}{', ERROR ' + r['error'] if r.get('error') else ''}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
