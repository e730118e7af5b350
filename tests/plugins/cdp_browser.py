"""Runs inside the test's network namespace (via nsenter): a logged-in visit in Chromium.

Usage: cdp_browser.py CHROMIUM BASE_URL PASSWORD_FILE OUT_DIR [--ops JOB]
Drives headless Chromium over the DevTools protocol on a pipe (no extra package): opens
``/ckpt/`` without a login (must land on Airflow's login page), logs in as ``admin`` the
way the simple auth manager's login page does (``POST /auth/token``, then the ``_token``
cookie), opens ``/ckpt/`` again, waits for its charts, saves its DOM and a screenshot,
then opens the first validation report linked from the page and records what it
rendered. With ``--ops JOB`` it also probes every element of JOB's section (health
summary, chart canvases, history, per-subtask tables, runs, savepoints, leases, links),
and saves a full-page screenshot, one of the rescale's detail and one of the failed
validation's report. Content-Security-Policy violations are recorded on every page.
Prints one JSON document (prefix BROWSER-RESULT).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time

LOGIN_JS = """(async () => {
  const r = await fetch('/auth/token', {method: 'POST',
    headers: {'Content-Type': 'application/json'},
    body: JSON.stringify({username: 'admin', password: %s})});
  const body = await r.json();
  document.cookie = '_token=' + body.access_token + '; path=/';
  return r.status;
})()"""
# Runs before any page script (DevTools injection, not subject to the page's CSP): records
# CSP violations so the test can assert that the page needs nothing its CSP forbids.
RECORD_CSP_JS = """window.__csp = [];
document.addEventListener('securitypolicyviolation', e => window.__csp.push(
  e.violatedDirective + ' ' + e.blockedURI));"""
OPS_JS = """((job) => {
  const q = (s) => document.querySelector(s), qa = (s) => [...document.querySelectorAll(s)];
  const text = (e) => e ? e.textContent.trim() : null;
  const rows = (s) => qa(s + ' tbody tr').map(tr => [...tr.cells].map(td => td.textContent.trim()));
  const charts = {};
  qa('#charts-' + job + ' .chart').forEach(el => { charts[el.dataset.chart] = {
    canvases: el.querySelectorAll('canvas').length, drawn: el.dataset.drawn || null,
    legend: [...el.querySelectorAll('.u-legend .u-series .u-label')].map(text),
    no_data: text(el.querySelector('.no-data')),
    width: el.querySelector('canvas') ? el.querySelector('canvas').width : 0}; });
  const detailIds = qa('#job-' + job + ' details.detail').map(d => d.id);
  const open = qa('#job-' + job + ' details.detail[open]').map(d => d.id);
  const subtasks = {};
  qa('#job-' + job + ' table.subtasks').forEach(t => { subtasks[t.id] = rows('#' + t.id); });
  const hrefs = (s) => qa('#job-' + job + ' ' + s).map(a => a.getAttribute('href'));
  return JSON.stringify({
    uplot: typeof uPlot, charts_ready: document.body.dataset.charts || null,
    health: Object.fromEntries(qa('#health-' + job + ' [data-health]').map(
      c => [c.dataset.health, {value: text(c.querySelector('.value')),
        note: text(c.querySelector('.note')), bad: c.classList.contains('bad')}])),
    charts, history: rows('#history-' + job), detail_ids: detailIds, open_details: open,
    subtasks, runs: rows('#runs-' + job), savepoints: rows('#savepoints-' + job),
    leases: rows('#leases-' + job),
    links: {dag_run: hrefs('a.af-run'), task_log: hrefs('a.af-log'), report: hrefs('a.report'),
            dags: hrefs('a.dag'), targets: qa('#job-' + job + ' a.af-run').map(a => a.target)},
    scripts: qa('script').map(s => s.src ? 'src:' + new URL(s.src).pathname :
                              'inline:' + (s.type || 'text/javascript')),
    empty_charts: qa('.chart .no-data').map(e => e.closest('.chart').id + ': ' + text(e)),
    csp: window.__csp});
})(%s)"""
REPORT_JS = """JSON.stringify({
  title: document.title, text: document.body ? document.body.innerText.slice(0, 2000) : '',
  styled: document.querySelector('.pass, .fail') ?
    getComputedStyle(document.querySelector('.pass, .fail')).color : null,
  probe: window.__ckpt_probe === undefined ? null : window.__ckpt_probe})"""


class Browser:
    """Just enough of the DevTools protocol: one page, flattened session, \\0-framed pipe."""

    def __init__(self, chromium: str, user_dir: str) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                 "--window-size=1000,800", f"--user-data-dir={user_dir}",
                 "--remote-debugging-pipe", "about:blank"]
        # Chromium reads commands on fd 3 and writes replies on fd 4.
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}', chromium,
             *flags], pass_fds=(to_chrome_r, from_chrome_w), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf, self._next_id, self.events = b"", 0, []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Page.addScriptToEvaluateOnNewDocument", session=True, source=RECORD_CSP_JS)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=1000, height=800,
                  deviceScaleFactor=1, mobile=False)

    def _read(self) -> dict:
        while b"\0" not in self._buf:
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, session: bool = False, **params) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def goto(self, url: str, timeout: float = 60) -> None:
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        deadline = time.time() + timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            if time.time() > deadline:
                raise RuntimeError(f"{url} did not load in {timeout}s")
            self.events.append(self._read())

    def wait_for(self, expression: str, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while not self.js(expression):
            if time.time() > deadline:
                raise RuntimeError(f"{expression} still false after {timeout}s")
            time.sleep(0.2)

    def screenshot(self, path: str, full: bool = False, selector: str | None = None) -> str:
        """PNG of the viewport, the whole page, or one element (its bounding box)."""
        params: dict = {"format": "png"}
        if full or selector:
            box = json.loads(self.js(
                "JSON.stringify((() => { const e = %s; const r = e.getBoundingClientRect(); "
                "return {x: r.left + scrollX, y: r.top + scrollY, width: r.width, "
                "height: r.height}; })())" % (
                    "document.documentElement" if full
                    else f"document.querySelector({json.dumps(selector)})")))
            if full:
                box.update(x=0, y=0, height=self.js("document.documentElement.scrollHeight"))
            params.update(captureBeyondViewport=True, clip={**box, "scale": 1})
        data = self.call("Page.captureScreenshot", session=True, **params)["data"]
        with open(path, "wb") as fh:
            fh.write(base64.b64decode(data))
        return path

    def js(self, expression: str):
        res = self.call("Runtime.evaluate", session=True, expression=expression,
                        awaitPromise=True, returnByValue=True)
        return res["result"].get("value")

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except RuntimeError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def ops_checks(browser: Browser, base: str, job: str, out_dir: str) -> dict:
    """Probe JOB's section, then the screenshots of the page, a detail and a report."""
    out = json.loads(browser.js(OPS_JS % json.dumps(job)))
    out["full_screenshot"] = browser.screenshot(os.path.join(out_dir, "checkpoints-full.png"),
                                                full=True)
    rescale = browser.js(f"(document.querySelector('#history-{job} tr.kind-rescale') || {{}})"
                         ".dataset.id")
    if rescale:
        browser.js(f"document.getElementById('detail-{job}-{rescale}').open = true")
        out["detail_screenshot"] = browser.screenshot(
            os.path.join(out_dir, "checkpoint-detail.png"),
            selector=f"#detail-{job}-{rescale}")
    failed = browser.js(f"(document.querySelector('#history-{job} td.status-failed a') || {{}})"
                        ".href")
    out["failed_report_url"] = failed
    if failed:
        browser.goto(failed)
        out["failed_report"] = json.loads(browser.js(REPORT_JS))
        out["failed_report_screenshot"] = browser.screenshot(
            os.path.join(out_dir, "validation-report.png"))
    return out


def main() -> int:
    chromium, base, pw_file, out_dir = sys.argv[1:5]
    ops_job = sys.argv[6] if len(sys.argv) > 6 and sys.argv[5] == "--ops" else None
    password = json.load(open(pw_file))["admin"]
    out: dict = {}
    browser = Browser(chromium, os.path.join(out_dir, "profile"))
    try:
        browser.goto(f"{base}/ckpt/")
        out["anonymous_url"] = browser.js("location.href")
        out["login_status"] = browser.js(LOGIN_JS % json.dumps(password))
        browser.goto(f"{base}/ckpt/")
        out["page_url"] = browser.js("location.href")
        browser.wait_for("document.body.dataset.charts === 'ready'")
        out["dom"] = browser.js("document.documentElement.outerHTML")
        out["csp"] = browser.js("window.__csp")
        out["screenshot"] = browser.screenshot(os.path.join(out_dir, "checkpoints.png"))
        report = browser.js("(document.querySelector('a[href*=\"/ckpt/reports/\"]') || {}).href")
        out["report_url"] = report
        if ops_job:
            out["ops"] = ops_checks(browser, base, ops_job, out_dir)
        if report:
            browser.goto(report)
            out["report"] = json.loads(browser.js(REPORT_JS))
    finally:
        browser.close()
    print("BROWSER-RESULT" + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
