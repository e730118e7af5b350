"""Publishing a run's outputs: its folders, their ``_SUCCESS`` markers, and finishing
what a crash between a commit and its markers left.

Outputs: ``<output>/run=<run>/part-<subtask>.parquet`` for a job with one output,
``<output>/<name>/run=<run>/...`` with several; rejected rows go to
``<quarantine>/run=<run>/`` (default quarantine: ``<output>/_quarantine``). A run's
folders are published (``_SUCCESS``) only after its checkpoint is committed, and a
re-run of a committed run id publishes only complete folders (`finish_publication`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from statebackend.checkpoint.runs import RunRecord, safe_run_name
from statebackend.job.api import Job
from statebackend.job.config import RunConfig
from statebackend.job.results import TaskResult
from statebackend.job.task import output_folder, part_name
from statebackend.progress import ProgressSink
from statebackend.storage import Storage


def run_dir_name(run_id: str) -> str:
    """Folder of one run under output/quarantine: readable, path-safe, collision-free."""
    return f"run={safe_run_name(run_id)}"


def run_folders(job: Job, run_id: str) -> dict[str, str]:
    """{output name: its run folder relative to the output root}."""
    run_dir = run_dir_name(run_id)
    return {o.name: "/".join(x for x in (output_folder(job, o.name), run_dir) if x)
            for o in job.outputs}


def output_parts(job: Job, results: Sequence[TaskResult]) -> list[str] | dict[str, list[str]]:
    """Parts written per output: a list for a job with one output (release-1 form)."""
    written: dict[str, list[str]] = {o.name: [] for o in job.outputs}
    for r in sorted(results, key=lambda r: r.subtask):
        for name in r.outputs:
            written[name].append(part_name(r.subtask))
    if len(job.outputs) == 1:
        return written[job.outputs[0].name]
    return written


def delete_run_outputs(job: Job, config: RunConfig) -> None:
    """Remove the run's output folders (a crashed attempt's leftovers, or a discard)."""
    if not job.outputs:
        return
    out = config.open(config.output_url)
    for folder in run_folders(job, config.run_id).values():
        out.delete_tree(folder)


def publish_outputs(job: Job, config: RunConfig, progress: ProgressSink) -> None:
    """``_SUCCESS`` in every run folder of the outputs (after the commit)."""
    folders = run_folders(job, config.run_id)
    progress.phase(f"run {config.run_id}: publishing outputs", total=len(folders),
                   unit="outputs")
    for folder in folders.values():
        _write_success(config, folder)
        progress.advance()


def _write_success(config: RunConfig, folder: str) -> None:
    config.open(config.output_url).write_bytes(f"{folder}/_SUCCESS", b"")


def finish_publication(job: Job, config: RunConfig, done: RunRecord
                       ) -> tuple[bool, list[str]]:
    """Write the run's missing ``_SUCCESS`` files; returns (any written now, missing parts)."""
    if not job.outputs:
        return False, []
    out = config.open(config.output_url)
    recorded = done.extra.get("output_parts")
    written, missing = False, []
    for name, folder in run_folders(job, config.run_id).items():
        if out.exists(f"{folder}/_SUCCESS"):
            continue
        parts = recorded.get(name) if isinstance(recorded, dict) else recorded
        gone = _missing_parts(out, folder, parts, done)
        if gone:
            missing += [f"{folder}/{p}" if len(job.outputs) > 1 else p for p in gone]
            continue
        _write_success(config, folder)
        written = True
    return written, missing


def _missing_parts(out: Storage, folder: str, parts: Any, done: RunRecord) -> list[str]:
    if isinstance(parts, list):
        return [str(p) for p in parts if not out.exists(f"{folder}/{p}")]
    # Committed before output_parts was recorded: a folder with parts will do, or none
    # at all when the run touched no key.
    if done.extra.get("keys_touched") == 0 or any(
            n.endswith(".parquet") for n in out.list_dir(folder)):
        return []
    return ["part-*.parquet"]
