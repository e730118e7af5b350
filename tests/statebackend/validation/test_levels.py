"""Validation levels (issue 14): ``deep`` takes key ranges and row counts from RocksDB and
samples the per-entry checks; ``full`` checks every entry.

Each sampled result is compared with the ``full`` level's (an independent, entry-by-entry
path): the same rows, counts and TTL verdicts for the entries the sample read. The
verdicts are also compared with Great Expectations (`ge_agrees`, as in test_validate).
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli import app as cli
from statebackend.errors import UsageError
from statebackend.state import facts
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.codecs import domain_byte, encode_time
from statebackend.state.keygroups import KeyGroupRange, key_group_for_bytes
from statebackend.state.kinds import StateDescriptor
from statebackend.state.ttl import TTL_INDEX, StateTtl, index_key, purge_expired, state_tag
from statebackend.storage import open_storage
from statebackend.validation import sampling
from statebackend.validation.content import ContentOptions, build_content
from statebackend.validation.validate import ValidationOptions, validate_checkpoint
from tests.statebackend.validation.test_validate import (
    check,
    failed,
    ge_agrees,  # noqa: F401 - autouse
)
from tests.statebackend.validation.test_validate_support import (
    JOB,
    M,
    build_checkpoint,
    edit_metadata,
    put_raw,
)

N_KEYS = 3000  # every state of every subtask holds more entries than the samples below


@pytest.fixture(autouse=True)
def sample_small_states(monkeypatch):
    """States this small are read whole at ``deep`` (sampling.WHOLE_UP_TO): sample them."""
    monkeypatch.setattr(sampling, "WHOLE_UP_TO", 0)


@pytest.fixture(scope="module")
def lineage(tmp_path_factory):
    """Checkpoint 1 (one SST per state) and 2 (incremental: overlapping SSTs), P=2."""
    base = tmp_path_factory.mktemp("levels")
    store, meta = build_checkpoint(f"file://{base}/store", str(base / "w"), parallelism=2,
                                   n_keys=N_KEYS)
    return store, meta


def _rows(state: pd.DataFrame) -> list[tuple]:
    """Every row as a tuple of its cells (the _ttl index may list a key more than once)."""
    return [tuple(map(repr, row)) for row in state.astype(object).itertuples(index=False)]


def assert_rows_of(sample: pd.DataFrame, full: pd.DataFrame) -> None:
    """Each sampled row is one of the full table's rows, cell for cell."""
    missing = set(_rows(sample)) - set(_rows(full))
    assert not missing, sorted(missing)[:3]


def test_deep_samples_rows_of_the_full_table_and_counts_every_entry(lineage):
    store, meta = lineage
    full = build_content(store.storage, meta)
    sample = build_content(store.storage, meta, ContentOptions(sample=64, seed=7))
    again = build_content(store.storage, meta, ContentOptions(sample=64, seed=7))
    pd.testing.assert_frame_equal(sample.state, again.state)  # the seed repeats the sample
    per_family = sample.state.groupby(["subtask", "state"]).size()
    assert len(per_family) == len(full.state.groupby(["subtask", "state"]).size())
    assert per_family.max() <= 64 and len(sample.state) < len(full.state) / 10
    # every sampled row is the full table's row for that entry
    assert_rows_of(sample.state, full.state)
    # counts: every entry, equal to the full level's scan and to the recorded counts
    cols = ["subtask", "state", "recorded_rows", "counted_rows", "counts_ok"]
    pd.testing.assert_frame_equal(sample.counts[cols], full.counts[cols])
    assert sample.counts["counts_ok"].all() and sample.rows == full.rows == len(full.state)
    # overlapping SSTs: the snapshot's counts (a checked scan then), within RocksDB's facts
    assert set(sample.counts["counted_by"]) == {"recorded at snapshot"}
    assert set(full.counts["counted_by"]) == {"scan"}


def test_a_state_within_the_sample_is_checked_whole(lineage, monkeypatch):
    store, meta = lineage
    full = build_content(store.storage, meta)
    whole = build_content(store.storage, meta, ContentOptions(sample=N_KEYS))
    pd.testing.assert_frame_equal(whole.state, full.state)
    monkeypatch.setattr(sampling, "WHOLE_UP_TO", N_KEYS)
    small = build_content(store.storage, meta, ContentOptions(sample=8))
    pd.testing.assert_frame_equal(small.state, full.state)


def test_row_counts_from_sst_properties_are_exact_and_checked(lineage, tmp_path):
    store, _ = lineage
    one = validate_checkpoint(store, 1, ValidationOptions(
        level="deep", sample=16, seed=1, report="none", report_dir=str(tmp_path / "r")))
    full = validate_checkpoint(store, 1, ValidationOptions(
        level="full", report="none", report_dir=str(tmp_path / "r")))
    assert one.success and full.success
    figures = one.summary["figures"]
    assert list(figures["counted_by"]) == ["sst properties"]  # one SST per state
    assert figures["state_rows"] == full.summary["figures"]["state_rows"] \
        == full.summary["figures"]["entries_checked"]
    assert figures["entries_checked"] < figures["state_rows"] / 10
    assert one.summary["level"] == "deep" and one.summary["deep"] is True
    assert full.summary["level"] == "full" and full.summary["deep"] is True


def test_a_wrong_recorded_count_fails_at_deep_without_a_scan(tmp_path):
    store, _ = build_checkpoint(f"file://{tmp_path}/store", str(tmp_path / "w"),
                                parallelism=2, n_keys=N_KEYS)
    edit_metadata(store, 1, lambda o: o["subtasks"][1]["row_counts"].update(
        totals=o["subtasks"][1]["row_counts"]["totals"] + 1))
    result = validate_checkpoint(store, 1, ValidationOptions(level="deep", sample=16,
                                                             report="none"))
    assert failed(result) == {"row_counts_match"}
    (row,) = check(result, "row_counts_match")["offending_rows"]
    assert (row["subtask"], row["state"], row["counted_by"]) == (1, "totals", "sst properties")
    assert row["recorded_rows"] == row["counted_rows"] + 1


def test_over_overlapping_ssts_a_count_beyond_the_facts_is_counted_again(tmp_path):
    """Deep takes the snapshot's count without a scan when it fits RocksDB's facts; a
    count no stored data can hold (more live entries than stored ones) is counted
    again with a checked scan, and fails the check."""
    store, meta = build_checkpoint(f"file://{tmp_path}/store", str(tmp_path / "w"),
                                   parallelism=2, n_keys=N_KEYS)
    cid = meta.checkpoint_id  # incremental: overlapping SSTs
    result = validate_checkpoint(store, cid, ValidationOptions(
        level="deep", sample=16, seed=1, report="none", report_dir=str(tmp_path / "a")))
    assert result.success and set(result.summary["figures"]["counted_by"]) == {
        "recorded at snapshot"}
    edit_metadata(store, cid, lambda o: o["subtasks"][0]["row_counts"].update(
        totals=10 * N_KEYS))
    result = validate_checkpoint(store, cid, ValidationOptions(
        level="deep", sample=16, seed=1, report="none", report_dir=str(tmp_path / "b")))
    assert failed(result) == {"row_counts_match"}
    (row,) = check(result, "row_counts_match")["offending_rows"]
    assert (row["subtask"], row["state"], row["counted_by"]) == (0, "totals", "scan")
    assert row["recorded_rows"] == 10 * N_KEYS > row["counted_rows"] > 0


def _key_of_next_subtask(backends):
    """A correctly hashed key of subtask 1's first key group, written into subtask 0."""
    b = backends[0]
    kg = b.key_group_range.end + 1
    key = next(f"far{i}" for i in range(100_000)
               if key_group_for_bytes(f"far{i}".encode(), M) == kg)
    put_raw(b, "totals", kg, key, b.value_state("totals").codec.encode(
        {"count": 1, "sum": 1.0, "flag": True}))


def test_a_key_outside_the_subtask_range_fails_at_deep_whatever_the_sample(tmp_path):
    store, _ = build_checkpoint(f"file://{tmp_path}/store", str(tmp_path / "w"),
                                parallelism=2, n_keys=N_KEYS, tamper=_key_of_next_subtask)
    # the manifest cannot see it
    assert validate_checkpoint(store, "latest", ValidationOptions(report="none")).success
    for seed in (1, 2):
        deep = validate_checkpoint(store, "latest", ValidationOptions(
            level="deep", sample=8, seed=seed, report="none"))
        assert "keys_in_subtask_range_by_rocksdb" in failed(deep)
        assert failed(deep) <= {"keys_in_subtask_range_by_rocksdb", "keys_in_subtask_range"}
        (row,) = check(deep, "keys_in_subtask_range_by_rocksdb")["offending_rows"]
        assert (row["subtask"], row["state"]) == (0, "totals")
        assert row["last_key_group"] == row["range_end"] + 1
    full = validate_checkpoint(store, "latest", ValidationOptions(level="full", report="none"))
    assert failed(full) == {"keys_in_subtask_range", "keys_in_subtask_range_by_rocksdb"}
    (row,) = check(full, "keys_in_subtask_range")["offending_rows"]
    assert row["key"].startswith("far")


TTL = 1_000
TTL_DESCS = (StateDescriptor("seen", "value", ttl=StateTtl(TTL, "event")),
             StateDescriptor("events", "list", ttl=StateTtl(TTL, "event")))


def test_sampled_ttl_checks_agree_with_the_full_scan(tmp_path):
    """Half the keys disagree with the _ttl index (value pushed out unindexed, or indexed as
    expired while readable): the sample's point lookups give the scan's verdict per entry."""
    store = CheckpointStore(open_storage(f"file://{tmp_path}/store"), "j")
    keys = [f"k{i}" for i in range(600)]
    with KeyedStateBackend(str(tmp_path / "b"), TTL_DESCS, M, KeyGroupRange(0, M - 1)) as be:
        be.value_state("seen").put_many(keys, list(range(600)),
                                        timestamps=[0 if i % 3 else 5_000 for i in range(600)])
        be.list_state("events").add_many(keys, [1] * 600, timestamps=[5_000] * 600)
        purge_expired(be, "event", 2_000)
        for i, k in enumerate(keys):
            if i % 6 == 1:  # purged: written back live until 9000 without an index entry
                be.column_family("seen").put(be.rocks_key(k), encode_time(9_000) + b"\x012")
            elif i % 6 == 3:  # live (expiry 5000): the index also says expired at 1000
                be.column_family(TTL_INDEX).put(index_key(
                    be.rocks_key(k), domain_byte("event"), 1_000, state_tag("seen")), b"")
        be.mark_dirty()
        meta = checkpoint_backends(store, [be], parent=None).with_changes(watermark=2_000)
    full = build_content(store.storage, meta).state
    sample = build_content(store.storage, meta, ContentOptions(sample=96, seed=3)).state
    assert_rows_of(sample, full)
    bad = sample[sample["ttl_ok"].notna() & ~sample["ttl_ok"].astype(bool)]
    assert {"seen", TTL_INDEX} <= set(bad["state"])  # both kinds of disagreement sampled
    assert len(sample) < len(full) / 2


def test_cli_levels(lineage, tmp_path, capsys):
    store, _ = lineage
    base = ["--storage", store.root_storage.url, "--job", JOB, "validate", "1", "--report",
            "none", "--report-dir", str(tmp_path / "r")]
    assert cli.main(base + ["--deep", "--sample", "8", "--seed", "5", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["level"] == "deep" and summary["figures"]["sample_seed"] == 5
    assert cli.main(base + ["--full"]) == 0
    out = capsys.readouterr().out
    assert "PASSED (full validation" in out and "ckpt.content.families" in out
    assert cli.main(base + ["--deep"]) == 0
    assert "entries checked one by one, seed" in capsys.readouterr().out
    assert cli.main(base + ["--sample", "8"]) == 2
    assert "--sample and --seed apply to --deep only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(base + ["--deep", "--full"])


def test_bad_level_or_sample_is_a_usage_error(lineage):
    store, _ = lineage
    with pytest.raises(UsageError, match="validation level 'thorough' is invalid"):
        validate_checkpoint(store, 1, ValidationOptions(level="thorough"))
    with pytest.raises(UsageError, match="sample 0 is invalid"):
        validate_checkpoint(store, 1, ValidationOptions(level="deep", sample=0))
    with pytest.raises(UsageError, match="sample True is invalid"):
        ValidationOptions(level="deep", sample=True)
    with pytest.raises(UsageError, match="report mode 'later' is invalid"):
        ValidationOptions(report="later")


def test_rocksdb_counts_are_used_only_when_exact(tmp_path):
    """One SST per state: RocksDB's count is the live count. Range tombstones (a clip)
    or a second, overlapping SST (updates): not provable, so the deep level scans."""
    from statebackend.checkpoint.dump import descriptors_of
    from statebackend.checkpoint.restore import restored_readonly
    from tests.statebackend.helpers import DESCRIPTORS, close_all, fill, keys, open_backends

    store = CheckpointStore(open_storage(f"file://{tmp_path}/store"), "j")
    (be,) = backends = open_backends(str(tmp_path / "w"), 1, M, DESCRIPTORS)

    def facts_and_counts(parent):
        meta = checkpoint_backends(store, backends, parent=parent)
        with restored_readonly(store.storage, meta.subtasks[0], descriptors_of(meta), M) as b:
            out = {name: (facts.exact_count(facts.cf_facts(b.column_family(name))),
                          b.count_keys(name)) for name in b.column_families}
        return meta, out

    try:
        fill(backends, keys(800))
        meta, first = facts_and_counts(None)
        assert all(exact == live > 0 for exact, live in first.values()), first
        fill(backends, keys(200), version=1)  # updates: a new SST over the same keys
        meta, second = facts_and_counts(meta.checkpoint_id)
        assert second["totals"][0] is None and second["totals"][1] == first["totals"][1]
        be.delete_key_groups_outside(KeyGroupRange(0, M // 2 - 1))  # range tombstones
        meta, third = facts_and_counts(meta.checkpoint_id)
        assert third["totals"][0] is None and 0 < third["totals"][1] < first["totals"][1]
        be.compact()  # one SST per state again, tombstones and hidden keys dropped
        meta, fourth = facts_and_counts(meta.checkpoint_id)
        assert fourth["totals"] == (third["totals"][1], third["totals"][1])
    finally:
        close_all(backends)
