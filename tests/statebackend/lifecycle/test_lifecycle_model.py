"""Model-based test of the checkpoint lifecycle (hypothesis state machine).

One job, one RocksDB backend, memory:// storage. Rules interleave at random:
writes, checkpoint, failed checkpoint (crashed before commit / overlapping
attempt whose commit loses), compaction, retention, GC (grace 0, grace 1 h now,
grace 1 h two hours later), savepoint, restore from an older checkpoint (the
restoring "job" holds a lease on its base until its next commit, as a running
job does), hold leases (live or already expired) and their release.

Invariants after every step:
- the committed checkpoints are exactly the model's retained ones;
- every referenced file of every checkpoint and savepoint exists with the size
  and checksum its metadata records (no referenced file is missing);
- every checkpoint and savepoint restores with exactly the state it had when it
  was written. A restore is deterministic in the bytes it reads, so a full
  restore runs the first time an owner is seen with a given set of (path,
  checksum) -- and again whenever that set changes -- while the byte-level check
  above runs on every owner at every step.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from statebackend.checkpoint.dump import backend_rows
from statebackend.checkpoint.leases import acquire_hold, release
from statebackend.checkpoint.restore import FROM_STORAGE, restore_subtask, restored_readonly
from statebackend.checkpoint.snapshot import checkpoint_backends, upload_snapshot
from statebackend.checkpoint.store import CheckpointStore, MetadataParts, build_metadata
from statebackend.errors import LeaseConflictError
from statebackend.lifecycle.doctor import diagnose, execute, plan_rollback
from statebackend.lifecycle.gc import collect_garbage
from statebackend.lifecycle.registry import build_registry
from statebackend.lifecycle.retention import retain
from statebackend.lifecycle.savepoint import create_savepoint
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.kinds import StateDescriptor
from statebackend.storage import checksum_algorithm, checksum_of_bytes, open_storage

DESC = (StateDescriptor("v", "value"),)
M = 8
KEYS = st.sampled_from([f"k{i}" for i in range(12)])


def state_of(backend: KeyedStateBackend) -> dict:
    return {r["key"]: r["value"] for r in backend_rows(backend, 0)}


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="lc-model-")
        self.storage = open_storage(f"memory://lc-{uuid.uuid4().hex}")
        self.store = CheckpointStore(self.storage, "job")
        self.backend = self._open(os.path.join(self.tmp, "live-0"))
        self.live: dict[str, int] = {}
        self.expected: dict[int, dict] = {}      # committed checkpoint id -> state
        self.savepoints: dict[str, dict] = {}    # savepoint name -> state
        self.parent: int | None = None
        self.base_lease = None                   # "running job" lease on its restore base
        self.holds: list = []                    # test hold leases (live or expired)
        self.verified: dict[str, frozenset] = {}
        self.n = 0

    def _open(self, path: str) -> KeyedStateBackend:
        return KeyedStateBackend(path, DESC, M, KeyGroupRange(0, M - 1))

    def teardown(self) -> None:
        self.backend.close()
        self.storage.delete_tree("")
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- writes -------------------------------------------------------------
    @rule(key=KEYS, value=st.integers(0, 10**6))
    def put(self, key: str, value: int) -> None:
        self.backend.value_state("v").put(key, value)
        self.live[key] = value

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        self.backend.value_state("v").delete(key)
        self.live.pop(key, None)

    @rule()
    def compact(self) -> None:
        self.backend.compact()

    # -- checkpoints ----------------------------------------------------------
    @rule()
    def checkpoint(self) -> None:
        meta = checkpoint_backends(self.store, [self.backend], parent=self.parent)
        self.expected[meta.checkpoint_id] = dict(self.live)
        self.parent = meta.checkpoint_id
        if self.base_lease is not None:  # the new checkpoint is the base now
            release(self.store.storage, self.base_lease)
            self.base_lease = None

    @rule(overlap=st.booleans())
    def failed_checkpoint(self, overlap: bool) -> None:
        """Upload without commit: a crash (fresh id) or a losing overlapping attempt."""
        cid = self.store.next_checkpoint_id()
        if overlap and self.expected:
            cid = max(self.expected)
        local = self.backend.take_local_snapshot()
        result = upload_snapshot(self.store.storage, local, checkpoint_id=cid, subtask=0,
                                 backend=self.backend)
        if overlap and cid in self.expected:
            # it lost the race for ``cid`` to the writer that committed it on cid - 1
            meta = build_metadata(MetadataParts(
                job="job", checkpoint_id=cid, parent=cid - 1 or None,
                                  max_parallelism=M, states=[d.to_json() for d in DESC],
                                  handles=[result.handle]))
            with pytest.raises(LeaseConflictError):
                self.store.commit(meta)
        # files stay behind (no cleanup): orphans for GC

    # -- lifecycle --------------------------------------------------------------
    @rule(keep=st.integers(1, 3))
    def retention(self, keep: int) -> None:
        held = {cid for lease in self._live_leases() for cid in lease.checkpoint_ids}
        report = retain(self.store, keep)
        newest = sorted(self.expected)[-keep:]
        assert set(report.plan.retired).isdisjoint(held | set(newest))
        assert set(report.plan.retired) == set(self.expected) - held - set(newest)
        assert not report.failures
        for cid in report.plan.retired:
            del self.expected[cid]

    @rule(mode=st.sampled_from(["grace0", "grace-now", "grace-later"]))
    def gc(self, mode: str) -> None:
        if mode == "grace0":
            report = collect_garbage(self.store, grace_seconds=0)
        elif mode == "grace-now":
            # every orphan of this test is younger than an hour: all must survive
            report = collect_garbage(self.store, grace_seconds=3600)
            assert report.files_deleted == 0, report.to_json()
        else:
            later = datetime.now(UTC) + timedelta(hours=2)
            report = collect_garbage(self.store, grace_seconds=3600, now=later)
        assert not report.failures
        assert all(f.reason.startswith("orphan-") for f in report.deleted)

    @precondition(lambda self: self.expected and len(self.savepoints) < 3)
    @rule(data=st.data())
    def savepoint(self, data) -> None:
        cid = data.draw(st.sampled_from(sorted(self.expected)))
        self.n += 1
        name = f"sp{self.n}"
        meta = create_savepoint(self.store, cid, name)
        assert all(f.path.startswith(f"savepoints/{name}/") for f in meta.files)
        self.savepoints[name] = dict(self.expected[cid])

    @precondition(lambda self: self.expected)
    @rule()
    def restore(self) -> None:
        """Restart the job from its latest checkpoint, holding it until the next commit.
        (Continuing from an older one would fork the lineage: `rollback` does that
        explicitly.)"""
        self._continue_from(max(self.expected))

    def _continue_from(self, cid: int) -> None:
        lease = acquire_hold(self.store.storage, "job run", [cid])
        if self.base_lease is not None:
            release(self.store.storage, self.base_lease)
        self.base_lease = lease
        self.backend.close()
        self.n += 1
        meta = self.store.load(cid)
        self.backend = restore_subtask(self.store.storage, meta.subtasks[0],
                                       os.path.join(self.tmp, f"live-{self.n}"), DESC, M,
                                       FROM_STORAGE)
        self.live = dict(self.expected[cid])
        assert state_of(self.backend) == self.live
        self.parent = cid

    @precondition(lambda self: len(self.expected) >= 2)
    @rule(data=st.data())
    def rollback(self, data) -> None:
        """The explicit way back (`ckpt doctor --rollback-to`): an older checkpoint becomes
        the latest and the job continues from it; newer ones are quarantined."""
        held = max((c for x in self._live_leases() if x is not self.base_lease
                    for c in x.checkpoint_ids), default=0)
        candidates = [c for c in sorted(self.expected)[:-1] if c >= held]
        if not candidates:
            return
        cid = data.draw(st.sampled_from(candidates))
        if self.base_lease is not None:  # the job is stopped for the roll back
            release(self.store.storage, self.base_lease)
            self.base_lease = None
        d = diagnose(self.store)
        execute(self.store, plan_rollback(d, cid, "model"), d)
        for newer in [c for c in self.expected if c > cid]:
            del self.expected[newer]
        self._continue_from(cid)

    @precondition(lambda self: self.expected and len(self.holds) < 3)
    @rule(data=st.data(), expired=st.booleans())
    def lease(self, data, expired: bool) -> None:
        cid = data.draw(st.sampled_from(sorted(self.expected)))
        ttl = -1.0 if expired else 3600.0
        self.holds.append(acquire_hold(self.store.storage, "validation", [cid], ttl_seconds=ttl))

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def release_lease(self, data) -> None:
        lease = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
        release(self.store.storage, lease)

    def _live_leases(self):
        now = datetime.now(UTC)
        out = [x for x in self.holds if not x.expired(now)]
        if self.base_lease is not None:
            out.append(self.base_lease)
        return out

    # -- invariants -------------------------------------------------------------
    @invariant()
    def committed_state_is_intact(self) -> None:
        assert self.store.checkpoint_ids() == sorted(self.expected)
        registry = build_registry(self.store)
        assert registry.missing() == []
        assert sorted(registry.savepoints) == sorted(self.savepoints)
        owners = [(f"chk-{cid}", registry.checkpoints[cid], self.expected[cid])
                  for cid in self.expected]
        owners += [(f"sp:{n}", registry.savepoints[n], self.savepoints[n])
                   for n in self.savepoints]
        for label, meta, want in owners:
            actual = []
            for ref in meta.files:
                data = self.store.storage.read_bytes(ref.path)
                assert len(data) == ref.size, ref.path
                assert checksum_of_bytes(data, checksum_algorithm(ref.checksum)) == ref.checksum, \
                    ref.path
                actual.append((ref.path, ref.checksum))
            fingerprint = frozenset(actual)
            if self.verified.get(label) == fingerprint:
                continue
            with restored_readonly(self.store.storage, meta.subtasks[0], DESC, M,
                                   work_dir=self.tmp) as be:
                assert state_of(be) == want, label
            self.verified[label] = fingerprint


LifecycleMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("LC_MODEL_EXAMPLES", "60")),
    stateful_step_count=int(os.environ.get("LC_MODEL_STEPS", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLifecycleModel = LifecycleMachine.TestCase
