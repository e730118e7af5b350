"""Runs inside the test's network namespace (via nsenter): talks to `airflow standalone`.

Usage: standalone_client.py BASE_URL PASSWORD_FILE DAG_ID CONF_JSON BAD_CONF_JSON TIMEOUT
Prints one JSON document (prefix CLIENT-RESULT) with what it saw.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request


def call(base: str, method: str, path: str, token: str | None = None, body=None):
    """One request; reads (GET) are retried when a busy server answers too slowly."""
    data = None if body is None else json.dumps(body).encode()
    attempts = 4 if method == "GET" else 1
    for attempt in range(attempts):
        req = urllib.request.Request(base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                raw = resp.read()
                status = resp.status
            break
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
            break
        except (TimeoutError, urllib.error.URLError) as exc:
            if attempt == attempts - 1:
                raise RuntimeError(f"{method} {path}: {exc}") from exc
            time.sleep(5)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_run(base: str, token: str, dag_id: str, run_id: str | None, deadline: float) -> dict:
    """Poll a run until it ends; its state and task states."""
    state = None
    while run_id and time.time() < deadline:
        _, run = call(base, "GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}", token)
        state = run.get("state")
        if state in ("success", "failed"):
            break
        time.sleep(3)
    tasks = {}
    if run_id:
        _, tis = call(base, "GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances", token)
        tasks = {t["task_id"]: t["state"] for t in tis.get("task_instances", [])}
    return {"state": state, "tasks": tasks}


def main() -> int:
    base, pw_file, dag_id, conf, bad_conf, timeout = sys.argv[1:7]
    deadline = time.time() + float(timeout)
    out: dict = {}
    password = json.load(open(pw_file))["admin"]
    status, tok = call(base, "POST", "/auth/token", body={"username": "admin",
                                                          "password": password})
    out["token_status"] = status
    token = tok["access_token"]
    while time.time() < deadline:  # the dag-processor parses the files first
        status, _ = call(base, "GET", f"/api/v2/dags/{dag_id}", token)
        if status == 200:
            break
        time.sleep(2)
    out["unpause"] = call(base, "PATCH", f"/api/v2/dags/{dag_id}", token,
                          {"is_paused": False})[0]
    # A run of the (paused) pipeline DAG stays queued: the rescale must refuse meanwhile.
    pipeline = dag_id.replace("_rescale_restore", "_pipeline")
    status, body = call(base, "POST", f"/api/v2/dags/{pipeline}/dagRuns", token,
                        {"logical_date": None, "conf": {}})
    blocker = body.get("dag_run_id") if isinstance(body, dict) else None
    out["blocker"] = {"status": status, "state": body.get("state") if blocker else body}
    _, body = call(base, "POST", f"/api/v2/dags/{dag_id}/dagRuns", token,
                   {"logical_date": None, "conf": json.loads(conf)})
    out["refused"] = wait_run(base, token, dag_id, body.get("dag_run_id"), deadline)
    if blocker:
        out["blocker_deleted"] = call(base, "DELETE",
                                      f"/api/v2/dags/{pipeline}/dagRuns/{blocker}", token)[0]
    status, body = call(base, "POST", f"/api/v2/dags/{dag_id}/dagRuns", token,
                        {"logical_date": None, "conf": json.loads(bad_conf)})
    out["bad_trigger"] = {"status": status, "body": body}
    status, body = call(base, "POST", f"/api/v2/dags/{dag_id}/dagRuns", token,
                        {"logical_date": None, "conf": json.loads(conf)})
    out["trigger"] = {"status": status, "body": body}
    run_id = body.get("dag_run_id") if isinstance(body, dict) else None
    done = wait_run(base, token, dag_id, run_id, deadline)
    out["run_state"], out["tasks"] = done["state"], done["tasks"]
    status, plugins = call(base, "GET", "/api/v2/plugins", token)
    out["plugins"] = plugins if status == 200 else status
    out["anonymous_api_status"] = call(base, "GET", "/ckpt/api/jobs")[0]
    status, page = call(base, "GET", "/ckpt/", token)
    out["page_status"], out["page"] = status, page if isinstance(page, str) else str(page)
    print("CLIENT-RESULT" + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
