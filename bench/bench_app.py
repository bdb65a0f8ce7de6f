"""The Celery app the burst benchmark runs real ``celery beat`` processes on.

Configured through environment variables (set by :mod:`bench.burst`):

* ``BENCH_KIND``: ``celery`` (Celery's default ``PersistentScheduler``),
  ``redbeat`` (celery-redbeat) or ``anarchon``;
* ``BENCH_BROKER``: Celery broker URL; ``BENCH_QUEUE``: the queue every task
  goes to (read back by the benchmark);
* ``BENCH_JOBS``: how many jobs; ``BENCH_PERIOD``: their period, seconds;
* ``BENCH_FIRST``: epoch seconds of the first slot Celery's and redbeat's
  schedulers must send (their intervals count from ``last_run_at``, so it is
  set to one period before); anarchon's intervals are anchored on the epoch,
  so every job falls due at each multiple of the period anyway;
* ``BENCH_BACKEND``: ``anarchon_backend``; ``BENCH_REDBEAT_URL`` and
  ``BENCH_REDBEAT_PREFIX``: redbeat's Redis and key prefix;
* ``BENCH_CONF``: JSON merged into ``app.conf`` (e.g. ``anarchon_jitter``);
* ``BENCH_READY_DIR``: where each beat writes ``ready-<pid>`` (the time it
  finished set-up) from the ``beat_init`` signal.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from celery import Celery, signals
from celery.schedules import schedule

KIND = os.environ.get("BENCH_KIND", "anarchon")
JOBS = int(os.environ.get("BENCH_JOBS", "100"))
PERIOD = float(os.environ.get("BENCH_PERIOD", "20"))
FIRST = float(os.environ.get("BENCH_FIRST", "0"))


def job_name(i: int) -> str:
    """The name of job ``i`` (the ``beat_schedule`` key)."""
    return f"job-{i:06d}"


def beat_schedule() -> dict[str, dict[str, Any]]:
    """``BENCH_JOBS`` jobs every ``BENCH_PERIOD`` seconds, all due together."""
    every = timedelta(seconds=PERIOD)
    if KIND == "anarchon":
        return {job_name(i): {"task": "bench.noop", "schedule": every} for i in range(JOBS)}
    last = datetime.fromtimestamp(FIRST, timezone.utc) - every
    return {
        job_name(i): {
            "task": "bench.noop",
            "schedule": schedule(run_every=every),
            "last_run_at": last,
        }
        for i in range(JOBS)
    }


app = Celery("bench")
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/3"),
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
    task_ignore_result=True,
    timezone="UTC",
    broker_connection_retry_on_startup=True,
    beat_schedule=beat_schedule(),
)
if KIND == "anarchon":
    app.conf.anarchon_backend = os.environ.get("BENCH_BACKEND") or None
if KIND == "redbeat":
    app.conf.redbeat_redis_url = os.environ.get("BENCH_REDBEAT_URL", "redis://127.0.0.1:6379/0")
    app.conf.redbeat_key_prefix = os.environ.get("BENCH_REDBEAT_PREFIX", "bench-redbeat:")
app.conf.update(json.loads(os.environ.get("BENCH_CONF", "{}")))


@app.task(name="bench.noop")
def noop() -> None:
    """Does nothing; the benchmark reads the messages, not results."""


@signals.beat_init.connect
def _ready(sender: Any = None, **_: Any) -> None:
    folder = os.environ.get("BENCH_READY_DIR")
    if folder:
        # Written under a temporary name, then renamed: the benchmark reads
        # every ready-* mark and must never see one half written.
        tmp = Path(folder, f".tmp-ready-{os.getpid()}")
        tmp.write_text(repr(time.time()))
        tmp.rename(Path(folder, f"ready-{os.getpid()}"))
