"""Benchmarks of celery-anarchon (issue 8); see docs/benchmarks.md.

Each module runs with one command, e.g. ``python -m bench.claims``.
"""
