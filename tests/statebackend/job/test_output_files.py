"""Output Parquet files (statebackend.job.task.write_parquet): dictionary encoding only
where values repeat; the rows read back unchanged."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from statebackend.job.task import DICTIONARY_SAMPLE, dictionary_columns, write_parquet


def _table(n: int) -> pa.Table:
    rng = np.random.default_rng(7)
    return pa.table({
        "key": [f"user-{i:07d}" for i in range(n)],            # unique
        "count": rng.integers(1, 8, n),                         # 7 values
        "sum": rng.random(n),                                   # unique floats
        "category": rng.choice(["a", "b", "c"], n).tolist(),    # 3 values
        "tags": pa.array([["x"]] * n, pa.list_(pa.string())),   # no distinct count
    })


def _dictionary_encoded(path: str) -> dict[str, bool]:
    meta = pq.ParquetFile(path).metadata.row_group(0)
    return {meta.column(i).path_in_schema: any("DICTIONARY" in e for e in
                                              meta.column(i).encodings)
            for i in range(meta.num_columns)}


def test_only_repeating_columns_are_dictionary_encoded(tmp_path):
    table = _table(3 * DICTIONARY_SAMPLE)
    assert dictionary_columns(table) == ["count", "category", "tags"]
    write_parquet(f"file://{tmp_path}", "part.parquet", table)
    encoded = _dictionary_encoded(str(tmp_path / "part.parquet"))
    assert encoded["key"] is False and encoded["sum"] is False
    assert encoded["count"] and encoded["category"]
    assert pq.read_table(tmp_path / "part.parquet").equals(table)


def test_small_and_empty_tables():
    assert dictionary_columns(_table(0)) == ["key", "count", "sum", "category", "tags"]
    assert dictionary_columns(_table(2)) == ["tags"]  # 2 distinct of 2: no repeats
