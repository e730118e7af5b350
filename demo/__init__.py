"""The demo: sample data and the two ``make demo`` drivers (not part of the library).

- `demo.sample_data`    deterministic sample events for keyed aggregation (tests, bench)
- `demo.pipeline_demo`  ``make demo``: the whole product through Airflow (``dags test``)
- `demo.job_demo`       the keyed aggregation job alone, one run per sample day
"""
