"""``ckpt run MODULE:ATTR --input ... --storage ... --run-id ...``: run any job once.

The job is the `statebackend.job.Job` at ``MODULE:ATTR`` (imported from the
Python path; the current directory comes first, as with ``python -m``). The
options every job shares are fixed; the job's own options (`Job.options`) become
flags once the job is loaded, e.g. ``--normalize-case false``. A user writes no
``main``. The same arguments work under spark-submit through
``statebackend/cli/submit.py`` (the master then comes from spark-submit).

Which job runs comes from this argument only: nothing read from checkpoint
storage chooses code to import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from statebackend import defaults
from statebackend.cli.app import emit_json, json_flag
from statebackend.errors import UsageError
from statebackend.progress import NO_PROGRESS, Progress, ProgressSink

JOB_OPTION_PREFIX = "job_option__"


class _JobParser(argparse.ArgumentParser):
    """Adds the flags of the job named in the arguments (or fixed) before parsing them."""

    fixed_job_ref: str | None = None  # a job module's own entry point names its job

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        add_job_options(self, [self.fixed_job_ref, *args] if self.fixed_job_ref else args)
        return super().parse_known_args(args, namespace)


def add_job_options(parser: argparse.ArgumentParser, args: list[str]) -> None:
    """Find ``MODULE:ATTR`` in ``args``, load the job, add ``--<option>`` per Job option."""
    from statebackend.job.load import is_job_ref, load_job

    if getattr(parser, "_ckpt_job_options", False):
        return
    ref = next((a for a in args if is_job_ref(a)), None)
    if ref is None:
        return
    _importable_cwd()
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


def _importable_cwd() -> None:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def add_run_arguments(p: argparse.ArgumentParser, *, with_storage: bool,
                      job_ref: str | None = None) -> None:
    """The options every job shares (``--storage``/``--job`` come from `ckpt` itself);
    ``job_ref`` fixes the job instead of a ``MODULE:ATTR`` argument."""
    if job_ref is None:
        p.add_argument("job_ref", metavar="MODULE:ATTR",
                       help="the job: a statebackend.job.Job, e.g. examples.user_activity:job")
    else:
        p.set_defaults(job_ref=job_ref)
    p.add_argument("--input", required=True,
                   help="folder of Parquet and/or JSON-lines files (optionally .gz)")
    if with_storage:
        p.add_argument("--storage", required=True, help="checkpoint storage root URL")
        p.add_argument("--job", default=None,
                       help="folder under the storage root (default: the job's name)")
    p.add_argument("--run-id", required=True,
                   help="idempotency key: a committed run id is skipped")
    p.add_argument("--output", default=None,
                   help="output root (required when the job declares outputs)")
    p.add_argument("--parallelism", type=int, default=None,
                   help="subtasks P (first run of a lineage; later runs keep it)")
    p.add_argument("--max-parallelism", type=int, default=defaults.MAX_PARALLELISM,
                   help="key groups M (fixed at the first run; default %(default)s)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--master", default=None,
                       help="Spark master (default: spark-submit's --master, else local[*])")
    where.add_argument("--remote", default=None, metavar="sc://HOST:PORT",
                       help="run as a Spark Connect client of this server (no local JVM)")
    p.add_argument("--engine", choices=defaults.ENGINES, default=None,
                   help="spark, or local: this process, no JVM (small inputs); auto "
                        "(default, or $CKPT_ENGINE; spark under spark-submit) picks local "
                        "for an input up to 64 MiB (docs/performance.md)")
    p.add_argument("--max-reject-fraction", type=float, default=defaults.MAX_REJECT_FRACTION,
                   help="fail when more than this fraction of rows is rejected "
                        "(default %(default)s)")
    p.add_argument("--quarantine", default=None,
                   help="folder for rejected rows (default <output>/_quarantine)")
    p.add_argument("--start-from", default=None,
                   help="first run only: start from a savepoint or another job's checkpoint")
    p.add_argument("--logical-time-ms", type=int, default=None, metavar="MS",
                   help="the run's processing time (epoch ms) for processing-time timers and "
                        "TTL; Airflow passes the data interval's end (default: now)")
    p.add_argument("--local-dir", default=None,
                   help="executors' local-recovery folder (default $CKPT_LOCAL_DIR or tmp)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", parents=[json_flag()], help="run a job (MODULE:ATTR) once",
        description="Run a stateful job once: read the input folder, update the state from "
                    "the latest checkpoint, write the outputs, commit a new checkpoint. "
                    "Idempotent by --run-id. The job's own options appear as flags once "
                    "MODULE:ATTR is given (`ckpt run MODULE:ATTR --help`).")
    p.__class__ = _JobParser  # the job's flags are known only once MODULE:ATTR is read
    add_run_arguments(p, with_storage=False)
    p.set_defaults(handler=cmd_run, scope="root")


def config_from_args(args: argparse.Namespace, job):
    """The `RunConfig` of parsed arguments (``args.storage``, ``args.job`` included)."""
    from statebackend.job.config import RunConfig
    from statebackend.spark.session import default_master, under_spark_submit

    options = {k[len(JOB_OPTION_PREFIX):]: v for k, v in vars(args).items()
               if k.startswith(JOB_OPTION_PREFIX)}
    return RunConfig(
        input=args.input, storage=args.storage, job=args.job or None, run_id=args.run_id,
        output=args.output, parallelism=args.parallelism,
        max_parallelism=args.max_parallelism,
        master=args.remote or args.master or default_master(),
        max_reject_fraction=args.max_reject_fraction, quarantine=args.quarantine,
        start_from=args.start_from, local_dir=args.local_dir, options=options,
        logical_time_ms=args.logical_time_ms,
        # spark-submit started the application on its master: the run's tasks go there
        engine=args.engine or ("spark" if under_spark_submit() else None))


def run_from_args(args: argparse.Namespace, progress: ProgressSink = NO_PROGRESS) -> dict:
    """Load the job, run it in a session this call owns, return the summary."""
    from statebackend.job.load import load_job, module_root
    from statebackend.job.run import run_job
    from statebackend.spark.session import add_to_pythonpath, stop_active_session

    _importable_cwd()
    job = load_job(args.job_ref)
    config = config_from_args(args, job)
    # Executors import the job's module and the library from the same places.
    add_to_pythonpath(*(r for r in (module_root(args.job_ref), _library_root()) if r))
    try:
        return run_job(job, config, progress=progress)
    finally:
        stop_active_session()


def _library_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def print_summary(args: argparse.Namespace, summary: dict, prog: str, *,
                  json_line: bool = False) -> None:
    """The summary as text or (``--json``) one JSON document, one line with ``json_line``;
    warnings on stderr."""
    from statebackend.job.run import format_summary, skipped_warning

    if args.json and json_line:
        print(json.dumps(summary, sort_keys=True, default=str))
    elif args.json:
        emit_json(summary)
    else:
        print(format_summary(summary))
    if summary.get("input_files_skipped"):
        print(f"{prog}: warning: {skipped_warning(args.input, summary)}", file=sys.stderr)
    for text in summary.get("warnings", []):
        print(f"{prog}: warning: {text}", file=sys.stderr)


def cmd_run(args: argparse.Namespace, _storage) -> int:
    with Progress("run") as progress:
        summary = run_from_args(args, progress)
    print_summary(args, summary, "ckpt run")
    return 0


__all__ = ["add_run_arguments", "config_from_args", "register", "run_from_args"]
