"""Driver-side task progress (statebackend/spark/progress.py) on a real local Spark.

The case that matters: adaptive execution runs a shuffle's map side as a job of its
own; when that job has as many tasks as there are subtasks it must not pass for the
subtasks. Each map task leaves a marker file when it ends, so the test knows, at the
moment the "subtasks" phase starts, whether the input stage had really finished.
"""

from __future__ import annotations

import functools
import os
import sys
import time

from statebackend.spark.progress import TaskStages, report_tasks

TASKS = 4


class Recorder:
    """A ProgressSink that notes each call, and how many map tasks had ended by then."""

    mode = "lines"

    def __init__(self, markers: str) -> None:
        self.markers = markers
        self.calls: list[tuple] = []

    def phase(self, label: str, total: int | None = None, unit: str = "") -> None:
        self.calls.append(("phase", label, total, unit, len(os.listdir(self.markers))))

    def advance(self, n: int = 1) -> None:
        self.calls.append(("advance", n))


def _map_side(markers: str, batches):
    import pyarrow as pa  # noqa: F401 - batches are Arrow record batches
    from pyspark import TaskContext

    for batch in batches:
        time.sleep(1.0)
        yield batch
    open(os.path.join(markers, str(TaskContext.get().partitionId())), "w").close()


def _subtask(batches):
    for batch in batches:
        time.sleep(0.5)
        yield batch


def test_subtasks_are_counted_only_once_their_stage_runs(spark, tmp_path):
    from pyspark import cloudpickle

    # This test module is not importable on the workers: ship its functions by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    markers = str(tmp_path / "markers")
    os.makedirs(markers)
    assert spark.conf.get("spark.sql.adaptive.enabled") == "true"  # the case under test
    source = spark.range(0, TASKS, 1, TASKS).mapInArrow(
        functools.partial(_map_side, markers), "id long")
    df = source.repartition(TASKS, "id").mapInArrow(_subtask, "id long")
    sink = Recorder(markers)
    with report_tasks(spark, sink, TaskStages("subtasks", total=TASKS, stages=2,
                                              upstream="reading input"), interval=0.05):
        rows = df.collect()
    assert sorted(r["id"] for r in rows) == list(range(TASKS))

    phases = [c for c in sink.calls if c[0] == "phase"]
    assert [p[1] for p in phases] == ["reading input", "subtasks"], phases
    assert phases[0][2:4] == (TASKS, "tasks")
    # the subtasks phase starts after every map task ended, and counts each subtask once
    assert phases[1][2:] == (TASKS, "subtasks", TASKS)
    after = sink.calls[sink.calls.index(phases[1]) + 1:]
    assert [c[0] for c in after] == ["advance"] * len(after)
    assert sum(c[1] for c in after) == TASKS
