"""Issue 21: one lineage through six versions of a job, on both engines and storages.

The card-spend job (tests/evolution/card_spend.py) changes version by version: a state
added, a record field added with a default (and one widened), a state renamed, a state
dropped, a JSON value upgrade. The versions are separated by runs, a crashed attempt,
a rescale and a restart from a savepoint into a new lineage. After every run the
latest checkpoint's rows (what `ckpt dump` writes) equal pandas over the runs so far.
Before some steps an incompatible version is tried: it fails in one line naming the
state and the change, and leaves no file and no lease behind.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.errors import UsageError
from statebackend.job import JobRunError, RunConfig, map_state, record, run_job, value_state
from statebackend.lifecycle.savepoint import create_savepoint
from statebackend.rescale.executor import RescaleOptions, rescale
from tests.conftest import S3_BUCKET
from tests.evolution.card_spend import VERSIONS, dumped, events, job, reference
from tests.jobs.helpers import store_of

ROOT = Path(__file__).resolve().parents[2]


def same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return a == b


def check_latest(storage: str, job_dir: str, want: dict) -> None:
    """The latest checkpoint of ``job_dir`` holds ``want`` (state -> key -> value, floats
    compared with `same`); a failure names the first few keys that differ per state."""
    store = store_of(storage, job_dir)
    got = dumped(checkpoint_rows(store, store.latest()))
    bad = {s: [k for k in set(got.get(s, {})) | set(want.get(s, {}))
               if not same(got.get(s, {}).get(k), want.get(s, {}).get(k))][:3]
           for s in set(got) | set(want)}
    assert not any(bad.values()), {s: [(k, got.get(s, {}).get(k), want.get(s, {}).get(k))
                                       for k in ks] for s, ks in bad.items() if ks}


class Lineage:
    def __init__(self, tmp_path, storage: str, engine: str, spark,
                 backend: str | None = None) -> None:
        self.tmp, self.storage, self.engine, self.spark = tmp_path, storage, engine, spark
        self.backend = backend
        self.days: list = []

    def input(self, d: int) -> str:
        folder = self.tmp / f"in{d}"
        if not folder.exists():
            folder.mkdir()
            events(250, 30, 100 + d, d).to_parquet(folder / "part.parquet")
        return str(folder)

    def run(self, d: int, version: int, *, job_dir: str = "card_spend", **kw) -> dict:
        config = RunConfig(input=self.input(d), storage=self.storage, job=job_dir,
                           run_id=f"day{d}", output=str(self.tmp / "out"), parallelism=2,
                           engine=self.engine, backend=self.backend, **kw)
        summary = run_job(VERSIONS[version] if isinstance(version, int) else version, config,
                          self.spark)
        if not kw.get("fail_subtask") and isinstance(version, int):
            self.days.append((events(250, 30, 100 + d, d), version))
        return summary

    def check(self, job_dir: str = "card_spend") -> None:
        check_latest(self.storage, job_dir, reference(self.days))

    def refused(self, d: int, version, job_dir: str, fragment: str, **kw) -> None:
        """``version`` cannot continue the lineage: one line, nothing written."""
        store = store_of(self.storage, job_dir)
        before = {f.path for f in store.storage.walk_files("")}
        with pytest.raises(UsageError) as info:
            self.run(d, version, job_dir=job_dir, **kw)
        message = str(info.value)
        assert "\n" not in message and fragment in message, message
        assert {f.path for f in store.storage.walk_files("")} == before


def changed(version: int, **states) -> object:
    """Version ``version`` with some states replaced (an incompatible change)."""
    base = job(version)
    return dataclasses.replace(base, states=tuple(states.get(d.name, d) for d in base.states))


@pytest.fixture(params=["local", "spark"])
def engine(request):
    return request.param, (request.getfixturevalue("spark") if request.param == "spark"
                           else None)


@pytest.fixture(params=["file", "s3"])
def storage(request, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    request.getfixturevalue("s3_server")
    return f"s3://{S3_BUCKET}/evolve-{uuid.uuid4().hex}"


@pytest.mark.timeout(900)
def test_six_versions_through_runs_a_crash_a_rescale_and_a_savepoint(tmp_path, storage,
                                                                     engine):
    lin = Lineage(tmp_path, storage, *engine)
    lin.run(0, 1)
    lin.check()
    # v2 adds a state; its first attempt crashes after uploading (nothing committed)
    with pytest.raises(JobRunError):
        lin.run(1, 2, fail_subtask=1)
    lin.check()  # still version 1's state
    lin.refused(1, changed(2, totals=map_state("totals")), "card_spend",
                "state 'totals': its kind changes from value to map")
    lin.refused(1, changed(2, totals=value_state("totals", record(
        n="int32", spend="float32", big="int64"))), "card_spend",
        "record field 'spend' changes from float64 to float32")
    lin.run(1, 2)
    lin.check()
    store = store_of(storage, "card_spend")
    rescale(store, "latest", 3, spark=engine[1], options=RescaleOptions(master="local[2]"))
    # v3: a record field added with a default, one widened; after the rescale
    lin.refused(2, changed(3, totals=value_state("totals", record(
        n="int64", spend="float64", big="int64", refunds="int64"))), "card_spend",
        "record field 'refunds' is added without a default")
    lin.run(2, 3)
    lin.check()
    # v4 renames a state, in a new lineage started from a savepoint of this one
    create_savepoint(store, "latest", "before-v4")
    lin.refused(3, dataclasses.replace(job(4), renamed_states={}), "card_spend_v4",
                "state 'per_merchant': the lineage holds it but the job does not declare it",
                start_from="card_spend/savepoints/before-v4")
    lin.run(3, 4, job_dir="card_spend_v4", start_from="card_spend/savepoints/before-v4")
    lin.check("card_spend_v4")
    lin.run(4, 5, job_dir="card_spend_v4")  # drops a state
    lin.check("card_spend_v4")
    lin.run(5, 6, job_dir="card_spend_v4")  # upgrades JSON values
    lin.check("card_spend_v4")
    latest = store_of(storage, "card_spend_v4").latest()
    versions = {s["name"]: (s.get("schema_version", 1), s.get("upgrade_version", 0))
                for s in latest.states}
    assert versions == {"totals": (2, 0), "merchants": (2, 0), "max_amount": (1, 0),
                        "first_seen": (2, 1)}
    merchants = next(s for s in latest.states if s["name"] == "merchants")
    assert [h["name"] for h in merchants["history"]] == ["per_merchant"]
    again = lin.run(5, 6, job_dir="card_spend_v4")  # re-run of a committed day: skipped
    assert again["skipped"] is True


def test_record_layouts_change_on_the_memory_backend(tmp_path):
    """The memory backend holds a record state as rows of its declared layout (a record
    table): version 3 adds a field and widens one, so its restore meets the older
    layout's values, which the migration rewrites; runs before and after a rescale of
    the new layout equal pandas."""
    lin = Lineage(tmp_path, f"file://{tmp_path}/store", "local", None, backend="memory")
    for d, version in enumerate((1, 2, 3)):
        lin.run(d, version)
        lin.check()
    rescale(store_of(lin.storage, "card_spend"), "latest", 3)
    lin.run(3, 3)
    lin.check()


def test_a_changed_max_parallelism_or_key_is_refused_before_any_work(tmp_path):
    lin = Lineage(tmp_path, f"file://{tmp_path}/store", "local", None)
    lin.run(0, 1)
    lin.refused(1, 1, "card_spend", "--max-parallelism 64 differs from the lineage's 128: "
                "key groups never change", max_parallelism=64)
    rekeyed = dataclasses.replace(job(1), input=dataclasses.replace(
        job(1).input, key="merchant"))
    lin.refused(1, rekeyed, "card_spend", "its key: the key column changes from 'card' to "
                "'merchant'; no rule migrates that")
    lin.run(1, 1)
    lin.check()
    # a new lineage started from a savepoint keeps the key: the change is refused there too
    create_savepoint(store_of(lin.storage, "card_spend"), "latest", "sp")
    lin.refused(2, rekeyed, "card_spend_2", "the key column changes from 'card' to "
                "'merchant'", start_from="card_spend/savepoints/sp")


def ckpt(*args: str) -> subprocess.CompletedProcess:
    """The installed ``ckpt`` command, from the repository root (job modules import)."""
    return subprocess.run([str(Path(sys.executable).parent / "ckpt"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_ckpt_check_and_show_tell_what_the_next_run_does(tmp_path):
    """`ckpt check` on a lineage at version 1: version 3 is compatible (exit 0, per state
    what happens), a kind change is refused (exit 1) and nothing is written; `ckpt show`
    prints each stored state's schema, and after the v3 run the widened record."""
    url = f"file://{tmp_path}/store"
    lin = Lineage(tmp_path, url, "local", None)
    lin.run(0, 1)
    store = store_of(url, "card_spend")
    before = {f.path for f in store.storage.walk_files("")}

    text = ckpt("--storage", url, "check", "tests.evolution.card_spend:V3")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == "job card_spend on checkpoint 1 of 'card_spend':"
    assert lines[-1].startswith("compatible: the next run continues the lineage")
    by_state = {ln.split()[0]: ln.split(None, 1)[1] for ln in lines[1:-1]}
    assert by_state["first_seen"] == "added: starts empty"
    assert by_state["totals"].startswith("migrated:")
    assert "refunds added (default 0)" in by_state["totals"]
    assert "n widened int32 -> int64" in by_state["totals"]
    assert by_state["per_merchant"] == by_state["recent"] == by_state["max_amount"] == "kept"

    as_json = ckpt("--storage", url, "check", "tests.evolution.card_spend:V3", "--json")
    plan = json.loads(as_json.stdout)
    assert plan["compatible"] is True and plan["lineage"] == "card_spend"
    assert {c["state"]: c["action"] for c in plan["changes"]} == {
        "totals": "migrated", "per_merchant": "kept", "recent": "kept", "max_amount": "kept",
        "first_seen": "added"}
    assert [m["target"] for m in plan["migrations"]] == ["totals"]

    refused = ckpt("--storage", url, "check", "tests.evolution.card_spend:TOTALS_AS_MAP")
    assert refused.returncode == 1, refused.stderr
    (totals,) = [ln for ln in refused.stdout.splitlines() if ln.split()[0] == "totals"]
    assert "refused" in totals and "kind changes from value to map" in totals
    assert refused.stdout.splitlines()[-1].startswith("refused: the next run fails")
    assert {f.path for f in store.storage.walk_files("")} == before  # check writes nothing

    lin.run(1, 3)
    lin.check()
    shown = ckpt("--storage", url, "--job", "card_spend", "show", "latest")
    assert shown.returncode == 0, shown.stderr
    after = shown.stdout.split("  states (schemas):\n", 1)[1].splitlines()
    schemas = list(itertools.takewhile(lambda ln: ln.startswith("    "), after))
    by_name = {ln.split()[0]: ln.split(None, 1)[1] for ln in schemas}
    assert set(by_name) == {"totals", "per_merchant", "recent", "max_amount", "first_seen"}
    assert by_name["totals"].startswith("value record(n int64, spend float64, big int64, "
                                        "refunds int64)")
    assert by_name["totals"].endswith("v2")
    assert by_name["first_seen"].endswith("v1")
