"""The application's jobs, each a `statebackend.job.Job` in its own module.

`BUILTIN_JOBS` maps the names a deployment may use for the built-in jobs (e.g.
``job: keyed_aggregation`` in a ``ckpt_jobs`` entry) to their ``module:attr``
reference for `statebackend.job.load_job`.
"""

BUILTIN_JOBS = {"keyed_aggregation": "jobs.keyed_aggregation:JOB",
                "sessionization": "jobs.sessionization:JOB", "dedup": "jobs.dedup:JOB"}
