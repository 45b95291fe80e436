"""The Ray Data sink on a multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head and two worker raylets on
this machine, each with its own logical CPUs), one worker node removed while the job runs, and a Ray Train job on the
same cluster following the stream.

The head node holds the trainers (custom resource ``trainer``), the two worker nodes the Ray Data tasks (custom
resource ``data``), so removing a worker node kills write tasks and never a trainer. Nothing waits for a fixed time:
the victim task reports its node once a step of it is published, the test removes that node, and the job's later rows
wait until a trainer has read a step (the trainer follows a job that is still writing).
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
    has read a step."""
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
            while not os.path.exists(os.path.join(marks, "trainer-saw-a-step")):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no trainer saw a step within {BOUND_S}s")
                time.sleep(0.05)
        yield batch.slice(start, per_step)


def _follow(config: dict[str, Any]) -> None:
    import ray.train

    from lakestream_iceberg.integrations.ray import ray_train_dataset

    rank = ray.train.get_context().get_world_rank()
    dataset = ray_train_dataset(config["stream"], end_step=config["steps"], timeout=BOUND_S,
                                collate=lambda shard: (shard.step, shard.table.column("id").to_pylist()))
    got = []
    for item in dataset:
        got.append(item)
        if rank == 0 and not os.path.exists(config["gate"]):
            Path(config["gate"]).write_text(str(item[0]))
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(got))


@pytest.mark.slow
def test_sink_on_three_nodes_survives_a_removed_node_and_ray_train_follows(three_nodes: Any, tmp_path: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
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
    started = time.monotonic()
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

    TorchTrainer(_follow, train_loop_config={"stream": stream, "steps": STEPS, "gate": str(marks / "trainer-saw-a-step"),
                                             "out": str(tmp_path)},
                 torch_config=TorchConfig(backend="gloo"),
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                              resources_per_worker={"CPU": 1, "trainer": 1}),
                 run_config=RunConfig(name="follow", storage_path=str(tmp_path / "ray_results"))).fit()
    writer.join(BOUND_S)
    assert not writer.is_alive() and "error" not in outcome, outcome.get("error")
    elapsed = time.monotonic() - started

    stream.refresh()
    assert stream.head_step() == STEPS  # dense: no gap, nothing twice
    assert sink.report is not None and sink.report.steps == list(range(1, STEPS + 1)) and sink.report.fused is True
    everything = sorted(i for s in range(1, STEPS + 1) for rank in _step_ids(stream, s) for i in rank)
    assert everything == list(range(BLOCKS * ROWS))  # every row once
    assert int((marks / "trainer-saw-a-step").read_text()) >= 1
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [step for step, _ in seen] == list(range(1, STEPS + 1))  # every step, in order, once
        for step, ids in seen:
            assert ids == stream.read(step, rank=rank).column("id").to_pylist()
    assert elapsed < BOUND_S
