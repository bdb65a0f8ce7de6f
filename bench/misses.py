"""Recording a round of missed slots: batched against one call per slot.

    python -m bench.misses [--jobs 10000] [--backends redis,postgresql,sqlite]
                           [--repeats 3] [--json PATH]

An instance that wakes past ``max_late`` for every job's slot (a stall, a
frozen VM) records each slot ``missed``. This measures that tick in one
process with :class:`celery_anarchon.Scheduler` and Celery's in-memory
broker, two ways side by side in the same run, alternating per repeat:

* **batched**: the scheduler as shipped, ``Backend.record_many_if_absent``
  per 500 records (one Redis pipeline, one SQL insert);
* **per slot**: the same scheduler with the backend's
  ``record_many_if_absent`` called with one record at a time (one round
  trip per slot): what the scheduler
  did before the batching (hot spot 4 in ``docs/benchmarks.md``).

Each repeat uses a fresh namespace (Redis key prefix, SQL table prefix, a
new SQLite file), ``--jobs`` jobs every 60 s and ``max_late`` 5 s; the clock
starts 0.5 s before a slot (one tick sets up), then jumps 6 s past it. The
figure is that tick's wall and CPU time (``time.process_time``: this
process, not the backend server's). Every run checks that each job's slot
was recorded ``missed`` and nothing was sent.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

from . import common
from .burst import Config, claim_backend
from .common import log

PERIOD = 60.0


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run_once(backend: str, jobs: int, batched: bool) -> dict[str, float]:
    """One repeat, in a namespace of its own (``bench.burst.claim_backend``:
    a Redis key prefix, SQL tables or a SQLite file, removed afterwards)."""
    tag = f"{common.RUN_ID}-miss{uuid.uuid4().hex[:6]}"
    with claim_backend(Config("anarchon", backend), tag) as url:
        assert url is not None
        return _measure(url, jobs, batched)


def _measure(url: str, jobs: int, batched: bool) -> dict[str, float]:
    """Wall and CPU seconds of the tick that records the misses."""
    from celery import Celery

    from celery_anarchon import Scheduler
    from celery_anarchon.backends.base import State

    app = Celery(f"misses-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        task_default_queue=f"q-{uuid.uuid4().hex[:8]}",
        anarchon_backend=url,
        anarchon_jitter=0,
        anarchon_max_late=5,
        anarchon_max_skew=120,
        timezone="UTC",
        beat_schedule={
            f"job-{i:05d}": {"task": "bench.job", "schedule": PERIOD} for i in range(jobs)
        },
    )
    slot = (int(time.time()) // int(PERIOD) + 2) * PERIOD
    clock = _Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    try:
        assert s.backend is not None
        if not batched:  # one round trip per record
            one = s.backend.record_many_if_absent
            s.backend.record_many_if_absent = (  # type: ignore[method-assign]
                lambda records: [written for r in records for written in one([r])]
            )
        s.tick()
        clock.now = slot + 6
        wall, cpu = time.perf_counter(), time.process_time()
        s.tick()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        slot_ms = int(slot * 1000)
        for name in (f"job-{i:05d}" for i in (0, jobs // 2, jobs - 1)):
            states = [(r.slot_ms, r.state) for r in s.backend.history(name)]
            if states != [(slot_ms, State.MISSED)]:
                raise SystemExit(f"{name}: expected one missed record, found {states}")
        with app.connection_for_write() as conn:
            queue = conn.SimpleQueue(app.conf.task_default_queue)
            queued = queue.qsize()
            queue.close()
        if queued:
            raise SystemExit(f"{queued} message(s) sent for missed slots")
        return {"wall": wall, "cpu": cpu}
    finally:
        s.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--backends", default="redis,postgresql,sqlite")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="save raw results to this path")
    args = parser.parse_args(argv)
    common.exit_on_sigterm()
    backends = [b for b in args.backends.split(",") if b]
    raw: dict[str, dict[str, list[dict[str, float]]]] = {}
    unknown = [b for b in backends if b not in ("redis", "postgresql", "sqlite")]
    if unknown:
        raise SystemExit(f"unknown backend {unknown[0]!r}: use redis, postgresql or sqlite")
    for backend in backends:
        if backend != "sqlite" and not common.service_up(backend):
            log(f"{backend} is not running here: skipped")
            continue
        runs: dict[str, list[dict[str, float]]] = {"batched": [], "per slot": []}
        for repeat in range(args.repeats):
            for batched in (repeat % 2 == 0, repeat % 2 == 1):  # alternate the order
                name = "batched" if batched else "per slot"
                log(f"{backend} {name} repeat {repeat + 1}/{args.repeats}")
                runs[name].append(run_once(backend, args.jobs, batched))
        raw[backend] = runs
    print(common.header(f"Recording {args.jobs:,} missed slots in one tick"))
    rows = []
    for backend, runs in raw.items():
        walls = {k: [r["wall"] for r in v] for k, v in runs.items()}
        cpus = {k: [r["cpu"] for r in v] for k, v in runs.items()}
        ratios = [p / b for p, b in zip(walls["per slot"], walls["batched"], strict=True)]
        rows.append(
            [
                backend,
                common.fmt(common.spread(walls["batched"])),
                common.fmt(common.spread(walls["per slot"])),
                f"{statistics.median(ratios):.1f} ({min(ratios):.1f}-{max(ratios):.1f})",
                common.fmt(common.spread(cpus["batched"])),
                common.fmt(common.spread(cpus["per slot"])),
            ]
        )
    print(
        common.table(
            [
                "backend",
                "batched: wall s",
                "per slot: wall s",
                "per slot / batched (wall, same repeat)",
                "batched: CPU s",
                "per slot: CPU s",
            ],
            rows,
        )
    )
    print(
        f"\n{args.repeats} repeats each, median (min-max); every slot recorded missed, none sent."
    )
    common.write_json(args.json, raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
