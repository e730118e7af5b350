"""Job definitions: validated eagerly, one-line errors naming the job and the field."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from examples import user_activity
from statebackend.errors import UsageError
from statebackend.job import (
    Input,
    Job,
    Option,
    Output,
    PerKey,
    Rule,
    Vectorized,
    map_state,
    record,
    value_state,
)
from statebackend.state.codecs import RecordCodec

SCHEMA = pa.schema([("user", pa.string()), ("ts", pa.int64()), ("payload", pa.binary())])
INPUT = Input(SCHEMA, key="user")
LOGIC = Vectorized(lambda batch, ctx: None)


def make(**changes) -> Job:
    fields = {"name": "j1", "input": INPUT, "logic": LOGIC, "states": (value_state("a"),),
              "outputs": (Output("out", pa.schema([("user", pa.string())])),)}
    fields.update(changes)
    return Job(**fields)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"name": "bad name"}, "job name 'bad name'"),
    ({"input": Input(SCHEMA, key="nope")}, "input.key 'nope' is not a column"),
    ({"input": Input(SCHEMA, key="payload")}, "input.key 'payload' has type binary"),
    ({"input": SCHEMA}, "input must be an Input"),
    ({"input": Input(SCHEMA, key="user", rules=(lambda t: t,))}, "input.rules holds"),
    ({"input": Input(SCHEMA, key="user", event_time="when")}, "input.event_time 'when'"),
    ({"input": Input(SCHEMA, key="user", event_time="user")}, "has type string"),
    ({"input": Input(SCHEMA, key="user", allowed_lateness=timedelta(minutes=5))},
     "allowed_lateness needs input.event_time"),
    ({"states": (value_state("a"), map_state("a"))}, "state name 'a' is declared twice"),
    ({"states": ("a",)}, "states holds 'a', not a StateDescriptor"),
    ({"outputs": (Output("o", pa.schema([])), Output("o", pa.schema([])))},
     "output name 'o' is declared twice"),
    ({"outputs": (Output("o", pa.schema([("x", pa.int64())]), last_per="y"),)},
     "output 'o': last_per 'y'"),
    ({"logic": lambda batch, ctx: None}, "logic must be Vectorized(fn) or PerKey(fn)"),
    ({"logic": None}, "logic must be"),
    ({"logic": PerKey("not callable")}, "is not callable"),
    ({"options": (Option("gap", int, "30"),)}, "has default '30'; give a value of type int"),
    ({"options": (Option("gap", float, True),)}, "option 'gap' must be of type float"),
    ({"options": (Option("Gap", int, 30),)}, "option name 'Gap'"),
    ({"options": (Option("gap", int, 1), Option("gap", int, 2))}, "option 'gap' is declared"),
    ({"options": (Option("gap", list, []),)}, "option 'gap' has type"),
    ({"expectations": {"zzz": lambda d: []}}, "expectations name state 'zzz'"),
])
def test_definition_errors_are_one_line_naming_job_and_field(changes, fragment):
    with pytest.raises(UsageError) as err:
        make(**changes)
    msg = str(err.value)
    assert "\n" not in msg
    assert fragment in msg
    if "name" not in changes:
        assert msg.startswith("job 'j1': ")


def test_a_valid_job_is_frozen_and_typed():
    job = make(options=(Option("gap", int, 30, "session gap in minutes"),),
               expectations={"a": lambda d: []},
               input=Input(SCHEMA, key="user", event_time="ts",
                           allowed_lateness=timedelta(hours=1)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        job.expectations["b"] = None  # type: ignore[index]
    assert job.key == "user"
    assert job.state("a").kind == "value"
    with pytest.raises(UsageError, match="declares no state 'b'"):
        job.state("b")


def test_options_resolve_defaults_typed_values_and_cli_text():
    job = make(options=(Option("gap", int, 30), Option("ratio", float, 0.5),
                        Option("strict", bool, False), Option("label", str, "x")))
    assert dict(job.resolve_options()) == {"gap": 30, "ratio": 0.5, "strict": False,
                                           "label": "x"}
    assert dict(job.resolve_options({"gap": "45", "ratio": 2, "strict": "yes"})) == {
        "gap": 45, "ratio": 2.0, "strict": True, "label": "x"}
    with pytest.raises(UsageError, match="job 'j1' has no option 'gapp'"):
        job.resolve_options({"gapp": 1})
    with pytest.raises(UsageError, match="option 'gap' must be of type int, got 'soon'"):
        job.resolve_options({"gap": "soon"})
    with pytest.raises(UsageError, match="option 'strict' must be of type bool"):
        job.resolve_options({"strict": "maybe"})


def test_rules_and_codecs():
    with pytest.raises(UsageError, match="rule reason 'has space'"):
        Rule("has space", lambda t: t)
    with pytest.raises(UsageError, match="use 'typed' or 'raw'"):
        Rule("r", lambda t: t, on="parsed")
    assert record(count="int64", sum="float64") == RecordCodec(
        (("count", "int64"), ("sum", "float64")))


def test_example_job_declares_two_kinds_of_state_and_expectations():
    job = user_activity.job
    assert [(d.name, d.kind) for d in job.states] == [("last_seen", "value"),
                                                       ("counts", "map")]
    assert set(job.expectations) == {"counts"}
    assert isinstance(job.logic, PerKey)
    assert isinstance(user_activity.job_vectorized.logic, Vectorized)


def test_the_api_does_not_import_jobs_spark_or_great_expectations():
    code = ("import sys, statebackend.job, examples.user_activity; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('jobs', 'pyspark', 'great_expectations')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_the_docs_page_shows_the_tested_example_code():
    """Every code block of docs/write-a-job.md that defines the job is the example's code."""
    root = Path(__file__).resolve().parents[3]
    doc = (root / "docs" / "write-a-job.md").read_text()
    source = (root / "examples" / "user_activity.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    shown = [b for b in blocks if b.startswith(("INPUT = ", "def "))]
    assert len(shown) == 3
    for block in shown:
        assert block in source


def test_the_docs_in_process_snippet_runs_and_matches_pandas(monkeypatch, capsys):
    """The "Try it in-process" block of docs/write-a-job.md, executed as written; what it
    prints equals a pandas reference of the example's logic over the same rows."""
    root = Path(__file__).resolve().parents[3]
    doc = (root / "docs" / "write-a-job.md").read_text()
    section = doc[doc.index("## Try it in-process"):]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:1]
    monkeypatch.syspath_prepend(str(root))
    namespace: dict = {}
    exec(compile(snippet, "docs/write-a-job.md", "exec"), namespace)  # noqa: S102 - our doc
    out = capsys.readouterr().out.splitlines()
    activity, rejected = (ast.literal_eval(line) for line in out[:2])

    frames = [namespace["batch1"].to_pandas(), namespace["batch2"].to_pandas()]
    rows = pd.concat(frames, ignore_index=True)
    bad = rows["user"] == ""
    good = rows[~bad].assign(category=lambda d: d["category"].str.lower())
    expected = []
    for user, g in good.groupby("user"):
        last = g.sort_values("ts", kind="stable").iloc[-1]
        expected.append({"user": user, "last_ts": int(last["ts"]),
                         "last_category": last["category"],
                         "category_events": int((g["category"] == last["category"]).sum()),
                         "categories": g["category"].nunique()})
    assert sorted(activity, key=lambda r: r["user"]) == expected
    assert [(r["user"], r["reason"]) for r in rejected] == [("", "empty_user")]
    assert out[2] == f"{{'empty_user': 1}} {int((~bad).sum())} {len(expected)}"
