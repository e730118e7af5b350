"""Nothing outside the tests writes AWS credentials into the process environment:
credentials are storage options (`statebackend.storage.open_storage(url, **options)`).

Benchmarks (``bench/``) start their own fake S3 server with throwaway keys and are not
shipped; they are outside this check (see BENCH_EXEMPT).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"tests", "bench", ".venv", ".git", ".demo", "node_modules", "build", "dist"}
# environ["AWS_..."] = / environ.setdefault("AWS_...") / environ.update(...AWS_...) /
# putenv("AWS_...") / os.environ |= {...AWS_...}
WRITES = re.compile(
    r"environ\s*\[\s*[\"'](AWS_[A-Z_]*)[\"']\s*\]\s*=(?!=)"
    r"|environ\.(?:update|setdefault)\s*\([^)]*AWS_"
    r"|putenv\s*\(\s*[\"']AWS_"
    r"|environ\s*\|=\s*\{[^}]*AWS_"
    r"|environ\s*\[\s*(var|name|key)\s*\]\s*=(?!=)", re.S)


def product_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if not SKIP_DIRS & set(p.relative_to(ROOT).parts))


@pytest.mark.parametrize("snippet", [
    'os.environ["AWS_SECRET_ACCESS_KEY"] = s', "env.update({'AWS_ACCESS_KEY_ID': k})",
    "os.environ.update(AWS_ACCESS_KEY_ID=k)", 'os.putenv("AWS_SESSION_TOKEN", t)',
    "for var, value in spec['env'].items():\n    os.environ[var] = value",
])
def test_the_pattern_finds_every_form(snippet):
    assert WRITES.search(snippet.replace("env.update", "environ.update"))


def test_no_credentials_written_into_the_environment():
    files = product_files()
    assert any(p.parts[-2:] == ("storage", "__init__.py") for p in files) and len(files) > 30
    found = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
             for p in files for text in [p.read_text(encoding="utf-8")]
             for m in WRITES.finditer(text)]
    assert found == [], f"credentials written into os.environ at {found}"
