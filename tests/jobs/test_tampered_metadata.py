"""Nothing read from checkpoint storage chooses code to import.

A `_metadata` whose free-form parts name a module with an import side effect is
shown, dumped, validated, rescaled and continued by a job run: the module is never
imported (neither by the driver nor by an executor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from examples import user_activity
from statebackend.checkpoint.store import CheckpointStore
from statebackend.job import RunConfig, run_job
from statebackend.storage import open_storage
from tests.jobs.run_reference import activity_events
from tests.statebackend.helpers import recommit_record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVIL = "ckpt_tamper_probe"

SCRIPT = """
import json, sys
from statebackend.cli import app as cli
url, inp, out, dump, probe = sys.argv[1:6]
base = ["--storage", url, "--job", "user_activity"]
codes = {
    "show": cli.main(base + ["show", "latest"]),
    "dump": cli.main(base + ["dump", "latest", "--out", dump]),
    "validate": cli.main(base + ["validate", "--deep", "--job-def",
                                 "examples.user_activity:job"]),
    "rescale": cli.main(base + ["rescale", "--parallelism", "1", "--master", "local[1]"]),
    "run": cli.main(["run", "examples.user_activity:job", "--storage", url, "--input", inp,
                     "--run-id", "r2", "--output", out, "--master", "local[1]"]),
}
print("RESULT " + json.dumps({"codes": codes, "imported": probe in sys.modules}))
"""


def test_tampered_metadata_never_imports_a_module(spark, tmp_path):
    url = f"file://{tmp_path}/store"
    activity_events(str(tmp_path / "in1"), rows=300, users=40, seed=1, day=0)
    activity_events(str(tmp_path / "in2"), rows=300, users=40, seed=2, day=1)
    run_job(user_activity.job, RunConfig(input=str(tmp_path / "in1"), storage=url, run_id="r1",
                                         output=str(tmp_path / "out"), parallelism=2), spark)
    storage = open_storage(url)
    meta = json.loads(storage.read_bytes("user_activity/chk-1/_metadata"))
    ref = f"{EVIL}:job"
    meta["extra"].update({"job_kind": ref, "job": ref, "module": EVIL, "checks": [EVIL]})
    meta["source"] = {"job": ref, "module": EVIL}
    # written as if committed so (an attacker who can write the record can write the log)
    recommit_record(CheckpointStore(storage, "user_activity"), 1, json.dumps(meta).encode())

    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    marker = tmp_path / "imported.txt"
    (probe_dir / f"{EVIL}.py").write_text(
        f"open({str(marker)!r}, 'a').write('imported\\n')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(probe_dir)])}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, url, str(tmp_path / "in2"), str(tmp_path / "out"),
         str(tmp_path / "dump.jsonl"), EVIL], env=env, capture_output=True, text=True,
        timeout=600, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["codes"] == {"show": 0, "dump": 0, "validate": 0, "rescale": 0, "run": 0}, \
        proc.stderr[-3000:]
    assert result["imported"] is False
    assert not marker.exists()
    # the probe is importable: had anything tried, it would have run
    check = subprocess.run([sys.executable, "-c", f"import {EVIL}"], env=env, cwd=ROOT)
    assert check.returncode == 0 and marker.exists()
