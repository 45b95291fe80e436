"""The Ray Data sink on a multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head and two worker raylets on
this machine, each with its own logical CPUs), one worker node removed while the job runs, and a Ray Train job on the
same cluster following the stream: it starts from a stream checkpoint tag, fails once and is restarted by Ray Train
from its last Ray checkpoint (the training guide's loop), and tags the last step when done.

The head node holds the trainers (custom resource ``trainer``), the two worker nodes the Ray Data tasks (custom
resource ``data``), so removing a worker node kills write tasks and never a trainer. Nothing waits for a fixed time:
the victim task reports its node once a step of it is published, the test removes that node, and the job's later rows
wait until a trainer follows the stream (the trainer follows a job that is still writing).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from lakestream_iceberg import Stream  # noqa: E402
from lakestream_iceberg.integrations.ray import LakestreamDatasink  # noqa: E402
from tests.integrations.test_ray import (  # noqa: E402
    BOUND_S,
    SCHEMA,
    _data_context,
    _rows,
    _step_ids,
    _stop_leftover_workers,
    worker_environment,
)
from tests.support import sqlite_catalog  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BLOCKS, ROWS, PER_STEP = 6, 16, 4  # 6 write tasks of 4 steps each: 24 steps
STEPS = BLOCKS * ROWS // PER_STEP
FAIL_AFTER = 5  # the trainer's first attempt fails after this step (odd: its last Ray checkpoint is the step before)


@pytest.fixture
def three_nodes() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    # a removed node is noticed within about a second (Ray's default health check: 3 s x 5 failures)
    fast_failure = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    with worker_environment():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"trainer": 2},
                                                                "include_dashboard": False, "_system_config": fast_failure})
        # Cluster writes its address to /tmp/ray/ray_current_cluster, where any ray.init() on this machine (another
        # test run's, a benchmark's) would find it and join this cluster: this test connects by address, so remove it
        ray._common.utils.reset_ray_address()
        workers = [cluster.add_node(num_cpus=2, resources={"data": 2}) for _ in range(2)]
        raylets: set[str] = set()
        try:
            cluster.wait_for_nodes(timeout=BOUND_S)
            ray.init(address=cluster.address, configure_logging=False, log_to_driver=True)
            for node in [cluster.head_node, *workers]:
                raylets |= {str(p.process.pid) for p in node.all_processes.get("raylet", [])}
            yield cluster, workers
        finally:
            ray.shutdown()
            cluster.shutdown()
            _stop_leftover_workers(raylets)


def _node_task(batch: pa.Table, marks: str, victim_id: int, gate_from: int, per_step: int) -> Iterator[pa.Table]:
    """Each block as steps of rows. The block holding ``victim_id``, on its first attempt, reports its node after its
    first step was published and waits for the node to be removed; rows from ``gate_from`` on wait until a trainer
    follows the stream (so the job is still writing while it does)."""
    ids = batch.column("id")
    first = ids[0].as_py()
    victim = first <= victim_id <= ids[-1].as_py() and not os.path.exists(os.path.join(marks, "removing"))
    for start in range(0, batch.num_rows, per_step):
        if start and victim:
            Path(marks, "victim.tmp").write_text(json.dumps({"node": ray.get_runtime_context().get_node_id()}))
            os.replace(os.path.join(marks, "victim.tmp"), os.path.join(marks, "victim"))
            deadline = time.monotonic() + BOUND_S
            while time.monotonic() < deadline:  # its node is removed: this process dies with its raylet
                time.sleep(0.05)
            raise TimeoutError("the test did not remove this task's node")
        if first + start >= gate_from:
            deadline = time.monotonic() + BOUND_S
            while not os.path.exists(os.path.join(marks, "trainer-follows")):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no trainer followed the stream within {BOUND_S}s")
                time.sleep(0.05)
        yield batch.slice(start, per_step)


def _train_loop(config: dict[str, Any]) -> None:
    """A trainer of 2 ranks reading the stream in follow mode from a stream checkpoint tag (``resume``) up to
    ``end_step``; rank 0 tags ``end_step`` once both ranks are done. With ``fail_after``, it is also the training
    guide's Ray Train loop (docs/guide/training.md): the dataset's position travels in the Ray checkpoint reported
    every second step (with the model's, in the guide), a restarted loop resumes from the one Ray hands back, and the
    first attempt fails after step ``fail_after``. Each attempt writes the items it read, one JSON line each."""
    import tempfile

    import ray.train
    import torch.distributed as dist
    from ray.train import Checkpoint

    from lakestream_iceberg.integrations.ray import ray_train_dataset

    stream = config["stream"]
    context = ray.train.get_context()
    rank = context.get_world_rank()

    def collate(shard: Any) -> dict[str, Any]:
        return {"step": shard.step, "ids": shard.table.column("id").to_pylist(), "world_size": shard.world_size}

    dataset = ray_train_dataset(stream, checkpoint=config["resume"], end_step=config["end_step"], collate=collate,
                                timeout=BOUND_S)
    restored = ray.train.get_checkpoint()
    if restored is not None:  # the config is the first attempt's: Ray's checkpoint, not config["resume"], says where
        with restored.as_directory() as folder:
            dataset.load_state_dict(json.loads(Path(folder, "data.json").read_text()))
    attempt = "retry" if restored is not None else "first"
    if rank == 0 and not os.path.exists(config["gate"]):  # not at its first item: the trainer starts after a tag, and
        Path(config["gate"]).write_text(attempt)          # the steps after it may wait for a slot the gated tasks hold
    for item in dataset:
        with Path(config["out"], f"rank{rank}-{config['name']}-{attempt}.jsonl").open("a") as trained:
            trained.write(json.dumps(item) + "\n")
        if config["fail_after"] is not None and item["step"] % 2 == 0:
            with tempfile.TemporaryDirectory() as folder:
                if rank == 0:
                    Path(folder, "data.json").write_text(json.dumps(dataset.state_dict()))
                ray.train.report({"step": item["step"]},
                                 checkpoint=Checkpoint.from_directory(folder) if rank == 0 else None)
        if item["step"] == config["fail_after"] and restored is None:
            # Ray Train takes each rank's reports from a one-slot queue it polls, and keeps a checkpoint once every
            # rank's report of it was polled: a rank that fails first could be seen failing before a slower rank's
            # checkpoint report was polled, and the retry then started from no checkpoint. Each report waits at a
            # barrier of all ranks and for the rank's previous report to be polled: after two more reports, every
            # rank's report of the last checkpoint was.
            for _ in range(2):
                ray.train.report({"step": item["step"]})
            raise RuntimeError(f"the first attempt fails after step {item['step']}")
    dist.barrier()  # both ranks are done with end_step before the checkpoint tag marks it
    if rank == 0 and config["checkpoint"]:
        stream.checkpoint(config["checkpoint"], step=config["end_step"])


@pytest.mark.slow
def test_sink_on_three_nodes_survives_a_removed_node_and_ray_train_follows(three_nodes: Any, tmp_path: Path) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cluster, workers = three_nodes
    catalog = sqlite_catalog(str(tmp_path))
    stream = Stream.create(catalog, "ns.nodes", schema=SCHEMA, world_size=2)
    marks = tmp_path / "marks"
    marks.mkdir()
    _data_context()
    victim_id, gate_from = 0, 3 * ROWS  # the first block's task is the victim; blocks 3.. wait for a trainer
    dataset = ray.data.from_arrow([_rows(b * ROWS, ROWS) for b in range(BLOCKS)]).map_batches(
        _node_task, fn_kwargs={"marks": str(marks), "victim_id": victim_id, "gate_from": gate_from, "per_step": PER_STEP},
        batch_format="pyarrow", batch_size=None, resources={"data": 1})
    sink = LakestreamDatasink(catalog=catalog, stream="ns.nodes", run_name="nodes", rows_per_step=PER_STEP)
    outcome: dict[str, Any] = {}

    def job() -> None:
        try:
            dataset.write_datasink(sink, ray_remote_args={"resources": {"data": 1}})  # as the map's: fused
        except BaseException as exc:  # reported by the main thread
            outcome["error"] = exc

    writer = threading.Thread(target=job, daemon=True)
    writer.start()
    deadline = time.monotonic() + BOUND_S
    while not (marks / "victim").exists():
        assert writer.is_alive() and time.monotonic() < deadline, outcome.get("error", "no victim reported its node")
        time.sleep(0.05)
    node_id = json.loads((marks / "victim").read_text())["node"]
    victim_node = next(n for n in workers if n.node_id == node_id)
    assert (stream.refresh().head_step() or 0) >= 1  # a step of the victim task is out: it dies mid-task
    (marks / "removing").touch()  # the retry runs through
    cluster.remove_node(victim_node, allow_graceful=False)

    # the trainer resumes after a stream checkpoint tag the test makes at step 1; its first attempt fails after step
    # FAIL_AFTER and Ray Train restarts the loop, which resumes after Ray's last checkpoint (step FAIL_AFTER - 1)
    stream.checkpoint("start", step=1)
    config = {"stream": stream, "resume": "start", "end_step": STEPS, "gate": str(marks / "trainer-follows"),
              "out": str(tmp_path), "name": "follow", "checkpoint": "trained", "fail_after": FAIL_AFTER}
    TorchTrainer(_train_loop, train_loop_config=config, torch_config=TorchConfig(backend="gloo"),
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                              resources_per_worker={"CPU": 1, "trainer": 1}),
                 run_config=RunConfig(name="follow", storage_path=str(tmp_path / "ray_results"),
                                      failure_config=FailureConfig(max_failures=1))).fit()
    writer.join(BOUND_S)
    assert not writer.is_alive() and "error" not in outcome, outcome.get("error")

    stream.refresh()
    assert stream.head_step() == STEPS  # dense: no gap, nothing twice
    assert sink.report is not None and sink.report.steps == list(range(1, STEPS + 1)) and sink.report.fused is True
    everything = sorted(i for s in range(1, STEPS + 1) for rank in _step_ids(stream, s) for i in rank)
    assert everything == list(range(BLOCKS * ROWS))  # every row once
    assert (marks / "trainer-follows").read_text() == "first"  # the job's gated rows waited for the first attempt
    assert {c.name: c.step for c in stream.checkpoints()}["trained"] == STEPS  # rank 0 tagged the last step once both ranks were done

    def read(name: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]

    for rank in (0, 1):
        first, retry = read(f"rank{rank}-follow-first.jsonl"), read(f"rank{rank}-follow-retry.jsonl")
        # after the tag, none missed; then step FAIL_AFTER, unless the failing rank's teardown stopped this one before it
        assert [i["step"] for i in first][:2] == [2, 3]
        # the restarted loop resumes after Ray's last checkpoint (as the model restored from it), not at the tag
        assert [i["step"] for i in retry] == list(range(FAIL_AFTER, STEPS + 1))
        for item in first + retry:
            assert item["world_size"] == 2
            assert item["ids"] == stream.read(item["step"], rank=rank).column("id").to_pylist()  # its partition, exactly
