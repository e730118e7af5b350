"""A job's command line: the arguments of one run, and the program that runs it.

``ckpt run MODULE:ATTR --input ... --storage ... --run-id ...`` (`statebackend.cli.run`
registers these arguments as its ``run`` command), ``spark-submit
statebackend/cli/submit.py MODULE:ATTR ...`` and a job module's own entry point
(``main = entry_point("jobs.dedup:JOB")``: ``python -m jobs.dedup ARGS``,
``spark-submit jobs/dedup.py ARGS``) are this one program:

- the run options are flags, one per option declared in `statebackend.run_options`;
- the job's own options (`Job.options`) become flags once the job is known, e.g.
  ``--normalize-case false`` (`JobParser`);
- `main` runs the job once in a session it owns and prints the summary (text, or one
  JSON document with ``--json``), or one error line and the error's exit code.

It lives in the job layer, below the ``ckpt`` tool, so a job module needs nothing but
`statebackend.job`. Which job runs comes from the arguments only: nothing read from
checkpoint storage chooses code to import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from statebackend.errors import CkptError, UsageError
from statebackend.job.config import RunConfig
from statebackend.job.load import is_job_ref, load_job, module_root
from statebackend.job.run import run_job
from statebackend.job.summary import format_summary, skipped_warning
from statebackend.progress import NO_PROGRESS, Progress, ProgressSink
from statebackend.run_options import RunOption, run_options
from statebackend.spark.session import (
    add_to_pythonpath,
    default_master,
    owned_session,
    under_spark_submit,
)

PROG = "ckpt run"
JOB_OPTION_PREFIX = "job_option__"
# `ckpt`'s global options: `ckpt run` has them already, the other entry points add them
GLOBAL_OPTIONS = ("storage", "job")


class JobParser(argparse.ArgumentParser):
    """Adds the flags of the job named in the arguments (or fixed) before parsing them."""

    fixed_job_ref: str | None = None  # a job module's own entry point names its job

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        add_job_options(self, [self.fixed_job_ref, *args] if self.fixed_job_ref else args)
        return super().parse_known_args(args, namespace)


def add_job_options(parser: argparse.ArgumentParser, args: list[str]) -> None:
    """Find ``MODULE:ATTR`` in ``args``, load the job, add ``--<option>`` per Job option."""
    if getattr(parser, "_ckpt_job_options", False):
        return
    ref = next((a for a in args if is_job_ref(a)), None)
    if ref is None:
        return
    importable_cwd()
    try:
        job = load_job(ref)
    except UsageError:
        return  # the handler reports it as one line
    parser._ckpt_job_options = True  # type: ignore[attr-defined]
    group = parser.add_argument_group(f"options of job {job.name!r}")
    for opt in job.options:
        flag = "--" + opt.name.replace("_", "-")
        try:
            group.add_argument(flag, dest=JOB_OPTION_PREFIX + opt.name, default=argparse.SUPPRESS,
                               metavar=opt.type.__name__.upper(),
                               help=f"{opt.help} (default {opt.default!r})")
        except argparse.ArgumentError:
            parser.error(f"job {job.name!r}: option {opt.name!r} collides with a common "
                         f"option {flag}; rename it")


def importable_cwd() -> None:
    """The current directory on ``sys.path`` (job modules are found as with ``python -m``)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def add_run_arguments(p: argparse.ArgumentParser, *, with_storage: bool,
                      job_ref: str | None = None) -> None:
    """One flag per run option with a flag (`statebackend.run_options`); ``--storage`` and
    ``--job`` only ``with_storage`` (else `ckpt` gives them); ``job_ref`` fixes the job
    instead of a ``MODULE:ATTR`` argument."""
    if job_ref is None:
        p.add_argument("job_ref", metavar="MODULE:ATTR",
                       help="the job: a statebackend.job.Job, e.g. examples.user_activity:job")
    else:
        p.set_defaults(job_ref=job_ref)
    where = p.add_mutually_exclusive_group()  # --master or --remote
    for opt in run_options():
        if not opt.flag or (opt.name in GLOBAL_OPTIONS and not with_storage):
            continue
        (where if opt.name == "master" else p).add_argument(opt.cli_flag, **_flag_of(opt))
    where.add_argument("--remote", default=None, metavar="sc://HOST:PORT",
                       help="run as a Spark Connect client of this server (no local JVM)")


def _flag_of(opt: RunOption) -> dict:
    """argparse keywords of a run option's flag (its help shows a set default)."""
    # --master: None is spark-submit's --master, else the declared one (its help says so)
    default = None if opt.name == "master" else opt.default
    shown = " (default %(default)s)" if default is not None and not opt.required else ""
    kw: dict = {"required": opt.required, "default": default, "metavar": opt.metavar,
                "help": opt.help + shown}
    if opt.type is not str:
        kw["type"] = opt.type
    if opt.choices:
        kw["choices"] = opt.choices
    return kw


def config_from_args(args: argparse.Namespace, job) -> RunConfig:
    """The `RunConfig` of parsed arguments (``args.storage``, ``args.job`` included)."""
    values = {opt.name: getattr(args, opt.name) for opt in run_options()
              if opt.flag and hasattr(args, opt.name)}
    options = {k[len(JOB_OPTION_PREFIX):]: v for k, v in vars(args).items()
               if k.startswith(JOB_OPTION_PREFIX)}
    return RunConfig(**{
        **values, "job": args.job or None, "options": options,
        "master": args.remote or args.master or default_master(),
        # spark-submit started the application on its master: the run's tasks go there
        "engine": args.engine or ("spark" if under_spark_submit() else None)})


def run_from_args(args: argparse.Namespace, progress: ProgressSink = NO_PROGRESS) -> dict:
    """Load the job, run it, return the summary; a Spark session the run starts is
    stopped at the end (a caller's stays up)."""
    importable_cwd()
    job = load_job(args.job_ref)
    config = config_from_args(args, job)
    # Executors import the job's module and the library from the same places.
    add_to_pythonpath(*(r for r in (module_root(args.job_ref), _library_root()) if r))
    with owned_session():
        return run_job(job, config, progress=progress)


def _library_root() -> str:
    """The folder holding the ``statebackend`` package (statebackend/job/command.py)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def print_summary(args: argparse.Namespace, summary: dict, prog: str, *,
                  json_line: bool = False) -> None:
    """The summary as text or (``--json``) one JSON document, one line with ``json_line``;
    warnings on stderr."""
    if args.json:
        print(json.dumps(summary, indent=None if json_line else 2, sort_keys=True,
                         default=str))
    else:
        print(format_summary(summary))
    if summary.get("input_files_skipped"):
        print(f"{prog}: warning: {skipped_warning(args.input, summary)}", file=sys.stderr)
    for text in summary.get("warnings", []):
        print(f"{prog}: warning: {text}", file=sys.stderr)


def main(argv: list[str] | None = None, *, job_ref: str | None = None, prog: str = PROG,
         require_job: bool = False, json_line: bool = False) -> int:
    """Run the job named in ``argv`` (or ``job_ref``, then ``argv`` holds only options) once.

    ``prog`` starts error and warning lines; ``require_job`` makes ``--job`` required
    and ``json_line`` prints the ``--json`` summary on one line (both: the release-1
    CLI of ``jobs.keyed_aggregation``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = JobParser(
        prog=prog if job_ref else "submit.py",
        description=f"Run the job {job_ref} once (also under spark-submit)." if job_ref
        else "Run a stateful job (MODULE:ATTR) once under spark-submit.")
    parser.fixed_job_ref = job_ref
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    add_run_arguments(parser, with_storage=True, job_ref=job_ref)
    args = parser.parse_args(argv)
    if require_job and not args.job:
        parser.error("the following arguments are required: --job")
    try:
        with Progress("run") as progress:  # periodic lines in the Airflow task log
            summary = run_from_args(args, progress)
    except CkptError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print_summary(args, summary, prog, json_line=json_line)
    return 0


def entry_point(job_ref: str, *, prog: str = PROG, require_job: bool = False,
                json_line: bool = False) -> Callable[[list[str] | None], int]:
    """A job module's ``main(argv=None) -> exit code``: `main` with its job fixed, e.g.
    ``main = entry_point("jobs.dedup:JOB")`` then ``if __name__ == "__main__":
    sys.exit(main())`` (``python -m jobs.dedup ARGS``, ``spark-submit jobs/dedup.py``)."""

    def job_main(argv: list[str] | None = None) -> int:
        return main(argv, job_ref=job_ref, prog=prog, require_job=require_job,
                    json_line=json_line)

    job_main.__doc__ = f"``ckpt run {job_ref}`` with the given arguments (spark-submit too)."
    return job_main
