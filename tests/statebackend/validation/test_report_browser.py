"""A clean checkpoint's HTML report opens in headless Chromium and shows its status.

The overview page (``reports/chk-<id>/index.html``) is self-contained, so it
renders without network; the test also opens the Great Expectations validation
page it links for one suite. Chromium runs with a throw-away profile and is
killed by its process group if it hangs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import subprocess

import pytest

from statebackend.validation.validate import ValidationOptions, validate_checkpoint
from tests.statebackend.validation.test_validate_support import build_checkpoint

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists(
    "/usr/bin/chromium") else None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,2000"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed "
                                "(make system-deps installs it)")


def chromium(tmp_path, *args: str, timeout: float = 120) -> str:
    profile = tmp_path / f"profile-{len(os.listdir(tmp_path))}"
    proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert proc.returncode == 0, f"chromium exited {proc.returncode}"
    return out


def visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_clean_report_opens_in_headless_chromium(tmp_path):
    store, meta = build_checkpoint(f"file://{tmp_path}/store", str(tmp_path / "w"),
                                   parallelism=2, n_keys=200)
    result = validate_checkpoint(store, "latest", ValidationOptions(level="deep"))
    assert result.success
    page = result.report_index
    assert page == f"{result.report_location}/index.html" and page.startswith("file://")

    shots = tmp_path / "shots"
    shots.mkdir()
    png = shots / "report.png"
    chromium(shots, f"--screenshot={png}", page)
    assert png.exists() and png.stat().st_size > 10_000
    assert png_size(png) == (1280, 2000)

    text = visible_text(chromium(shots, "--dump-dom", page))
    assert f"Checkpoint {meta.checkpoint_id} of job orders: PASSED" in text
    for suite in result.summary["suites"]:
        assert suite["name"] in text
    assert "ckpt.manifest.files" in text and "ckpt.content.state" in text
    assert "FAILED" not in text

    # the linked Great Expectations validation page renders too (no scripts needed)
    link = re.search(r"href='(data_docs/validations/ckpt/manifest/files/[^']+\.html)'",
                     open(page.removeprefix("file://")).read()).group(1)
    ge_page = f"{result.report_location}/{link}"
    ge_text = visible_text(chromium(shots, "--dump-dom", ge_page))
    assert "ckpt.manifest.files" in ge_text and "Status: Succeeded" in ge_text
