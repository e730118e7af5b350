"""Nothing outside the tests writes credentials into the process environment:
credentials are storage options (`statebackend.storage.open_storage(url, **options)`).

Checked: every Python file of the repository but ``tests/`` (the library, ``jobs/``,
``dags/``, ``plugins/``, ``demo/``, ``bench/``, ``examples/``). Credentials are ``AWS_*``
variables and any name with SECRET, TOKEN, PASSWORD or ACCESS_KEY in it. A child
process's own ``env={...}`` is not the process environment and stays allowed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"tests", ".venv", ".git", ".demo", "node_modules", "build", "dist"}
CHECKED = {"statebackend", "jobs", "dags", "demo", "bench", "examples"}  # plugins/: no .py now
CREDENTIAL = r"(?:AWS_[A-Z0-9_]*|[A-Z0-9_]*(?:SECRET|TOKEN|PASSWORD|ACCESS_KEY)[A-Z0-9_]*)"
# environ["AWS_..."] = / environ.setdefault("AWS_...") / environ.update(...AWS_...) /
# putenv("AWS_...") / os.environ |= {...AWS_...} / environ[var] = (a name from a loop)
WRITES = re.compile(
    rf"environ\s*\[\s*[\"']{CREDENTIAL}[\"']\s*\]\s*=(?!=)"
    rf"|environ\.(?:update|setdefault)\s*\([^)]*{CREDENTIAL}"
    rf"|putenv\s*\(\s*[\"']{CREDENTIAL}"
    rf"|environ\s*\|=\s*\{{[^}}]*{CREDENTIAL}"
    r"|environ\s*\[\s*(var|name|key)\s*\]\s*=(?!=)", re.S)


def product_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if not SKIP_DIRS & set(p.relative_to(ROOT).parts))


@pytest.mark.parametrize("snippet", [
    'os.environ["AWS_SECRET_ACCESS_KEY"] = s', "env.update({'AWS_ACCESS_KEY_ID': k})",
    "os.environ.update(AWS_ACCESS_KEY_ID=k)", 'os.putenv("AWS_SESSION_TOKEN", t)',
    "for var, value in spec['env'].items():\n    os.environ[var] = value",
    'os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"})',
    'os.environ["CKPT_DB_PASSWORD"] = p', "os.environ.setdefault('GITHUB_TOKEN', t)",
])
def test_the_pattern_finds_every_form(snippet):
    assert WRITES.search(snippet.replace("env.update", "environ.update"))


@pytest.mark.parametrize("snippet", [
    'os.environ["CKPT_STORAGE"] = url', "env = {**os.environ, **s3.child_env()}",
    'os.environ.update({k: env[k] for k in ("CKPT_STORAGE", "CKPT_DATA")})',
    'token = os.environ.get("AWS_SESSION_TOKEN")',
])
def test_the_pattern_leaves_other_variables_and_reads_alone(snippet):
    assert WRITES.search(snippet) is None


def test_no_credentials_written_into_the_environment():
    files = product_files()
    assert any(p.parts[-2:] == ("storage", "__init__.py") for p in files) and len(files) > 30
    assert CHECKED <= {p.relative_to(ROOT).parts[0] for p in files}
    found = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
             for p in files for text in [p.read_text(encoding="utf-8")]
             for m in WRITES.finditer(text)]
    assert found == [], f"credentials written into os.environ at {found}"
