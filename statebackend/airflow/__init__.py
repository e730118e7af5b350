"""The Airflow provider of the checkpoint lifecycle.

- `statebackend.airflow.config`     ``ckpt_jobs``: job definitions (`JobSpec`)
- `statebackend.airflow.connection` an ``aws`` connection -> storage options
- `statebackend.airflow.hook`       `CheckpointHook`: a job's store from a connection + URL
- `statebackend.airflow.operators`  run / validate / retain / gc / rescale operators
- `statebackend.airflow.steps`      what the tasks do, callable without Airflow
- `statebackend.airflow.factory`    the DAG factory (`build_dags`); ``dags/`` calls it
- `statebackend.airflow.provider`   ``get_provider_info`` for Airflow's provider registry
- `statebackend.airflow.page`       the Checkpoints page (FastAPI app, HTML, static assets)
- `statebackend.airflow.plugin`     ``CheckpointsPlugin`` (``airflow.plugins`` entry point)

Nothing is imported here: `config` must stay importable without Airflow's heavy parts.
"""
