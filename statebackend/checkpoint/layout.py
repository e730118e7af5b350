"""Every path name of a job root, in one place.

Nothing else in the library spells these names (tests/statebackend/checkpoint/
test_layout.py scans the string constants of statebackend/ and plugins/)::

    <job>/shared/<unique>.sst                  immutable, shared by checkpoints
    <job>/chk-<id>/_metadata                   commit record, written last
    <job>/chk-<id>/<subtask>/<snapshot>/...    private files of one checkpoint
    <job>/chk-<id>/_attempts/<s>-<a>-<u>.json  what one task attempt uploaded
    <job>/savepoints/<name>/_metadata          self-contained, never collected
    <job>/leases/<lease>.json                  writer lease and hold leases
    <job>/leases/.takeover-<digest>            claim of a writer taking over a stale lease
    <job>/runs/<run>.json                      ledger of committed runs
    <job>/runs/chain/<block>/<id>-<sha>[-<run>].json   commit log: one entry per commit
    <job>/runs/chain/<block>/<id>.retired      retention retired checkpoint <id>
    <job>/runs/repairs/<utc>-<what>.json       what `ckpt doctor` changed, and why
    <job>/runs/history/<utc>-<run>-<outcome>.json   outcome of each finished attempt
    <job>/reports/chk-<id>/summary.json        validation report (and its data docs)
    <job>/_index/registry.json                 registry index (lifecycle/registry.py)

All functions are pure and return paths relative to the job root. Changing a
name breaks every existing store: names here only ever get added.
"""

from __future__ import annotations

import re

METADATA_FILE = "_metadata"
SHARED_DIR = "shared"
CHK_PREFIX = "chk-"
CHK_DIR_RE = re.compile(r"^chk-(\d+)$")
ATTEMPTS_DIR = "_attempts"
SAVEPOINTS_DIR = "savepoints"
LEASES_DIR = "leases"
LEASE_SUFFIX = ".json"
CLAIM_PREFIX = ".takeover-"
RUNS_DIR = "runs"
HISTORY_DIR = f"{RUNS_DIR}/history"
CHAIN_DIR = f"{RUNS_DIR}/chain"
REPAIRS_DIR = f"{RUNS_DIR}/repairs"
CHAIN_ID_DIGITS = 10  # zero-padded: name order is id order
CHAIN_BLOCK = 1000    # ids per folder of the log: a run lists the newest one or two
CHAIN_BLOCK_DIGITS = 7
CHAIN_DIGEST_DIGITS = 16  # the record's SHA-256, first hex digits: a replaced record shows
RETIRED_SUFFIX = ".retired"
REPORTS_DIR = "reports"
SUMMARY_FILE = "summary.json"
INDEX_DIR = "_index"
INDEX_FILE = f"{INDEX_DIR}/registry.json"
GC_SCOPE_PREFIXES = (SHARED_DIR + "/", CHK_PREFIX)  # `in_gc_scope`'s cheap first test
# Top-level folders that stay when emptied (retention prunes the others).
PERMANENT_DIRS = frozenset({SHARED_DIR, LEASES_DIR, SAVEPOINTS_DIR})


# -- checkpoints ---------------------------------------------------------------------
def checkpoint_dir(checkpoint_id: int) -> str:
    """``chk-<id>``: the folder of one checkpoint (also its label in reports)."""
    return f"{CHK_PREFIX}{checkpoint_id}"


def metadata_path(checkpoint_id: int) -> str:
    return f"{checkpoint_dir(checkpoint_id)}/{METADATA_FILE}"


def private_dir(checkpoint_id: int, subtask: int, snapshot_id: str) -> str:
    return f"{checkpoint_dir(checkpoint_id)}/{subtask}/{snapshot_id}"


def shared_path(unique_name: str) -> str:
    return f"{SHARED_DIR}/{unique_name}"


def chk_id_of(path: str) -> int | None:
    """The id of ``chk-<id>`` or ``chk-<id>/...``, else None (CHK_DIR_RE's digits,
    without a regex: called for every listed file)."""
    if not path.startswith(CHK_PREFIX):
        return None
    end = path.find("/")
    digits = path[len(CHK_PREFIX):] if end < 0 else path[len(CHK_PREFIX):end]
    return int(digits) if digits.isdecimal() else None


COMMIT_RECORD_SUFFIX = "/" + METADATA_FILE


def is_commit_record(path: str) -> bool:
    """``chk-<id>/_metadata``."""
    return path.endswith(COMMIT_RECORD_SUFFIX) and path.count("/") == 1 \
        and chk_id_of(path) is not None


def in_gc_scope(path: str) -> bool:
    """Files GC may ever consider: under ``shared/`` or a ``chk-<id>/`` folder."""
    return path.startswith(SHARED_DIR + "/") or chk_id_of(path) is not None


def belongs_to_attempt(path: str, checkpoint_id: int) -> bool:
    """Whether an attempt at ``checkpoint_id`` may have written ``path`` (and may delete it)."""
    return path.startswith((SHARED_DIR + "/", checkpoint_dir(checkpoint_id) + "/"))


def attempts_dir(checkpoint_id: int) -> str:
    return f"{checkpoint_dir(checkpoint_id)}/{ATTEMPTS_DIR}"


def attempt_record_path(checkpoint_id: int, subtask: int, attempt: int, unique: str) -> str:
    return f"{attempts_dir(checkpoint_id)}/{subtask}-{attempt}-{unique}.json"


# -- savepoints ----------------------------------------------------------------------
def savepoint_dir(name: str) -> str:
    return f"{SAVEPOINTS_DIR}/{name}"


def savepoint_metadata_path(name: str) -> str:
    return f"{savepoint_dir(name)}/{METADATA_FILE}"


def savepoint_of(path: str) -> tuple[str, bool] | None:
    """(name, is its _metadata) of a path under ``savepoints/<name>/``, else None."""
    parts = path.split("/")
    if parts[0] != SAVEPOINTS_DIR or len(parts) < 3:
        return None
    return parts[1], len(parts) == 3 and parts[2] == METADATA_FILE


# -- leases --------------------------------------------------------------------------
def lease_path(name: str) -> str:
    return f"{LEASES_DIR}/{name}{LEASE_SUFFIX}"


def is_lease_file(path: str) -> bool:
    """``leases/<name>.json`` (temp files and take-over claims start with a dot)."""
    parts = path.split("/")
    return (len(parts) == 2 and parts[0] == LEASES_DIR and parts[1].endswith(LEASE_SUFFIX)
            and not parts[1].startswith("."))


def claim_path(digest: str) -> str:
    return f"{LEASES_DIR}/{CLAIM_PREFIX}{digest}"


# -- runs ----------------------------------------------------------------------------
def run_record_path(safe_run_name: str) -> str:
    return f"{RUNS_DIR}/{safe_run_name}.json"


def history_path(stamp: str, safe_run_name: str, outcome: str) -> str:
    return f"{HISTORY_DIR}/{stamp}-{safe_run_name}-{outcome}.json"


# -- the commit log (statebackend.checkpoint.lineage) ----------------------------------
def chain_block_dir(checkpoint_id: int) -> str:
    """``runs/chain/<block>``: the folder of the log holding ``checkpoint_id``."""
    return f"{CHAIN_DIR}/{checkpoint_id // CHAIN_BLOCK:0{CHAIN_BLOCK_DIGITS}d}"


def chain_block_of(name: str) -> int | None:
    """The block number of a folder name under ``runs/chain/``, else None."""
    ok = len(name) == CHAIN_BLOCK_DIGITS and name.isdecimal() and name.isascii()
    return int(name) if ok else None


def chain_entry_path(checkpoint_id: int, digest: str, safe_run_name: str | None) -> str:
    """``runs/chain/<block>/<id>-<sha>-<run>.json`` (``<id>-<sha>.json`` for a commit of
    no run); ``<sha>``: the first `CHAIN_DIGEST_DIGITS` hex digits of the record's SHA-256."""
    run = f"-{safe_run_name}" if safe_run_name else ""
    return (f"{chain_block_dir(checkpoint_id)}/{checkpoint_id:0{CHAIN_ID_DIGITS}d}-"
            f"{digest[:CHAIN_DIGEST_DIGITS]}{run}{LEASE_SUFFIX}")


def retired_marker_path(checkpoint_id: int) -> str:
    return f"{chain_block_dir(checkpoint_id)}/{checkpoint_id:0{CHAIN_ID_DIGITS}d}{RETIRED_SUFFIX}"


def chain_name_of(name: str) -> tuple[int, str | None, str | None] | None:
    """(checkpoint id, record digest or None for a retired marker, safe run name or None)
    of a file name in a block of ``runs/chain/``, else None (temp files, foreign names)."""
    digits = name[:CHAIN_ID_DIGITS]
    if len(digits) < CHAIN_ID_DIGITS or not (digits.isdecimal() and digits.isascii()):
        return None
    rest = name[CHAIN_ID_DIGITS:]
    if rest == RETIRED_SUFFIX:
        return int(digits), None, None
    if not rest.endswith(LEASE_SUFFIX) or not rest.startswith("-"):
        return None
    rest = rest[1:-len(LEASE_SUFFIX)]
    n = CHAIN_DIGEST_DIGITS
    digest, sep, run = rest[:n], rest[n:n + 1], rest[n + 1:]
    if len(digest) < CHAIN_DIGEST_DIGITS or any(c not in "0123456789abcdef" for c in digest):
        return None
    if sep == "" and not run:
        return int(digits), digest, None
    if sep != "-" or not run:
        return None
    return int(digits), digest, run


def repair_record_path(stamp: str, what: str) -> str:
    return f"{REPAIRS_DIR}/{stamp}-{what}{LEASE_SUFFIX}"


def history_name_of(name: str) -> tuple[str, str] | None:
    """(safe run name, outcome) of a file name in ``runs/history/``, else None."""
    if not name.endswith(LEASE_SUFFIX):
        return None
    stamp, sep, rest = name[:-len(LEASE_SUFFIX)].partition("-")
    run, sep2, outcome = rest.rpartition("-")
    if not sep or not sep2 or not stamp.isdecimal() or not run:
        return None
    return run, outcome


# -- reports -------------------------------------------------------------------------
def report_dir(checkpoint_id: int) -> str:
    return f"{REPORTS_DIR}/{checkpoint_dir(checkpoint_id)}"


def report_summary_path(checkpoint_id: int) -> str:
    return f"{report_dir(checkpoint_id)}/{SUMMARY_FILE}"
