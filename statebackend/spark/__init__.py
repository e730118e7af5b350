"""The Spark side of the library: sessions (`session`, local, standalone or Spark Connect),
task dispatch (`dispatch`: one Spark task per subtask) and the state reader
(`state_reader`: a checkpoint's state as a DataFrame).

An adapter under the layers that run Spark work (`job/`, `rescale/`) and above those that
never do (`state/`, `storage/`, `checkpoint/`, `lifecycle/`, `validation/`): it imports only
`errors`, and never the application (`jobs/`, `dags/`, `plugins/`).
"""
