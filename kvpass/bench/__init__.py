"""Benchmarks for kvpass: long-context tasks generated offline (``kvpass.bench.tasks``)."""
