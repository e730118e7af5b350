"""A Spark Connect client for `test_state_reader`: `read_state` of each named state, each
saved as one Parquet file (the DataFrame's Arrow table) for the test to compare.

    python -m tests.statebackend.spark.read_state_client REMOTE STORAGE JOB OUT SPEC...

SPEC: STATE, STATE:explode (a row per list element) or STATE:COLUMN,COLUMN... (columns=);
STATE@jvm reads it with ``reader="jvm"`` (inside the server's JVM, or fail).

A process holds either a classic session or Connect clients: the test's own process
holds the classic one, so the Connect reads run here.
"""

from __future__ import annotations

import os
import sys

import pyarrow.parquet as pq

from statebackend.job import ReadOptions, read_state
from statebackend.spark.session import get_spark


def main(argv: list[str]) -> int:
    remote, storage, job, out, *specs = argv
    spark = get_spark(remote=remote, app_name="read-state-client")
    for spec in specs:
        name, _, mode = spec.partition(":")
        state, jvm, _ = name.partition("@jvm")
        columns = tuple(mode.split(",")) if mode and mode != "explode" else None
        df = read_state(spark, storage, job, state=state,
                        options=ReadOptions(explode_lists=mode == "explode", columns=columns,
                                            reader="jvm" if jvm else "auto"))
        pq.write_table(df.toArrow(), os.path.join(out, f"{name}-{mode or 'rows'}.parquet"))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
