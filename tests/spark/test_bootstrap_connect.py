"""Bootstrap from Spark DataFrames of a Spark Connect client (issue 23, deliverable 2).

The client runs in its own process (pyspark answers for one mode per process): it
bootstraps the card-spend job's state from DataFrames through the Connect server (the
entries are encoded and written by the server's tasks) and prints the summary; the
savepoint's rows (what `ckpt dump` writes) then equal pandas' reference.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.lifecycle.registry import load_savepoint
from tests.evolution.card_spend import dumped, reference
from tests.evolution.test_evolution import same
from tests.jobs.bootstrap_data import history
from tests.jobs.helpers import store_of

CLIENT = """
import json, sys
from statebackend.job import bootstrap_state
from statebackend.spark.session import get_spark
from tests.evolution.card_spend import V1, reference
from tests.jobs.bootstrap_data import history, state_tables

spark = get_spark(remote=sys.argv[2])
tables = {n: spark.createDataFrame(t.to_pandas())
          for n, t in state_tables(reference([(history(), 1)])).items()}
print(json.dumps(bootstrap_state(V1, sys.argv[1], "seed", tables, parallelism=3)))
"""


@pytest.mark.slow
def test_bootstrap_from_dataframes_through_connect_equals_pandas(connect_server, tmp_path):
    storage = f"file://{tmp_path}/store"
    done = subprocess.run([sys.executable, "-c", CLIENT, storage, connect_server.url],
                          env=connect_server.env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["parallelism"], summary["entries"]["totals"]) == (3, 30)
    store = store_of(storage, "card_spend")
    got = dumped(checkpoint_rows(store, load_savepoint(store, "seed")))
    want = reference([(history(), 1)])
    assert set(got) == set(want) and all(same(got[s], want[s]) for s in want)
