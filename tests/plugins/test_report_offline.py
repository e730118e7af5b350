"""Validation report pages work offline and without scripts, the Data Docs index included.

Great Expectations' own Data Docs index draws its list of validations with CDN
scripts: offline, and under the no-script CSP the Checkpoints page serves reports with,
it is blank. ``statebackend/validation/report.py`` replaces it with a static index. A
real (deep) validation builds the report; headless Chromium opens the index with
JavaScript disabled and must show every suite of the summary with its status and
working links to the GE pages, which render their results without script too.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from urllib.parse import unquote, urlparse

import pytest

from statebackend.validation.options import ValidationOptions
from statebackend.validation.validate import validate_checkpoint
from tests.statebackend.validation.test_validate_support import build_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cdp_browser import Browser  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def dump_dom(tmp_path, url: str) -> str:
    """The DOM Chromium renders for ``url`` with JavaScript disabled (read over the
    DevTools protocol: ``--dump-dom`` itself needs script)."""
    browser = Browser(CHROMIUM, str(tmp_path / f"profile-{len(os.listdir(tmp_path))}"))
    try:
        browser.call("Emulation.setScriptExecutionDisabled", session=True, value=True)
        browser.goto(url)
        root = browser.call("DOM.getDocument", session=True, depth=-1)["root"]
        return browser.call("DOM.getOuterHTML", session=True, nodeId=root["nodeId"])["outerHTML"]
    finally:
        browser.close()


def visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    base = tmp_path_factory.mktemp("report")
    store, meta = build_checkpoint(f"file://{base}/store", str(base / "w"), parallelism=2,
                                   n_keys=100)
    result = validate_checkpoint(store, "latest", ValidationOptions(level="deep"))
    assert result.success
    return result, urlparse(result.report_location).path


def test_data_docs_index_is_static(report):
    result, folder = report
    page = open(os.path.join(folder, "data_docs", "index.html"), encoding="utf-8").read()
    assert "<script" not in page.lower() and "http://" not in page and "https://" not in page
    assert "<link" not in page.lower()  # no external style either


def test_data_docs_index_lists_every_suite_without_scripts(report, tmp_path):
    assert os.path.exists(CHROMIUM), "chromium missing: `make system-deps` installs it"
    result, folder = report
    dom = dump_dom(tmp_path, f"file://{folder}/data_docs/index.html")
    text = visible_text(dom)
    assert f"Checkpoint {result.summary['checkpoint_id']} of job orders: Data Docs PASSED" in text
    rows = re.findall(r"<tr><td>([^<]+)</td>.*?</tr>", dom, flags=re.S)
    assert rows == [s["name"] for s in result.summary["suites"]]
    links = re.findall(r"href=\"([^\"]+)\"", dom)
    results = [x for x in links if x.startswith("validations/")]
    suites = [x for x in links if x.startswith("expectations/")]
    assert len(results) == len(suites) == len(rows)
    for rel in results + suites + ["../index.html"]:
        assert os.path.isfile(os.path.join(folder, "data_docs", unquote(rel))), rel
    # a linked GE validation page shows its result without scripts as well
    first = dump_dom(tmp_path, f"file://{folder}/data_docs/{results[0]}")
    assert "Succeeded" in visible_text(first) and result.summary["suites"][0]["name"] in first


def test_overview_links_the_static_index(report, tmp_path):
    result, folder = report
    text = visible_text(dump_dom(tmp_path, f"file://{folder}/index.html"))
    assert "Full Great Expectations Data Docs: data_docs/index.html (static pages" in text
    assert "needs internet access" not in text
