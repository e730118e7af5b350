"""Keyed state on embedded RocksDB: key groups, value codecs, the backend and the state
kinds (value, list, map), plus time in state: timers, TTL and the watermark.

Depends only on ``statebackend.errors``/``defaults``; everything else builds on it.
"""
