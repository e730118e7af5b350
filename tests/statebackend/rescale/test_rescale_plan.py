"""Rescale plan (pure, no Spark, no storage) and the CLI's refusals (no Spark needed)."""

from __future__ import annotations

import json

import pytest

from statebackend.checkpoint.metadata import FileRef, SubtaskHandle
from statebackend.checkpoint.store import CheckpointStore, MetadataParts, build_metadata
from statebackend.cli import app as cli
from statebackend.errors import MetadataError, UsageError
from statebackend.rescale.plan import NothingToRescaleError, plan_rescale
from statebackend.state.keygroups import KeyGroupRange, key_group_range_for_subtask
from statebackend.storage import open_storage


def fake_meta(p: int, m: int = 128, cid: int = 5):
    handles = []
    for i in range(p):
        r = key_group_range_for_subtask(m, p, i)
        shared = (FileRef(f"shared/u{i}-000010.sst", "000010.sst", 1000 + i, "crc32:0"),)
        private = (FileRef(f"chk-{cid}/{i}/s/MANIFEST-000005", "MANIFEST-000005", 10, "crc32:0"),)
        handles.append(SubtaskHandle(i, r.start, r.end, f"b{i}", "s", shared, private,
                                     {"totals": 1}))
    return build_metadata(MetadataParts(job="j", checkpoint_id=cid, parent=None, max_parallelism=m,
                          states=[{"name": "totals", "kind": "value"}], handles=handles))


PAIRS = [(1, 4), (4, 1), (2, 3), (3, 2), (3, 7), (7, 3), (5, 128), (128, 5), (3, 5), (5, 2)]


@pytest.mark.parametrize(("p", "q"), PAIRS)
def test_plan_covers_every_key_group_once_from_overlapping_handles(p, q):
    meta = fake_meta(p)
    plan = plan_rescale(meta, q)
    assert (plan.from_parallelism, plan.to_parallelism, plan.source_checkpoint_id) == (p, q, 5)
    assert len(plan.subtasks) == q
    for j, s in enumerate(plan.subtasks):
        assert s.key_groups == key_group_range_for_subtask(128, q, j)
        old_ranges = {h.index: h.key_group_range for h in meta.subtasks}
        # base part + imported parts tile the new range exactly, each from the right handle
        parts = [(s.base, s.base_overlap)] + [(i.source, i.key_groups) for i in s.imports]
        covered = sorted(kg for src, r in parts for kg in range(r.start, r.end + 1))
        assert covered == list(range(s.key_groups.start, s.key_groups.end + 1))
        for src, r in parts:
            assert r == s.key_groups.intersect(old_ranges[src]) and len(r) > 0
        # the base has the largest overlap
        assert len(s.base_overlap) == max(len(r) for _, r in parts)
        # downloads: every file of each overlapping handle, none of the others
        expected = {f.path for src in s.sources for f in meta.subtasks[src].files}
        assert {f.path for f in s.downloads} == expected
        assert all(f.reason for f in s.downloads)
        assert s.bytes_to_download == sum(f.size for f in s.downloads)
    json.dumps(plan.to_json())
    assert plan.describe()[0].startswith("rescale plan: job j checkpoint 5 from parallelism")


def test_plan_scale_out_from_one_uses_one_base_and_no_imports():
    plan = plan_rescale(fake_meta(1), 4)
    assert [s.base for s in plan.subtasks] == [0, 0, 0, 0]
    assert all(not s.imports for s in plan.subtasks)


def test_plan_scale_in_to_one_imports_all_but_the_base():
    plan = plan_rescale(fake_meta(4), 1)
    (s,) = plan.subtasks
    assert s.key_groups == KeyGroupRange(0, 127)
    assert sorted(s.sources) == [0, 1, 2, 3] and len(s.imports) == 3


def test_plan_is_frozen_and_pure():
    meta = fake_meta(3)
    assert plan_rescale(meta, 5) == plan_rescale(meta, 5)
    with pytest.raises(AttributeError):
        plan_rescale(meta, 5).to_parallelism = 2  # type: ignore[misc]


@pytest.mark.parametrize(("q", "message"), [
    (0, "parallelism 0 is invalid: it must be at least 1"),
    (-3, "parallelism -3 is invalid"),
    (129, "parallelism 129 exceeds max parallelism 128"),
])
def test_plan_refuses_out_of_range(q, message):
    with pytest.raises(UsageError, match=message):
        plan_rescale(fake_meta(4), q)


def test_plan_refuses_same_parallelism_as_noop():
    with pytest.raises(NothingToRescaleError,
                       match="already at parallelism 4: nothing to do"):
        plan_rescale(fake_meta(4), 4)


def test_plan_refuses_handles_that_do_not_tile():
    meta = fake_meta(2)
    bad = meta.subtasks[1].__class__(**{**meta.subtasks[1].__dict__, "key_group_start": 70})
    with pytest.raises(MetadataError, match="subtask 1 covers key groups \\[70, 127\\]"):
        plan_rescale(meta.with_changes(subtasks=(meta.subtasks[0], bad)), 3)


# -- CLI refusals: one line on stderr, non-zero exit, no Spark started ---------------

@pytest.fixture
def fake_store(tmp_path):
    url = f"file://{tmp_path}/store"
    store = CheckpointStore(open_storage(url), "j")
    meta = fake_meta(4, cid=1).with_changes(checkpoint_id=1)
    for f in meta.files:  # commit checks that every referenced file exists
        store.storage.write_bytes(f.path, b"x" * f.size)
    store.commit(meta)
    return url


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("args", "message"), [
    (["--parallelism", "4"], "already at parallelism 4: nothing to do"),
    (["--parallelism", "0"], "parallelism 0 is invalid"),
    (["--parallelism", "200"], "parallelism 200 exceeds max parallelism 128"),
    (["9", "--parallelism", "2"], "checkpoint 9 of job 'j' not found"),
    (["abc", "--parallelism", "2"], "checkpoint 'abc' is not 'latest', an id or chk-<id>"),
])
def test_cli_refusals(capsys, fake_store, args, message):
    code, out, err = run_cli(capsys, "--storage", fake_store, "--job", "j", "rescale", *args)
    assert code != 0
    assert message in err and err.count("\n") == 1 and err.startswith("ckpt: error:")
    assert out == ""


def test_cli_refuses_malformed_source(capsys, tmp_path, fake_store):
    (tmp_path / "store" / "j" / "chk-1" / "_metadata").write_text('{"format_version": 1, "jo')
    code, _, err = run_cli(capsys, "--storage", fake_store, "--job", "j", "rescale", "1",
                           "--parallelism", "2")
    assert code != 0 and "malformed or truncated metadata" in err and "chk-1/_metadata" in err


def test_cli_refuses_missing_job(capsys, tmp_path):
    code, _, err = run_cli(capsys, "--storage", f"file://{tmp_path}/none", "--job", "nope",
                           "rescale", "--parallelism", "2")
    assert code != 0 and "job 'nope' not found" in err


def test_cli_dry_run_prints_plan_and_writes_nothing(capsys, tmp_path, fake_store):
    code, out, _ = run_cli(capsys, "--storage", fake_store, "--job", "j", "rescale",
                           "--parallelism", "3", "--dry-run")
    assert code == 0
    assert "from parallelism 4 to 3" in out and "import key groups" in out
    assert "dry run: nothing written" in out
    code, out, _ = run_cli(capsys, "--storage", fake_store, "--job", "j", "rescale",
                           "--parallelism", "3", "--dry-run", "--json")
    doc = json.loads(out)
    assert doc["dry_run"] is True and doc["plan"]["to_parallelism"] == 3
    assert sorted(p.name for p in (tmp_path / "store" / "j").iterdir()) == ["chk-1", "runs",
                                                                             "shared"]
    assert sorted(p.name for p in (tmp_path / "store" / "j" / "chk-1").iterdir()) == [
        "0", "1", "2", "3", "_metadata"]


def test_clipped_share_spreads_each_files_bytes_over_its_key_groups():
    from statebackend.rescale.task import clipped_share
    from statebackend.state.keygroups import key_group_prefix

    def f(start: int, end: int, size: int) -> dict:
        return {"size": size, "start_key": key_group_prefix(start) + b"k",
                "end_key": key_group_prefix(end) + b"k"}

    keep = KeyGroupRange(0, 63)
    assert clipped_share([f(0, 63, 100)], keep) == 0
    assert clipped_share([f(64, 127, 100)], keep) == 1
    assert clipped_share([f(0, 127, 100)], keep) == 0.5
    assert clipped_share([f(0, 63, 300), f(32, 95, 100)], keep) == pytest.approx(50 / 400)
    assert clipped_share([], keep) == 0
    # a file without a key-group prefix counts as live
    assert clipped_share([{"size": 10, "start_key": b"", "end_key": b""}], keep) == 0
