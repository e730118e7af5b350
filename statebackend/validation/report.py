"""JSON summary and Data Docs of one validation, and where they are stored.

Layout (on the checkpoint storage, next to the checkpoints)::

    <job root>/reports/chk-<id>/summary.json     the JSON summary (below)
    <job root>/reports/chk-<id>/index.html       overview page: self-contained (no scripts,
                                                 no CDN), status, suites, offending rows,
                                                 links to the GE validation pages
    <job root>/reports/chk-<id>/data_docs/...    Great Expectations Data Docs (their pages
                                                 render without scripts)
    <job root>/reports/chk-<id>/data_docs/index.html  our static index of those pages:
                                                 GE's own index draws its list with
                                                 CDN scripts, so it is blank offline and
                                                 under the no-script CSP the Checkpoints
                                                 page serves reports with

With ``--report-dir DIR`` the same tree is written to ``DIR/chk-<id>/`` instead.
On file:// the docs are built in place; on other storages they are built in a
temp folder and uploaded with `Storage.put_file`. A new validation replaces the
checkpoint's previous report. Only ``reports/`` is ever written. Publication is
all or nothing for a reader: ``summary.json`` first, ``index.html`` last, and a
failed publication removes what it wrote (see `finish_report`).

Summary (``SUMMARY_VERSION`` 1; changes must stay backward-compatible)::

    {"summary_version": 1, "job", "checkpoint_id", "validated_at", "deep",
     "level" ("manifest", "deep": per-entry checks on a sample, "full": every entry;
     absent in summaries written before levels: then "deep" or "manifest"), "success",
     "critical_failures", "failed_checks": [names],
     "suites": [{"name", "table", "success", "rows", "checks", "failed"}],
     "checks": [{"name", "suite", "table", "critical", "success", "description",
                 "element_count", "unexpected_count", "offending_rows": [<= 20 rows],
                 "error"}],
     "figures": {...}, "timings": {...}, "report_location", "data_docs_index",
     "report_index", "duration_seconds"}
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass

from statebackend.checkpoint import layout
from statebackend.checkpoint.layout import SUMMARY_FILE
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CkptError, StorageError
from statebackend.storage import Storage

SUMMARY_VERSION = 1
OVERVIEW_FILE = "index.html"
DOCS_DIR = "data_docs"


def report_rel(checkpoint_id: int) -> str:
    return layout.report_dir(checkpoint_id)


@dataclass(frozen=True)
class ReportTarget:
    """Where one report is built locally and where it ends up."""

    local_dir: str
    location: str
    upload_rel: str | None  # set when the local dir is a temp copy to upload

    @property
    def docs_dir(self) -> str:
        return os.path.join(self.local_dir, DOCS_DIR)

    @property
    def index_url(self) -> str:
        return f"{self.location}/{DOCS_DIR}/index.html"


def prepare_report(storage: Storage, checkpoint_id: int, report_dir: str | None) -> ReportTarget:
    """An empty local folder for the report (replacing the checkpoint's previous one)."""
    if report_dir:
        local = os.path.join(os.path.abspath(report_dir), layout.checkpoint_dir(checkpoint_id))
        target = ReportTarget(local, f"file://{local}", None)
    else:
        rel = report_rel(checkpoint_id)
        storage.delete_tree(rel)
        in_place = storage.local_path(rel)  # None: remote storage, built in a temp copy
        if in_place is not None:
            target = ReportTarget(in_place, f"{storage.url}/{rel}", None)
        else:
            target = ReportTarget(tempfile.mkdtemp(prefix="ckpt-report-"),
                                  f"{storage.url}/{rel}", rel)
    shutil.rmtree(target.local_dir, ignore_errors=True)
    os.makedirs(target.docs_dir, exist_ok=True)
    return target


def finish_report(storage: Storage, target: ReportTarget, summary: dict) -> str | None:
    """Write the summary next to the docs and upload when needed; the index URL or None.

    All or nothing for a reader: ``summary.json`` is written first and the overview
    ``index.html`` last, so whoever finds the overview finds its summary (the
    Checkpoints page links the overview). On any failure (storage full, unreachable,
    local disk full) what was written is removed and one StorageError names the
    report location and the cause.
    """
    index = target.index_url if os.path.exists(os.path.join(target.docs_dir, "index.html")) \
        else None
    if index is None:  # not rendered (report "none"): leave no empty docs folder
        shutil.rmtree(target.docs_dir, ignore_errors=True)
    summary["report_location"] = target.location
    summary["data_docs_index"] = index
    summary["report_index"] = f"{target.location}/{OVERVIEW_FILE}"
    try:
        if index is not None:
            with open(os.path.join(target.docs_dir, "index.html"), "w", encoding="utf-8") as fh:
                fh.write(docs_index_html(summary, suite_pages(target.docs_dir),
                                         expectation_pages(target.docs_dir)))
        with open(os.path.join(target.local_dir, SUMMARY_FILE), "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1, sort_keys=True)
        with open(os.path.join(target.local_dir, OVERVIEW_FILE), "w", encoding="utf-8") as fh:
            fh.write(overview_html(summary, suite_pages(target.docs_dir)))
        if target.upload_rel is not None:
            _upload(storage, target.local_dir, target.upload_rel)
    except (OSError, CkptError) as exc:
        _remove_partial(storage, target)
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StorageError(
            f"validation report {target.location} was not published: {cause}; the partial "
            "report was removed (free space on the storage or use --report-dir DIR)") from exc
    finally:
        if target.upload_rel is not None:
            shutil.rmtree(target.local_dir, ignore_errors=True)
    return index


def publication_order(local_dir: str) -> list[str]:
    """Files of a built report, relative and '/'-separated: summary first, overview last."""
    files = sorted(os.path.relpath(os.path.join(d, n), local_dir).replace(os.sep, "/")
                   for d, _, names in os.walk(local_dir) for n in names)
    return sorted(files, key=lambda rel: (rel != SUMMARY_FILE, rel == OVERVIEW_FILE))


def _upload(storage: Storage, local_dir: str, upload_rel: str) -> None:
    for rel in publication_order(local_dir):
        storage.put_file(os.path.join(local_dir, *rel.split("/")), f"{upload_rel}/{rel}")


def _remove_partial(storage: Storage, target: ReportTarget) -> None:
    """Best effort: the caller reports the original failure, not a cleanup error."""
    if target.upload_rel is not None:
        try:
            storage.delete_tree(target.upload_rel)
        except CkptError:
            pass
    shutil.rmtree(target.local_dir, ignore_errors=True)


def discard_report(target: ReportTarget) -> None:
    """A validation that failed before `finish_report`: drop the half-built report
    (on file:// and --report-dir it was built in place)."""
    shutil.rmtree(target.local_dir, ignore_errors=True)


def read_report_summary(store: CheckpointStore, checkpoint_id: int) -> dict | None:
    """The stored JSON summary of a checkpoint's last validation, or None."""
    rel = layout.report_summary_path(checkpoint_id)
    data = store.storage.read_bytes_if_exists(rel)
    if data is None:
        return None
    try:
        summary = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return summary if isinstance(summary, dict) else None


_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
h1{font-size:1.5em} .pass{color:#0a7d2c;font-weight:bold} .fail{color:#b00020;font-weight:bold}
.warn{color:#a66300;font-weight:bold}
table{border-collapse:collapse;margin:1em 0;width:100%} th,td{border:1px solid #ccc;
padding:4px 8px;text-align:left;vertical-align:top;font-size:.9em} th{background:#f3f3f3}
code,pre{font-size:.85em} pre{white-space:pre-wrap;margin:0}
"""


LEVEL_TEXT = {"manifest": "manifest",
              "deep": "deep (manifest + content; per-entry checks on a sample)",
              "full": "full (manifest + content; every entry checked)"}


def overview_html(summary: dict, suite_pages: dict[str, str]) -> str:
    """A self-contained page (no scripts, no external assets): status, suites, failures."""
    from html import escape

    def status(ok: bool, critical: bool = True) -> str:
        if ok:
            return '<span class="pass">PASSED</span>'
        if critical:
            return '<span class="fail">FAILED</span>'
        return '<span class="warn">WARNING</span>'

    title = f"Checkpoint {summary['checkpoint_id']} of job {summary['job']}"
    level = LEVEL_TEXT.get(summary.get("level") or ("deep" if summary["deep"] else "manifest"),
                           "unknown")
    if summary.get("level") == "deep" and "entries_checked" in summary.get("figures", {}):
        f = summary["figures"]
        level += (f" ({f['entries_checked']:,} of {f['state_rows']:,} entries checked one by "
                  f"one; sample seed {f.get('sample_seed')})")
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)} - "
           f"validation</title><style>{_STYLE}</style></head><body>",
           f"<h1>{escape(title)}: <span id='status'>{status(summary['success'])}</span></h1>",
           f"<p>Validation level: {level}. Validated at {escape(summary['validated_at'])} in "
           f"{summary['duration_seconds']} s. Critical failures: "
           f"{summary['critical_failures']}. " + (
               "Full Great Expectations Data Docs: "
               f"<a href='{DOCS_DIR}/index.html'>{DOCS_DIR}/index.html</a> "
               "(static pages: no scripts, no internet access needed).</p>"
               if summary.get("data_docs_index") else
               "Great Expectations Data Docs were not rendered for this validation "
               "(<code>ckpt validate --report now</code> renders them).</p>"),
           "<h2>Expectation suites</h2><table id='suites'><tr><th>Suite</th><th>Table</th>"
           "<th>Rows</th><th>Checks passed</th><th>Status</th></tr>"]
    for s in summary["suites"]:
        name = escape(s["name"])
        link = suite_pages.get(s["name"])
        cell = f"<a href='{escape(link)}'>{name}</a>" if link else name
        out.append(f"<tr><td>{cell}</td><td>{escape(s['table'])}</td><td>{s['rows']}</td>"
                   f"<td>{s['checks'] - s['failed']}/{s['checks']}</td>"
                   f"<td>{status(s['success'])}</td></tr>")
    out.append("</table><h2>Checks</h2><table id='checks'><tr><th>Check</th><th>Suite</th>"
               "<th>Description</th><th>Unexpected</th><th>Status</th></tr>")
    for c in summary["checks"]:
        out.append(f"<tr><td><code>{escape(c['name'])}</code></td><td>{escape(c['suite'])}</td>"
                   f"<td>{escape(str(c['description'] or ''))}</td>"
                   f"<td>{c['unexpected_count'] if c['unexpected_count'] is not None else ''}"
                   f" / {c['element_count'] if c['element_count'] is not None else ''}</td>"
                   f"<td>{status(c['success'], c['critical'])}</td></tr>")
    out.append("</table>")
    failed = [c for c in summary["checks"] if not c["success"]]
    if failed:
        out.append("<h2>Failed checks and offending rows</h2>")
    for c in failed:
        out.append(f"<h3><code>{escape(c['name'])}</code> ({escape(c['suite'])})</h3>")
        if c.get("error"):
            out.append(f"<p>Error: {escape(str(c['error']))}</p>")
        rows = c["offending_rows"]
        if rows:
            cols = list(dict.fromkeys(k for r in rows for k in r))
            out.append("<table><tr>" + "".join(f"<th>{escape(k)}</th>" for k in cols) + "</tr>")
            for r in rows:
                out.append("<tr>" + "".join(f"<td><pre>{escape(str(r.get(k, '')))}</pre></td>"
                                            for k in cols) + "</tr>")
            out.append(f"</table><p>{len(rows)} of {c['unexpected_count']} rows shown.</p>")
    out.append("</body></html>")
    return "\n".join(out)


def _status_span(ok: bool) -> str:
    return '<span class="pass">PASSED</span>' if ok else '<span class="fail">FAILED</span>'


def docs_index_html(summary: dict, validation_pages: dict[str, str],
                    suite_docs: dict[str, str]) -> str:
    """The Data Docs index as a static page (replaces GE's, which needs CDN scripts):
    every suite with its status, its validation result page and its expectation page.
    Links are relative to ``data_docs/``; the style is inline (no external assets)."""
    from html import escape

    prefix = f"{DOCS_DIR}/"
    title = f"Checkpoint {summary['checkpoint_id']} of job {summary['job']}"
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)} - Data "
           f"Docs</title><style>{_STYLE}</style></head><body>",
           f"<h1>{escape(title)}: Data Docs <span id='status'>"
           f"{_status_span(summary['success'])}</span></h1>",
           "<p><a href='../index.html'>Validation overview</a> (checks and offending rows). "
           "Great Expectations pages of this validation:</p>",
           "<table id='validations'><tr><th>Suite</th><th>Table</th><th>Rows</th>"
           "<th>Checks passed</th><th>Status</th><th>Validation result</th>"
           "<th>Expectation suite</th></tr>"]
    for s in summary["suites"]:
        result = validation_pages.get(s["name"], "").removeprefix(prefix)
        suite = suite_docs.get(s["name"], "")
        out.append(
            f"<tr><td>{escape(s['name'])}</td><td>{escape(s['table'])}</td><td>{s['rows']}</td>"
            f"<td>{s['checks'] - s['failed']}/{s['checks']}</td><td>{_status_span(s['success'])}"
            "</td><td>" + (f"<a class='result' href='{escape(result)}'>result</a>" if result
                           else "") + "</td><td>"
            + (f"<a class='suite' href='{escape(suite)}'>expectations</a>" if suite else "")
            + "</td></tr>")
    out.append("</table></body></html>")
    return "\n".join(out)


def expectation_pages(docs_dir: str) -> dict[str, str]:
    """Suite name -> its GE expectation suite page, relative to ``data_docs/``."""
    pages = {}
    root = os.path.join(docs_dir, "expectations")
    for dirpath, _, names in os.walk(root):
        for n in names:
            if n.endswith(".html"):
                rel = os.path.relpath(os.path.join(dirpath, n), root).split(os.sep)
                # expectations/<suite name split on '.'>.html
                pages[".".join(rel)[: -len(".html")]] = "expectations/" + "/".join(rel)
    return pages


def suite_pages(docs_dir: str) -> dict[str, str]:
    """Suite name -> its GE validation page, relative to the report folder."""
    pages = {}
    root = os.path.join(docs_dir, "validations")
    for dirpath, _, names in os.walk(root):
        for n in names:
            if n.endswith(".html"):
                rel = os.path.relpath(dirpath, root).split(os.sep)
                # validations/<suite name split on '.'>/<run name>/<run time>/<batch>.html
                suite = ".".join(rel[:-2])
                pages[suite] = f"{DOCS_DIR}/validations/" + "/".join(rel + [n])
    return pages
