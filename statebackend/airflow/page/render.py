"""HTML of the Checkpoints page: server-rendered tables, charts drawn by ``static/page.js``.

No inline script (the page's CSP is ``script-src 'self'``): chart data goes in a
``<script type="application/json" id="ckpt-data">`` block (JSON is data, not script,
and ``<``, ``>``, ``&`` are escaped in it) that ``page.js`` reads and hands to uPlot.
Every chart slot says "no data yet" in the HTML itself, so an empty chart reads
sensibly with or without script. Links to Airflow open in the top window (the page is
embedded in Airflow's UI).
"""

from __future__ import annotations

import html
import json

from statebackend.checkpoint.layout import savepoint_dir
from statebackend.formatting import (
    human_age,
    human_bytes,
    human_count,
    human_duration,
    parse_time,
)

from .data import PHASES, URL_PREFIX, has_points

STATIC = f"{URL_PREFIX}/static"
# chart id -> (title, what an empty chart says)
CHARTS = {
    "state_size": ("State size", "no data yet"),
    "bytes_uploaded": ("Bytes uploaded per checkpoint", "no data yet"),
    "duration": ("Run duration by phase", "no timings recorded yet"),
    "events_per_s": ("Throughput (events/s)", "no timings recorded yet"),
    "rejects": ("Rejected events", "no data yet"),
}
DETAIL_OPEN = 1  # newest checkpoints whose detail is open on load


def esc(value: object) -> str:
    return html.escape("" if value is None else str(value))


def when(iso: str | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    parsed = parse_time(iso)
    return esc(iso) if parsed is None else parsed.strftime(fmt)


def link(href: str | None, text: str, cls: str = "", top: bool = False) -> str:
    if not href:
        return esc(text)
    target = ' target="_top"' if top else ' target="_blank" rel="noopener"'
    klass = f' class="{cls}"' if cls else ""
    return f'<a href="{esc(href)}"{klass}{target}>{esc(text)}</a>'


def dag_link(dag_id: str) -> str:
    return link(f"/dags/{dag_id}", dag_id, "dag", top=True)


# -- health ------------------------------------------------------------------------
def _card(key: str, label: str, value: str, note: str = "", level: str = "") -> str:
    cls = f"card {level}".strip()
    return (f'<div class="{cls}" data-health="{key}"><div class="label">{esc(label)}</div>'
            f'<div class="value">{value}</div><div class="note">{note}</div></div>')


def render_health(job: str, h: dict) -> str:
    cards = []
    if h["latest_id"] is None:
        cards.append(_card("latest", "Latest checkpoint", "none yet"))
    else:
        cards.append(_card("latest", "Latest checkpoint", f"chk-{h['latest_id']}",
                           human_age(h["latest_age_s"])))
    v = h["last_validation"]
    if v is None:
        cards.append(_card("validation", "Last validation", "not validated"))
    else:
        cards.append(_card("validation", "Last validation",
                           link(v["report"], v["status"], f"status-{v['status']}"),
                           f"chk-{v['id']}", "bad" if v["status"] == "failed" else ""))
    t = h["state_trend"]
    trend = ""
    if t and t["change"] is not None:
        trend = (f"{t['change']:+.0%} since chk-{t['from_id']} "
                 f"({human_bytes(t['from_bytes'])})")
    cards.append(_card("state", "State size", human_bytes(h["state_bytes"]), esc(trend)))
    r = h["last_run"]
    if r is None:
        cards.append(_card("run", "Last run", "–", "no timings recorded yet"))
    else:
        rate = f"{human_count(r['events_per_s'])} events/s" if r["events_per_s"] is not None \
            else ""
        cards.append(_card("run", "Last run", human_duration(r["duration_s"]),
                           f"chk-{r['id']} {rate}".strip()))
    n = h["failed_runs_since_success"]
    cards.append(_card("failures", "Failed runs since last success", str(n),
                       esc(h["last_failure"] or ""), "bad" if n else ""))
    return (f'<div class="health health-{esc(h["level"])}" id="health-{esc(job)}">'
            + "".join(cards) + "</div>")


# -- charts --------------------------------------------------------------------------
def render_charts(job: str, charts: dict) -> str:
    out = [f'<div class="charts" id="charts-{esc(job)}">']
    for name, (title, empty) in CHARTS.items():
        columns = charts.get(name) or {}
        body = "" if has_points(columns) else f'<p class="no-data">{esc(empty)}</p>'
        out.append(f'<figure class="chart-box"><figcaption>{esc(title)}</figcaption>'
                   f'<div class="chart" id="chart-{esc(job)}-{name}" data-job="{esc(job)}" '
                   f'data-chart="{name}">{body}</div></figure>')
    out.append("</div>")
    return "".join(out)


def chart_data(histories: list[dict]) -> str:
    """The JSON block page.js reads; safe inside <script> (no '<', '>', '&')."""
    jobs = [{"job": h["job"], "charts": h["charts"]} for h in histories if h.get("charts")]
    text = json.dumps({"jobs": jobs}, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# -- tables ----------------------------------------------------------------------------
def _airflow_cells(links: dict, run_label: str = "DAG run") -> str:
    parts = []
    if links.get("dag_run"):
        parts.append(link(links["dag_run"], run_label, "af-run", top=True))
    if links.get("task_log"):
        parts.append(link(links["task_log"], "log", "af-log", top=True))
    return " · ".join(parts)


def render_history(job: str, rows: list[dict]) -> str:
    out = []
    for r in reversed(rows):
        m = r["metrics"]
        status = esc(r["validation"])
        anchor = f"detail-{esc(job)}-{r['id']}"
        out.append(
            f'<tr data-id="{r["id"]}" class="kind-{esc(r["kind"])}">'
            f'<td><a href="#{anchor}">chk-{r["id"]}</a></td><td>{esc(r["kind"])}</td>'
            f'<td>{when(r["created_at"], "%Y-%m-%d %H:%M")}</td>'
            f'<td class="origin">{esc(r["run_id"])}</td>'
            f'<td>{r["parallelism"]}</td><td>{human_bytes(r["state_bytes"])}</td>'
            f'<td>{human_bytes(r["bytes_uploaded"])}</td>'
            f'<td>{human_duration(m["duration_s"])}</td><td>{human_count(m["events_per_s"])}</td>'
            f'<td>{human_count(m["events_rejected"])}</td>'
            f'<td class="status-{status.replace(" ", "-")}">'
            f'{link(r["report"], r["validation"], "report")}</td>'
            f'<td class="airflow">{_airflow_cells(r["links"], "run")}</td></tr>')
    if not rows:
        out.append('<tr><td colspan="12" class="no-data">no checkpoints yet</td></tr>')
    return table("history", f"history-{job}",
                 ("id", "kind", "created (UTC)", "run", "P", "state size", "uploaded",
                  "duration", "events/s", "rejected", "validation", "Airflow"), out)


def table(kind: str, table_id: str, headers: tuple[str, ...], rows: list[str]) -> str:
    """A ``<table>`` of class ``kind`` with ``headers`` and ready ``rows`` (``<tr>`` HTML)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    return (f'<table class="{kind}" id="{esc(table_id)}"><thead><tr>{head}</tr></thead><tbody>'
            + "".join(rows) + "</tbody></table>")


def table_or_note(kind: str, job: str, headers: tuple[str, ...], rows: list[str],
                  empty: str) -> str:
    """`table` with id ``<kind>-<job>``, or a ``no-data`` note of the same id without rows."""
    if not rows:
        return f'<p class="no-data" id="{kind}-{esc(job)}">{esc(empty)}</p>'
    return table(kind, f"{kind}-{job}", headers, rows)


def _skew_bar(value: float, peak: float) -> str:
    pct = 0 if not peak else round(100 * value / peak)
    return f'<span class="bar"><span style="width:{pct}%"></span></span>'


def render_subtasks(job: str, r: dict) -> str:
    subs = r["subtasks"]
    peak_bytes = max([s["bytes"] for s in subs], default=0)
    peak_events = max([s["events"] or 0 for s in subs], default=0)
    out = []
    for s in subs:
        out.append(
            f'<tr><td>{s["index"]}</td>'
            f'<td>{s["key_group_start"]}–{s["key_group_end"]} ({s["key_groups"]})</td>'
            f'<td>{s["files"]}</td><td>{human_bytes(s["bytes"])}</td>'
            f'<td>{_skew_bar(s["bytes"], peak_bytes)}</td>'
            f'<td>{human_bytes(s["bytes_uploaded"])}</td><td>{human_count(s["rows"])}</td>'
            f'<td>{human_count(s["events"])}</td>'
            f'<td>{_skew_bar(s["events"] or 0, peak_events) if s["events"] is not None else ""}'
            f'</td><td>{human_count(s["rejected"])}</td>'
            f'<td>{human_duration(s["duration_s"])}</td></tr>')
    return table("subtasks", f"subtasks-{job}-{r['id']}",
                 ("subtask", "key groups", "files", "state bytes", "", "uploaded", "rows",
                  "events", "", "rejected", "duration"), out)


def render_detail(job: str, r: dict, is_open: bool) -> str:
    m = r["metrics"]
    phases = " · ".join(f"{p} {human_duration(m['phases'][p])}" for p in PHASES
                        if p in m["phases"]) or "no phase timings recorded"
    reasons = ", ".join(f"{esc(k)}: {human_count(v)}"
                        for k, v in sorted(m["rejects_by_reason"].items())) or "–"
    checks = ", ".join(esc(c) for c in r["failed_checks"])
    facts = [
        ("origin", esc(r["run_id"])), ("created (UTC)", when(r["created_at"])),
        ("parent", f"chk-{r['parent']}" if r["parent"] else "–"),
        ("parallelism", f"{r['parallelism']} of max {r['max_parallelism']}"),
        ("state", f"{human_bytes(r['state_bytes'])} in {r['files']} files, "
                  f"{human_count(r['state_rows'])} rows, {esc(r['state_backend'])} backend"
                  + (f" (database version {r['external_version']})"
                     if r.get("external_version") is not None else "")
                  + (f"; {esc(m['state_memory'])}" if m.get("state_memory") else "")),
        ("run", f"{human_duration(m['duration_s'])}: {phases}"),
        ("events", f"{human_count(m['events_read'])} read, {human_count(m['events_rejected'])} "
                   f"rejected ({reasons}), {human_count(m['keys_touched'])} keys touched"),
        ("states", "<br>".join(f"{esc(s['name'])}: {esc(s['schema'])}"
                               for s in r.get("states", [])) or "–"),
        ("validation", link(r["report"], r["validation"], "report")
         + (f" (failed: {checks})" if checks else "")),
        ("Airflow", _airflow_cells(r["links"]) or "–"),
    ]
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in facts)
    opened = " open" if is_open else ""
    return (f'<details class="detail" id="detail-{esc(job)}-{r["id"]}"{opened}><summary>'
            f'chk-{r["id"]} · {esc(r["kind"])} · {when(r["created_at"])} · P={r["parallelism"]}'
            f' · {human_bytes(r["state_bytes"])} · <span class="status-'
            f'{esc(r["validation"]).replace(" ", "-")}">{esc(r["validation"])}</span></summary>'
            f'<dl>{dl}</dl><div class="scroll">{render_subtasks(job, r)}</div></details>')


def render_runs(job: str, runs: list[dict]) -> str:
    out = []
    for r in reversed(runs):
        chk = f"chk-{r['checkpoint_id']}" if r["checkpoint_id"] is not None else "–"
        out.append(f'<tr class="outcome-{esc(r["outcome"])}"><td>{when(r["started_at"])}</td>'
                   f'<td>{esc(r["run_id"])}</td><td>{esc(r["outcome"])}</td><td>{chk}</td>'
                   f'<td>{human_duration(r["duration_s"])}</td><td>{esc(r["error"] or "")}</td>'
                   f'<td class="airflow">{_airflow_cells(r["links"])}</td></tr>')
    return table_or_note("runs", job, ("started (UTC)", "run", "outcome", "checkpoint",
                                       "duration", "error", "Airflow"), out, "no run records yet")


def render_savepoints(job: str, savepoints: list[dict]) -> str:
    out = []
    for s in savepoints:
        source = (f"{esc(s['source_job'])} chk-{s['source_checkpoint']}" if s["complete"]
                  else "incomplete (being created or interrupted)")
        out.append(f'<tr><td>{esc(s["name"])}</td><td>{source}</td><td>{when(s["created_at"])}'
                   f'</td><td>{esc(s["parallelism"] or "–")}</td>'
                   f'<td>{esc(s["backend"] or "–")}</td><td>{s["files"]}</td>'
                   f'<td>{human_bytes(s["bytes"])}</td>'
                   f'<td><code>{esc(job)}/{esc(savepoint_dir(s["name"]))}</code></td></tr>')
    return table_or_note("savepoints", job, ("name", "from", "created (UTC)", "P", "backend",
                                             "files", "size", "path (for start_from)"), out,
                         "no savepoints")


def render_leases(job: str, leases: list[dict]) -> str:
    out = []
    for lease in leases:
        state = "live" if lease["live"] else "expired"
        held = ", ".join(f"chk-{i}" for i in lease["checkpoint_ids"]) or "–"
        out.append(f'<tr class="lease-{state}"><td>{esc(lease["name"])}</td><td>{state}</td>'
                   f'<td>{esc(lease["purpose"])}</td><td>{esc(lease["holder"])}</td>'
                   f'<td>{when(lease["expires_at"])}</td><td>{held}</td></tr>')
    return table_or_note("leases", job, ("lease", "state", "purpose", "holder",
                                         "expires (UTC)", "holds"), out, "no leases")


# -- page ------------------------------------------------------------------------------
def render_job(history: dict) -> str:
    job = esc(history["job"])
    dags = " ".join(dag_link(d) for d in history["dags"].values())
    out = [f'<section class="job" id="job-{job}"><h2>{job}</h2>',
           f'<p class="where">storage <code>{esc(history["storage"])}/{job}</code> · DAGs {dags}'
           "</p>"]
    if history.get("error"):
        out.append(f'<p class="error">{esc(history["error"])}</p></section>')
        return "".join(out)
    out += [f'<p class="error">{esc(e)}</p>' for e in history["errors"]]
    rows = history["rows"]
    out.append(render_health(history["job"], history["health"]))
    out.append(render_charts(history["job"], history["charts"]))
    out.append('<h3>Checkpoints</h3><div class="scroll">'
               + render_history(history["job"], rows) + "</div>")
    if rows:
        out.append("<h3>Checkpoint detail</h3>")
        newest = list(reversed(rows))
        out += [render_detail(history["job"], r, i < DETAIL_OPEN) for i, r in enumerate(newest)]
    out.append("<h3>Runs</h3>" + render_runs(history["job"], history["runs"]))
    out.append("<h3>Savepoints</h3>" + render_savepoints(history["job"], history["savepoints"]))
    out.append("<h3>Leases</h3>" + render_leases(history["job"], history["leases"]))
    out.append("</section>")
    return "".join(out)


def render_page(histories: list[dict]) -> str:
    body = "".join(render_job(h) for h in histories) or "<p>No jobs configured (ckpt_jobs).</p>"
    nav = " · ".join(f'<a href="#job-{esc(h["job"])}">{esc(h["job"])}</a>' for h in histories)
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Checkpoints</title>"
        f'<link rel="stylesheet" href="{STATIC}/uplot/uPlot.min.css">'
        f'<link rel="stylesheet" href="{STATIC}/page.css">'
        f'<script defer src="{STATIC}/uplot/uPlot.iife.min.js"></script>'
        f'<script defer src="{STATIC}/page.js"></script></head><body>'
        f'<h1>Checkpoints</h1><nav class="jobs">{nav}</nav>{body}'
        f'<script type="application/json" id="ckpt-data">{chart_data(histories)}</script>'
        "</body></html>")
