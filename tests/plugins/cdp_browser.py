"""Runs inside the test's network namespace (via nsenter): a logged-in visit in Chromium.

Usage: cdp_browser.py CHROMIUM BASE_URL PASSWORD_FILE OUT_DIR
Drives headless Chromium over the DevTools protocol on a pipe (no extra package): opens
``/ckpt/`` without a login (must land on Airflow's login page), logs in as ``admin`` the
way the simple auth manager's login page does (``POST /auth/token``, then the ``_token``
cookie), opens ``/ckpt/`` again, saves its DOM and a screenshot, then opens the first
validation report linked from the page and records what it rendered. Prints one JSON
document (prefix BROWSER-RESULT).
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


def main() -> int:
    chromium, base, pw_file, out_dir = sys.argv[1:5]
    password = json.load(open(pw_file))["admin"]
    out: dict = {}
    browser = Browser(chromium, os.path.join(out_dir, "profile"))
    try:
        browser.goto(f"{base}/ckpt/")
        out["anonymous_url"] = browser.js("location.href")
        out["login_status"] = browser.js(LOGIN_JS % json.dumps(password))
        browser.goto(f"{base}/ckpt/")
        out["page_url"] = browser.js("location.href")
        out["dom"] = browser.js("document.documentElement.outerHTML")
        shot = browser.call("Page.captureScreenshot", session=True, format="png")["data"]
        out["screenshot"] = os.path.join(out_dir, "checkpoints.png")
        with open(out["screenshot"], "wb") as fh:
            fh.write(base64.b64decode(shot))
        report = browser.js("(document.querySelector('a[href*=\"/ckpt/reports/\"]') || {}).href")
        out["report_url"] = report
        if report:
            browser.goto(report)
            out["report"] = json.loads(browser.js(REPORT_JS))
    finally:
        browser.close()
    print("BROWSER-RESULT" + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
