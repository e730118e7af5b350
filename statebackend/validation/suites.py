"""Expectation suites per table, and their runs in one ephemeral GE context.

Every built-in expectation is *critical* and carries ``meta={"check": name,
"critical": True}``; the check name is what the JSON summary and the CLI report.
Most checks are ``expect_column_values_to_be_in_set([True])`` or ``..._between``
over a column the table builders computed, so each check is one vectorised
column test and its failed rows (bounded) come back with the table's identifying
columns (path, subtask, key ...). Null cells mean "not checked" and are skipped.

Suites (table -> suite name):

==========  =========================  ==========================================
checkpoint  ckpt.manifest.checkpoint   metadata_parses, parallelism_matches_subtasks,
                                       max_parallelism_in_range, parent_chain_intact
files       ckpt.manifest.files        paths_inside_job_root, files_exist,
                                       file_sizes_match, file_checksums_match
subtasks    ckpt.manifest.subtasks     key_group_ranges_match_formula,
                                       key_group_ranges_no_gap, key_group_ranges_no_overlap
states      ckpt.manifest.states       state_schemas_readable, schema_history_ascending
                                       (one row per state: kind, codec and fields, TTL,
                                       schema and upgrade version, history)
restore     ckpt.content.restore       subtasks_restore (deep)
state       ckpt.content.state         key_group_prefix_matches_hash,
                                       keys_in_subtask_range, values_decode (deep; at
                                       the ``deep`` level on a sample of the entries)
families    ckpt.content.families      keys_in_subtask_range_by_rocksdb (deep)
counts      ckpt.content.counts        row_counts_match (deep)
job:<state> ckpt.job.<state>           the job's registered checks (deep)
==========  =========================  ==========================================

The verdict does not need Great Expectations (issue 14): `evaluate_runs` computes
every built-in check with pandas over the same tables, with GE's semantics
(``expect_column_values_to_be_in_set``: non-null values must be in the set;
``..._between``: non-null values within the inclusive bounds; element_count is
every row, offending rows are the first 20 unexpected ones in table order with
the checked column then the index columns). Only a job's own checks, which are
GE expectation objects, are run by GE. `run_suites` still runs everything in GE
to render Data Docs; tests compare both check by check.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:  # Great Expectations takes about 10 s to import: only when it runs
    from great_expectations.expectations import Expectation

MAX_OFFENDING_ROWS = 20

# (check name, description, column, kind, args) per table; kind "true" or "between".
_BUILTIN: dict[str, list[tuple[str, str, str, str, tuple]]] = {
    "checkpoint": [
        ("metadata_parses", "the _metadata record passes the strict parser (format, types, "
         "paths relative to the job root, id and job match)", "metadata_ok", "true", ()),
        ("parallelism_matches_subtasks", "parallelism P equals the number of subtask records",
         "parallelism_ok", "true", ()),
        ("max_parallelism_in_range", "max parallelism M is within 1..32768 and P <= M",
         "max_parallelism_ok", "true", ()),
        ("parent_chain_intact", "the parent checkpoint's _metadata exists, or the parent is "
         "null or was retired (older than every committed checkpoint)",
         "parent_ok", "true", ()),
    ],
    "files": [
        ("paths_inside_job_root", "no referenced path is absolute or contains '..'",
         "path_safe", "true", ()),
        ("files_exist", "every referenced file exists", "exists", "true", ()),
        ("file_sizes_match", "every file's size equals its recorded size", "size_ok", "true", ()),
        ("file_checksums_match", "every file's CRC32 equals its recorded checksum",
         "checksum_ok", "true", ()),
    ],
    "subtasks": [
        ("key_group_ranges_match_formula", "each subtask's key-group range equals Flink's "
         "formula for (P, M)", "range_ok", "true", ()),
        ("key_group_ranges_no_gap", "the ranges cover [0, M) with no gap",
         "uncovered_key_groups", "between", (0, 0)),
        ("key_group_ranges_no_overlap", "no two subtask ranges overlap",
         "overlap_before", "between", (0, 0)),
    ],
    "states": [
        ("state_schemas_readable", "each state's schema (kind, codec and fields, TTL, "
         "versions) is one this release reads", "schema_ok", "true", ()),
        ("schema_history_ascending", "each state's schema versions rise along its history "
         "and end at its current version", "history_ok", "true", ()),
    ],
    "restore": [
        ("subtasks_restore", "every subtask downloads intact and opens read-only",
         "restored", "true", ()),
    ],
    "state": [
        ("key_group_prefix_matches_hash", "each entry's stored key-group prefix equals "
         "the lineage's key hash of the key mod M", "prefix_ok", "true", ()),
        ("keys_in_subtask_range", "each entry's key group lies in its subtask's range",
         "in_range", "true", ()),
        ("values_decode", "every stored key and value decodes with the state's codec",
         "decodes", "true", ()),
    ],
    "families": [
        ("keys_in_subtask_range_by_rocksdb", "each column family's first and last live key "
         "(RocksDB keeps keys sorted, key group first) lie in its subtask's key-group range, so "
         "every key does", "edges_in_range", "true", ()),
    ],
    "counts": [
        ("row_counts_match", "per subtask and state, the entries read equal the metadata's "
         "row_counts", "counts_ok", "true", ()),
    ],
}

INDEX_COLUMNS = {
    "checkpoint": ["checkpoint_id", "metadata_error", "parallelism", "subtask_count",
                   "max_parallelism", "parent"],
    "files": ["subtask", "path", "recorded_size", "actual_size", "recorded_checksum",
              "actual_checksum"],
    "subtasks": ["subtask", "key_group_start", "key_group_end", "expected_start",
                 "expected_end", "gap_before", "gap_after"],
    "states": ["state", "kind", "codec", "ttl", "schema_version", "upgrade_version",
               "history", "schema_error"],
    "restore": ["subtask", "restore_error"],
    "state": ["subtask", "state", "key", "user_key", "key_group", "computed_key_group",
              "range_start", "range_end", "decode_error"],
    "families": ["subtask", "state", "first_key", "last_key", "first_key_group",
                 "last_key_group", "range_start", "range_end"],
    "counts": ["subtask", "state", "recorded_rows", "counted_rows", "counted_by"],
}

SUITE_NAMES = {
    "checkpoint": "ckpt.manifest.checkpoint",
    "files": "ckpt.manifest.files",
    "subtasks": "ckpt.manifest.subtasks",
    "states": "ckpt.manifest.states",
    "restore": "ckpt.content.restore",
    "state": "ckpt.content.state",
    "families": "ckpt.content.families",
    "counts": "ckpt.content.counts",
}


@dataclass(frozen=True)
class TableRun:
    """One table to validate: its frame and its checks. Built-in tables carry
    ``builtin`` (the name in _BUILTIN, evaluated without GE) and build their GE
    expectations only when a report is rendered; a job's table carries GE objects."""

    table: str
    suite_name: str
    frame: pd.DataFrame
    job_expectations: list
    index_columns: list[str]
    builtin: str | None = None

    @property
    def expectations(self) -> list:
        """GE expectation objects (imports GE for a built-in table)."""
        return builtin_expectations(self.builtin) if self.builtin else self.job_expectations


def builtin_expectations(table: str) -> list[Expectation]:
    import great_expectations.expectations as gxe

    out: list[Expectation] = []
    for name, description, column, kind, args in _BUILTIN[table]:
        meta = {"check": name, "critical": True, "table": table}
        if kind == "true":
            out.append(gxe.ExpectColumnValuesToBeInSet(
                column=column, value_set=[True], description=description, meta=meta))
        else:
            lo, hi = args
            out.append(gxe.ExpectColumnValuesToBeBetween(
                column=column, min_value=lo, max_value=hi, description=description, meta=meta))
    return out


def builtin_run(table: str, frame: pd.DataFrame) -> TableRun:
    return TableRun(table, SUITE_NAMES[table], frame, [], INDEX_COLUMNS[table], table)


def job_run(state_name: str, frame: pd.DataFrame, expectations: list) -> TableRun:
    for exp in expectations:
        meta = dict(exp.meta or {})
        meta.setdefault("check", f"{state_name}.{exp.expectation_type}")
        meta.setdefault("critical", True)
        meta["table"] = f"job:{state_name}"
        exp.meta = meta
    cols = [c for c in ("subtask", "key", "user_key", "key_group") if c in frame.columns]
    return TableRun(f"job:{state_name}", f"ckpt.job.{state_name}", frame, expectations, cols)


# -- the verdict without Great Expectations ----------------------------------------
_EXPECTATION_TYPES = {"true": "expect_column_values_to_be_in_set",
                      "between": "expect_column_values_to_be_between"}


def evaluate_runs(runs: list[TableRun]) -> tuple[list[dict], list[dict]]:
    """(suites, checks) of the summary: built-in tables with pandas, job tables with GE
    (their expectations are GE objects; GE is imported only if there are any)."""
    suites: list[dict] = []
    checks: list[dict] = []
    job_runs = [r for r in runs if r.builtin is None]
    ge_entries: dict[str, tuple[dict, list[dict]]] = {}
    if job_runs:
        load_great_expectations()
        ge_suites, ge_checks = check_entries(run_suites(job_runs, None))
        for suite in ge_suites:
            ge_entries[suite["name"]] = (suite, [c for c in ge_checks
                                                 if c["suite"] == suite["name"]])
    for run in runs:
        if run.builtin is None:
            suite, entries = ge_entries[run.suite_name]
        else:
            started = time.perf_counter()
            entries = [_evaluate(run, spec) for spec in _BUILTIN[run.builtin]]
            failed = sum(not e["success"] for e in entries)
            suite = {"name": run.suite_name, "table": run.table, "success": not failed,
                     "rows": len(run.frame), "checks": len(entries), "failed": failed,
                     "seconds": round(time.perf_counter() - started, 3)}
        suites.append(suite)
        checks.extend(entries)
    return suites, checks


def _evaluate(run: TableRun, spec: tuple[str, str, str, str, tuple]) -> dict:
    """One built-in check as GE reports it (see the module docstring)."""
    name, description, column, kind, args = spec
    frame = run.frame
    entry = {"name": name, "suite": run.suite_name, "table": run.table,
             "expectation": _EXPECTATION_TYPES[kind], "critical": True, "success": False,
             "description": description, "element_count": len(frame),
             "unexpected_count": None, "offending_rows": [], "error": None}
    if column not in frame.columns:  # GE raises a MetricResolutionError: a failed check
        entry["error"] = f'The column "{column}" in BatchData does not exist.'
        return entry
    values = frame[column]
    present = values.notna()
    if kind == "true" and values.dtype == bool:  # (no hashing: most state-table columns)
        ok = values
    elif kind == "true":
        ok = values.isin([True])
    else:
        lo, hi = args
        ok = (values >= lo) & (values <= hi)
    bad = present & ~ok.astype(bool)
    index_cols = [c for c in run.index_columns if c in frame.columns]
    rows = []
    for i in bad.to_numpy().nonzero()[0][:MAX_OFFENDING_ROWS]:
        row = {column: values.iat[i]}
        row.update((c, frame[c].iat[i]) for c in index_cols)
        rows.append(row)
    if not index_cols:
        rows = [{"value": r[column]} for r in rows]
    entry.update(success=not bad.any(), unexpected_count=int(bad.sum()),
                 offending_rows=plain(rows))
    return entry


def plain(value: Any) -> Any:
    """JSON-safe copy of a GE result fragment (numpy scalars, NaN, nested)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def check_entries(results: list[tuple[Any, Any]]) -> tuple[list[dict], list[dict]]:
    """(suites, checks) of the summary from (TableRun, suite result) pairs."""
    suites, checks = [], []
    for run, suite_result in results:
        failed = 0
        for er in suite_result.results:
            cfg = er.expectation_config
            meta = dict(cfg.meta or {})
            res = er.result or {}
            rows = res.get("partial_unexpected_index_list")
            if rows is None:
                rows = [{"value": v} for v in res.get("partial_unexpected_list") or []]
            info = er.exception_info or {}
            error = info.get("exception_message") if info.get("raised_exception") else None
            entry = {
                "name": meta.get("check", cfg.type),
                "suite": run.suite_name,
                "table": run.table,
                "expectation": cfg.type,
                "critical": bool(meta.get("critical", True)),
                "success": bool(er.success),
                "description": cfg.description,
                "element_count": plain(res.get("element_count")),
                "unexpected_count": plain(res.get("unexpected_count")),
                "offending_rows": plain(list(rows)[:MAX_OFFENDING_ROWS]),
                "error": error,
            }
            failed += not entry["success"]
            checks.append(entry)
        suites.append({"name": run.suite_name, "table": run.table,
                       "success": bool(suite_result.success), "rows": len(run.frame),
                       "checks": len(suite_result.results), "failed": failed,
                       "seconds": suite_result.meta.get("ckpt_seconds")})
    return suites, checks


def load_great_expectations() -> None:
    """Import GE now (about 5 s cold) so the caller can time it apart."""
    import great_expectations  # noqa: F401
    import great_expectations.expectations  # noqa: F401

    quiet_ge()


def quiet_ge() -> None:
    for name in ("great_expectations", "great_expectations.core",
                 "great_expectations.data_context"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_suites(runs: list[TableRun], docs_dir: str | None, site_name: str = "ckpt_reports",
               on_result: Callable[[TableRun, Any], None] | None = None
               ) -> list[tuple[TableRun, Any]]:
    """Run every table's suite; build Data Docs into ``docs_dir``; return (run, result)."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    quiet_ge()
    with _no_batch_fingerprint():
        return _run_suites(gx, ProgressBarsConfig, runs, docs_dir, site_name, on_result)


@contextmanager
def _no_batch_fingerprint() -> Iterator[None]:
    # GE hashes every pandas batch (pd.util.hash_pandas_object over all columns) for a
    # "pandas_data_fingerprint" marker we never use: two thirds of GE's time on a
    # 1M-row state table. It skips the hash above HASH_THRESHOLD bytes, so lower it.
    from great_expectations.execution_engine import pandas_execution_engine as engine

    saved = engine.HASH_THRESHOLD
    engine.HASH_THRESHOLD = 0
    try:
        yield
    finally:
        engine.HASH_THRESHOLD = saved


def _run_suites(gx, ProgressBarsConfig, runs, docs_dir, site_name, on_result):  # noqa: N803
    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = ctx.data_sources.add_pandas("checkpoint")
    results = []
    for run in runs:
        asset = source.add_dataframe_asset(run.table.replace(":", "_"))
        batch = asset.add_batch_definition_whole_dataframe("whole")
        suite = ctx.suites.add(gx.ExpectationSuite(name=run.suite_name))
        for exp in run.expectations:
            # a job's expectation may already belong to the verdict's suite: GE refuses
            # to add it to a second one, so each run gets a fresh copy
            fresh = copy.deepcopy(exp)
            fresh.id = None
            suite.add_expectation(fresh)
        vd = ctx.validation_definitions.add(
            gx.ValidationDefinition(name=f"validate {run.suite_name}", data=batch, suite=suite))
        index_cols = [c for c in run.index_columns if c in run.frame.columns]
        started = time.perf_counter()
        result = vd.run(batch_parameters={"dataframe": run.frame}, result_format={
            "result_format": "SUMMARY", "partial_unexpected_count": MAX_OFFENDING_ROWS,
            "unexpected_index_column_names": index_cols, "return_unexpected_index_query": False,
        })
        result.meta["ckpt_seconds"] = round(time.perf_counter() - started, 3)
        results.append((run, result))
        if on_result:
            on_result(run, result)
    if docs_dir:
        ctx.add_data_docs_site(site_name, {
            "class_name": "SiteBuilder",
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            "store_backend": {"class_name": "TupleFilesystemStoreBackend",
                              "base_directory": docs_dir},
        })
        started = time.perf_counter()
        ctx.build_data_docs(site_names=[site_name])
        for _, result in results:
            result.meta["ckpt_docs_seconds"] = round(time.perf_counter() - started, 3)
    return results
