"""Manifest-level tables of one checkpoint (no restore, no GE here).

The raw ``_metadata`` is parsed twice: strictly (`CheckpointMetadata.from_bytes`,
whose error becomes the ``metadata_error`` of the checkpoint table, so a refused
record is a failed check, not a crash) and leniently (plain JSON with type
guards), so that even a refused record yields rows to name the offending path.
A path that is absolute or contains ``..`` is never touched on storage.

Tables (pandas):

- ``files``: one row per file reference: checkpoint_id, subtask, key_group_start,
  key_group_end, kind (shared/private), path, path_safe, recorded_size,
  recorded_checksum, exists, actual_size, size_ok, actual_checksum, checksum_ok
  (None = not checked: column expectations skip nulls);
- ``subtasks``: one row per subtask record, sorted by range start: index, range,
  the range Flink's formula gives for (P, M), range_ok, gap_before, overlap_before,
  gap_after (uncovered key groups after the last range), uncovered_key_groups (sum);
- ``checkpoint``: one row: ids, P, subtask_count, M, max_parallelism_ok, parent,
  parent_ok (null parent, parent committed, or parent retired: older than every
  committed checkpoint), metadata_ok, metadata_error.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pandas as pd

from statebackend.checkpoint.layout import metadata_path
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CkptError, MetadataError
from statebackend.state.codecs import codec_from_json
from statebackend.state.keygroups import MAX_MAX_PARALLELISM
from statebackend.state.schema import check_schema_keys, schema_of
from statebackend.storage import CHECKSUM_ALGORITHM, checksum_algorithm, safe_relpath

CHECK_THREADS = 8


@dataclass
class FileFacts:
    """What storage says about one referenced file (None = not checked)."""

    exists: bool | None = None
    size: int | None = None
    checksum: str | None = None


@dataclass
class ManifestTables:
    checkpoint_id: int
    raw: dict | None
    meta: CheckpointMetadata | None
    metadata_error: str | None
    files: pd.DataFrame
    subtasks: pd.DataFrame
    checkpoint: pd.DataFrame
    states: pd.DataFrame
    facts: dict[str, FileFacts] = field(default_factory=dict)


def read_raw_metadata(store: CheckpointStore, checkpoint_id: int
                      ) -> tuple[bytes, dict | None, CheckpointMetadata | None, str | None]:
    """(raw bytes, lenient JSON object, strict metadata or None, strict error or None)."""
    rel = metadata_path(checkpoint_id)
    where = f"{store.storage.url}/{rel}"
    raw = store.storage.read_bytes(rel)
    meta, error = None, None
    try:
        meta = CheckpointMetadata.from_bytes(raw, where)
        if meta.checkpoint_id != checkpoint_id or meta.job != store.job:
            raise MetadataError(
                f"malformed metadata {where}: it describes job {meta.job!r} checkpoint "
                f"{meta.checkpoint_id}, not job {store.job!r} checkpoint {checkpoint_id}")
    except CkptError as exc:
        meta, error = None, f"{type(exc).__name__}: {exc}"
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        obj = None
    return raw, obj if isinstance(obj, dict) else None, meta, error


def _int(value: object, default: int = -1) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _file_records(obj: dict | None, checkpoint_id: int) -> list[dict]:
    rows = []
    subtasks = obj.get("subtasks") if obj else None
    for st in subtasks if isinstance(subtasks, list) else []:
        if not isinstance(st, dict):
            continue
        for kind in ("shared", "private"):
            refs = st.get(f"{kind}_files")
            for ref in refs if isinstance(refs, list) else []:
                ref = ref if isinstance(ref, dict) else {}
                path = ref.get("path")
                try:
                    # the metadata parser's path rules: relative, inside the root, printable
                    safe = safe_relpath(path) if isinstance(path, str) and path.isprintable() \
                        and "\\" not in path else None
                except CkptError:
                    safe = None
                rows.append({
                    "checkpoint_id": checkpoint_id,
                    "subtask": _int(st.get("index")),
                    "key_group_start": _int(st.get("key_group_start")),
                    "key_group_end": _int(st.get("key_group_end")),
                    "kind": kind,
                    "path": str(path),
                    "safe_path": safe,
                    "path_safe": safe is not None,
                    "recorded_size": _int(ref.get("size")),
                    "recorded_checksum": str(ref.get("checksum")),
                })
    return rows


def file_facts(store: CheckpointStore, paths: list[str], checksums: bool,
               threads: int = CHECK_THREADS,
               algorithms: dict[str, str] | None = None) -> dict[str, FileFacts]:
    """Existence, size and (optionally) streamed checksum of each safe path.

    ``algorithms`` maps a path to the algorithm of its recorded checksum
    (default: the current one), so old "crc32:" records are verified as written.
    """
    algorithms = algorithms or {}

    def probe(rel: str) -> FileFacts:
        info = store.storage.info(rel)
        if info is None:
            return FileFacts(exists=False)
        facts = FileFacts(exists=True, size=info.size)
        if checksums:
            algorithm = algorithms.get(rel, CHECKSUM_ALGORITHM)
            facts.size, facts.checksum = store.storage.checksum(rel, algorithm)
        return facts

    unique = sorted(set(paths))
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return dict(zip(unique, pool.map(probe, unique), strict=True))


def files_table(records: list[dict], facts: dict[str, FileFacts]) -> pd.DataFrame:
    rows = []
    for rec in records:
        f = facts.get(rec["safe_path"]) if rec["safe_path"] else None
        f = f or FileFacts()
        row = {k: v for k, v in rec.items() if k != "safe_path"}
        row["exists"] = f.exists
        row["actual_size"] = f.size
        row["size_ok"] = None if f.size is None else f.size == rec["recorded_size"]
        if f.exists is False:
            row["size_ok"] = None  # named by files_exist already
        row["actual_checksum"] = f.checksum
        row["checksum_ok"] = None if f.checksum is None else f.checksum == rec["recorded_checksum"]
        rows.append(row)
    columns = ["checkpoint_id", "subtask", "key_group_start", "key_group_end", "kind", "path",
               "path_safe", "recorded_size", "recorded_checksum", "exists", "actual_size",
               "size_ok", "actual_checksum", "checksum_ok"]
    df = pd.DataFrame(rows, columns=columns)
    for col in ("exists", "size_ok", "checksum_ok", "actual_size", "actual_checksum"):
        df[col] = df[col].astype(object)
    return df


def subtasks_table(obj: dict | None, checkpoint_id: int) -> pd.DataFrame:
    subtasks = obj.get("subtasks") if obj else None
    subtasks = [s for s in subtasks if isinstance(s, dict)] if isinstance(subtasks, list) else []
    p = len(subtasks)
    m = _int(obj.get("max_parallelism")) if obj else -1
    formula_ok = 1 <= p <= m <= MAX_MAX_PARALLELISM
    rows = []
    for st in subtasks:
        idx = _int(st.get("index"))
        start, end = _int(st.get("key_group_start")), _int(st.get("key_group_end"))
        if formula_ok and 0 <= idx < p:
            exp_start = (idx * m + p - 1) // p
            exp_end = ((idx + 1) * m - 1) // p
        else:
            exp_start, exp_end = -1, -1
        rows.append({"checkpoint_id": checkpoint_id, "subtask": idx, "key_group_start": start,
                     "key_group_end": end, "expected_start": exp_start, "expected_end": exp_end,
                     "range_ok": formula_ok and (start, end) == (exp_start, exp_end)})
    rows.sort(key=lambda r: (r["key_group_start"], r["key_group_end"]))
    next_free = 0  # first key group not covered by the ranges seen so far
    for i, r in enumerate(rows):
        start, end = r["key_group_start"], r["key_group_end"]
        r["gap_before"] = max(0, start - next_free)
        r["overlap_before"] = max(0, next_free - start) if i else 0
        next_free = max(next_free, end + 1)
        r["gap_after"] = max(0, m - next_free) if i == len(rows) - 1 else 0
        r["uncovered_key_groups"] = r["gap_before"] + r["gap_after"]
    columns = ["checkpoint_id", "subtask", "key_group_start", "key_group_end", "expected_start",
               "expected_end", "range_ok", "gap_before", "overlap_before", "gap_after",
               "uncovered_key_groups"]
    return pd.DataFrame(rows, columns=columns)


def states_table(obj: dict | None, checkpoint_id: int) -> pd.DataFrame:
    """One row per recorded state: its schema (statebackend.state.schema) and whether this
    release reads it; the versions of its history must rise to its current one."""
    states = obj.get("states") if obj else None
    rows = []
    for raw in states if isinstance(states, list) else []:
        if not isinstance(raw, dict):
            continue
        s = schema_of(raw)
        error = check_schema_keys(raw)
        try:
            codec = codec_from_json(s["codec"]).to_json()
        except CkptError as exc:
            codec, error = s["codec"], error or str(exc)
        history = s["history"] if isinstance(s["history"], list) else []
        versions = [h.get("schema_version") for h in history if isinstance(h, dict)]
        versions.append(s["schema_version"])
        int_versions = [v for v in versions if isinstance(v, int)]
        rows.append({
            "checkpoint_id": checkpoint_id, "state": str(s.get("name")), "kind": s["kind"],
            "codec": json.dumps(codec, sort_keys=True),
            "ttl": json.dumps(s["ttl"], sort_keys=True) if s["ttl"] else "",
            "schema_version": s["schema_version"], "upgrade_version": s["upgrade_version"],
            "history": " -> ".join(f"v{h.get('schema_version')} {h.get('name')}"
                                   for h in history if isinstance(h, dict)),
            "schema_error": error or "", "schema_ok": error is None,
            "history_ok": len(int_versions) == len(versions)
            and int_versions == sorted(set(int_versions))})
    columns = ["checkpoint_id", "state", "kind", "codec", "ttl", "schema_version",
               "upgrade_version", "history", "schema_error", "schema_ok", "history_ok"]
    return pd.DataFrame(rows, columns=columns)


def checkpoint_table(store: CheckpointStore, checkpoint_id: int, obj: dict | None,
                     error: str | None) -> pd.DataFrame:
    obj = obj or {}
    subtasks = obj.get("subtasks")
    count = len(subtasks) if isinstance(subtasks, list) else 0
    p, m = _int(obj.get("parallelism")), _int(obj.get("max_parallelism"))
    parent = obj.get("parent")
    if parent is None and "parent" in obj:
        parent_ok, parent_text = True, "null"
    elif isinstance(parent, int) and not isinstance(parent, bool) and 0 < parent < checkpoint_id:
        # Retention retires the oldest checkpoints first, so a parent older than every
        # committed checkpoint was retired on purpose (its shared files stay referenced
        # directly); a missing parent inside the retained chain is a hole.
        parent_ok = store.storage.exists(metadata_path(parent)) \
            or parent < min(store.checkpoint_ids(), default=checkpoint_id)
        parent_text = str(parent)
    else:
        parent_ok, parent_text = False, repr(parent)
    return pd.DataFrame([{
        "checkpoint_id": checkpoint_id,
        "job": store.job,
        "metadata_ok": error is None,
        "metadata_error": error or "",
        "parallelism": p,
        "subtask_count": count,
        "parallelism_ok": p == count and p >= 1,
        "max_parallelism": m,
        "max_parallelism_ok": 1 <= m <= MAX_MAX_PARALLELISM and p <= m,
        "parent": parent_text,
        "parent_ok": parent_ok,
    }])


def build_manifest(store: CheckpointStore, checkpoint_id: int, *, checksums: bool | None = True
                   ) -> ManifestTables:
    """Every manifest table; with ``checksums`` each existing file is read once.

    ``checksums=None`` (deep validation, whose downloads checksum every file of a parsed
    record): read checksums here only if the strict parser refused the record, so that
    a damaged file is still named when nothing can be restored.
    """
    _, obj, meta, error = read_raw_metadata(store, checkpoint_id)
    if checksums is None:
        checksums = meta is None
    records = _file_records(obj, checkpoint_id)
    algorithms = {r["safe_path"]: recorded_algorithm(r["recorded_checksum"])
                  for r in records if r["safe_path"]}
    facts = file_facts(store, list(algorithms), checksums, algorithms=algorithms)
    return ManifestTables(
        checkpoint_id=checkpoint_id, raw=obj, meta=meta, metadata_error=error,
        files=files_table(records, facts), subtasks=subtasks_table(obj, checkpoint_id),
        checkpoint=checkpoint_table(store, checkpoint_id, obj, error),
        states=states_table(obj, checkpoint_id), facts=facts)


def refresh_files(tables: ManifestTables, facts: dict[str, FileFacts]) -> None:
    """Replace storage facts (e.g. checksums taken by deep downloads) and rebuild ``files``."""
    tables.facts.update(facts)
    records = _file_records(tables.raw, tables.checkpoint_id)
    tables.files = files_table(records, tables.facts)


def recorded_algorithm(recorded: str) -> str:
    """Algorithm of a recorded checksum; an unknown one is reported as a mismatch."""
    try:
        return checksum_algorithm(recorded)
    except MetadataError:
        return CHECKSUM_ALGORITHM
