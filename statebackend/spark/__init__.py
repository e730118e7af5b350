"""The Spark side of the library: sessions (`session`) and task dispatch (`dispatch`).

It sits on top of the state backend and the job API: nothing below imports it,
and it never imports the application (`jobs/`, `dags/`, `plugins/`).
"""
