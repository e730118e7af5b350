"""Where a run's time goes (issue 24, deliverable 4): the summary's ``time_split``.

The split is pure arithmetic over the task windows (checked on synthetic windows,
including clock skew), and on real runs of both engines its parts are never negative
and add up to the run's duration.
"""

from __future__ import annotations

import pytest

from statebackend.job import RunConfig, run_job
from statebackend.job.results import TaskResult
from statebackend.job.summary import TIME_SPLIT_KEYS, RunTimeline
from tests.evolution.card_spend import VERSIONS, events


def _result(subtask: int, window: tuple[float, float]) -> TaskResult:
    return TaskResult(subtask=subtask, attempt=0, handle=None, window=window)


def test_the_split_follows_the_task_windows():
    timeline = RunTimeline(planning_s=0.5, tasks_called=100.0, tasks_returned=104.0,
                           committing_s=0.25)
    split = timeline.split([_result(0, (101.0, 102.5)), _result(1, (101.5, 103.0))])
    assert split == {"planning": 0.5, "before_subtasks": 1.0, "subtasks": 2.0,
                     "after_subtasks": 1.0, "committing": 0.25}


def test_skewed_clocks_never_give_a_negative_or_a_longer_split():
    timeline = RunTimeline(0.0, tasks_called=100.0, tasks_returned=102.0, committing_s=0.0)
    # an executor whose clock runs behind (starts "before" the call) and one ahead
    split = timeline.split([_result(0, (98.0, 99.0)), _result(1, (101.0, 105.0))])
    assert all(v >= 0 for v in split.values())
    assert sum(split.values()) == pytest.approx(2.0)
    # no window reported (a result row of an older worker): all of it before subtasks
    assert timeline.split([_result(0, (0.0, 0.0))])["before_subtasks"] == 2.0


@pytest.fixture(params=["local", "spark"])
def engine(request):
    return request.param, (request.getfixturevalue("spark") if request.param == "spark"
                           else None)


def test_a_runs_split_adds_up_to_its_duration(tmp_path, engine):
    name, spark = engine
    (tmp_path / "in").mkdir()
    events(400, 30, 1, 1).to_parquet(tmp_path / "in" / "part.parquet")
    summary = run_job(VERSIONS[1], RunConfig(
        input=str(tmp_path / "in"), storage=f"file://{tmp_path}/store", job="card_spend",
        run_id="d1", output=str(tmp_path / "out"), parallelism=2, engine=name), spark)
    split = summary["time_split"]
    assert tuple(split) == TIME_SPLIT_KEYS and all(v >= 0 for v in split.values()), split
    # the parts are measured back to back: together, the run (rounding, the summary)
    assert sum(split.values()) == pytest.approx(summary["duration_s"], abs=0.05), split
    assert split["subtasks"] > 0
    if name == "spark":  # a Spark job schedules, reads and shuffles before the subtasks
        assert split["before_subtasks"] > 0
