"""Run figures of a commit record (statebackend/checkpoint/metrics.py): written once, in
``extra["metrics"]``; records of older releases (top-level counters, or both) still load,
and the run ledger still learns ``keys_touched`` from each form."""

from __future__ import annotations

import pytest

from statebackend.checkpoint.metrics import LEGACY_RUN_KEYS, MemoryHeadroom, run_figures
from statebackend.checkpoint.runs import RunRecord
from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.storage import open_storage
from tests.statebackend.helpers import close_all, fill, keys, open_backends

FIGURES = {"events_read": 12, "events_rejected": 2, "rejects_by_reason": {"bad_json": 2},
           "keys_touched": 7}
METRICS = {"format": 1, "subtasks": [], "run": {**FIGURES, "duration_s": 1.5,
                                                "bytes_uploaded": 10, "state_rows": 7}}
FORMS = {
    "current": {"metrics": METRICS, "input_files": 1},
    "legacy": {**FIGURES, "input_files": 1},             # release 1: counters, no metrics
    "both": {**FIGURES, "metrics": METRICS, "input_files": 1},  # before the cleanup
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_record_form_gives_the_same_figures(form, tmp_path):
    store = CheckpointStore(open_storage(f"file://{tmp_path}/store"), "j")
    backends = open_backends(str(tmp_path / "work"), 1)
    fill(backends, keys(7))
    checkpoint_backends(store, backends, parent=None, run_id="r1", extra=FORMS[form])
    close_all(backends)
    meta = store.load(1)
    got = run_figures(meta.extra)
    assert {k: got[k] for k in LEGACY_RUN_KEYS} == FIGURES
    assert RunRecord.of(meta).extra["keys_touched"] == 7
    assert store.find_run("r1").extra["keys_touched"] == 7


def test_a_record_without_figures_gives_none():
    assert run_figures({}) == {} and run_figures(None) == {}
    assert run_figures({"metrics": {"format": 2, "run": FIGURES}}) == {}  # unknown format


def test_the_state_in_memory_reads_against_its_limit_and_warns_from_80_percent():
    limit = 2048 * 2**20
    cases = {5_000_000: ("0.2%", None), 500_000: ("<0.1%", None),
             int(0.79 * limit): ("79%", None), limit * 4 // 5 + 1: ("80%", "80%")}
    for held, (share, warned) in cases.items():
        headroom = MemoryHeadroom(3, held, limit)
        assert headroom.text() == f"state in memory up to {held / 2**20:.1f} MiB (subtask 3, " \
            f"{share} of its limit)"
        warning = headroom.warning()
        assert (warning is None) == (warned is None)
        if warning:
            assert warning.startswith(f"subtask 3 holds {held / 2**20:.1f} MiB of state in "
                                      f"memory, {warned} of the limit of 2048.0 MiB per "
                                      "subtask (--memory-limit-mb)") and "\n" not in warning
        assert MemoryHeadroom.from_json(headroom.to_json()) == headroom
    unbounded = MemoryHeadroom(0, 10, None)
    assert unbounded.warning() is None and unbounded.text().endswith("(subtask 0)")
    for garbage in ([], {"subtask": -1, "held_bytes": 1}, {"subtask": 0, "held_bytes": 1.5},
                    {"subtask": 0, "held_bytes": 1, "limit_bytes": "9"},
                    {"subtask": 0, "held_bytes": 9, "total_bytes": 8, "subtasks": 2},
                    {"subtask": 0, "held_bytes": 1, "total_bytes": 8},
                    {"subtask": 0, "held_bytes": 1, "total_bytes": 8, "subtasks": -2}):
        assert MemoryHeadroom.from_json(garbage) is None


def test_the_state_of_all_subtasks_together_is_said_and_warned_of_against_the_machine():
    """The limit is per subtask; the local engine's one process holds their sum."""
    limit = 2048 * 2**20
    one = MemoryHeadroom(1, 3 * 2**20, limit, total_bytes=5 * 2**20, subtasks=2)
    assert one.text() == "state in memory up to 3.0 MiB (subtask 1, 0.1% of its limit), " \
        "5.0 MiB in all 2 subtasks"
    assert MemoryHeadroom.from_json(one.to_json()) == one
    # a single subtask's total is its own figure; an older record has none
    assert MemoryHeadroom(0, 2**20, None, 2**20, 1).text() == \
        "state in memory up to 1.0 MiB (subtask 0)"
    legacy = {"subtask": 0, "held_bytes": 7, "limit_bytes": None, "share": None}
    assert MemoryHeadroom.from_json(legacy) == MemoryHeadroom(0, 7, None)
    assert MemoryHeadroom(0, 7, None).machine_warning(10) is None
    # from half the machine's memory on
    assert one.machine_warning(11 * 2**20) is None and one.machine_warning(0) is None
    warning = one.machine_warning(10 * 2**20)
    assert warning == ("the local engine's process holds 5.0 MiB of state in memory over 2 "
                       "subtasks, 50% of this machine's 10.0 MiB: a run whose state grows "
                       "further may be killed for lack of memory; run it on Spark (--engine "
                       "spark) or move the job to rocksdb")
