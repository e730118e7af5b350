"""Independent pandas references for the event-time jobs (issue 12): sessions and dedup.

They define the semantics our jobs implement; the job tests and the Spark peers
(`bench/peers/`) are checked against them. Pure pandas, no Spark, no state backend.
"""
