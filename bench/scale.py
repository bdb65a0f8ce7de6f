"""Benchmark 3: one scheduler instance with many jobs of mixed schedules.

    python -m bench.scale [--sizes 1000,10000,100000] [--backends redis,stub]
                          [--idle 20] [--due 1000] [--repeats 3]

Each size runs in a fresh process (so memory figures are its own), in
process with :class:`celery_anarchon.Scheduler`, a clock that starts at a
fixed instant and runs at real speed, and Celery's in-memory broker
(``memory://``):

* **start-up**: wall and CPU seconds of ``Scheduler(app)`` (validating every
  job, connecting, reading each job's last slot, planning first slots) and of
  the first tick (the first registry heartbeat);
* **memory**: resident set size after start-up, and its growth over the
  process before the scheduler was made (the ``beat_schedule`` itself
  included in neither);
* **idle CPU**: the beat loop (``tick()``, then sleep what it returns) for
  ``--idle`` seconds while no job is due, scaled to a minute (so a 20 s
  window is multiplied by 3); it includes the registry heartbeats every 5 s;
* **idle tick**: the median ``tick()`` when nothing is due and no heartbeat
  is due, and the median tick that ran a heartbeat;
* **due tick**: one tick with ``--due`` jobs due at once, among all the
  jobs, on the stub backend (claims won at once, no I/O), so the figure is
  the scheduler's own cost per due job.

Backends: ``redis`` (a real Redis on 127.0.0.1, a prefix of this run's own,
removed afterwards) or ``stub`` (an in-process backend that wins every claim
and keeps nothing; it isolates the scheduler's CPU from the backend's).

The mixed schedules (one sixth each): every 5 min, hourly (intervals),
``*/10 * * * *`` (cron string), every 2 h on the hour (``crontab``), daily at
03:30 (cron string), weekly Monday 04:15 (``crontab``). The clock starts at
10:02:00 UTC, when nothing is due before 10:05:00.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from . import common
from .common import log

#: The clock's start: nothing of the mix is due within 3 minutes after it.
ORIGIN = datetime(2026, 12, 1, 10, 2, tzinfo=timezone.utc).timestamp()
#: The instant the ``--due`` jobs (every minute) fall due.
DUE_AT = datetime(2026, 12, 1, 10, 3, tzinfo=timezone.utc).timestamp()


def mixed_schedule(count: int, due: int = 0) -> dict[str, dict[str, Any]]:
    """``count`` jobs of mixed schedules; the first ``due`` run every minute."""
    from celery.schedules import crontab

    kinds: list[Any] = [
        timedelta(minutes=5),
        timedelta(hours=1),
        "*/10 * * * *",
        crontab(minute=0, hour="*/2"),
        "30 3 * * *",
        crontab(minute=15, hour=4, day_of_week="mon"),
    ]
    out: dict[str, dict[str, Any]] = {}
    for i in range(count):
        every = timedelta(minutes=1) if i < due else kinds[i % len(kinds)]
        out[f"job-{i:06d}"] = {"task": "scale.noop", "schedule": every}
    return out


def stub_backend_class() -> type[Any]:
    """A backend that wins every claim at once and keeps nothing."""
    from celery_anarchon.backends.base import Claim, LeaseBackend

    class StubBackend(LeaseBackend):
        def open(self) -> None:
            """Nothing to connect."""

        def close(self) -> None:
            """Nothing to close."""

        def now_ms(self) -> int:
            return time.time_ns() // 1_000_000

        def claim(self, requests: Sequence[Any]) -> list[Any]:
            return [Claim(r.job, r.slot_ms, won=True, token=1) for r in requests]

        def mark(self, claim: Any, state: Any, **_: Any) -> bool:
            return True

        def record_many_if_absent(self, records: Sequence[Any]) -> list[bool]:
            return [True] * len(records)

        def history(self, job: str, limit: int | None = None) -> list[Any]:
            return []

        def claim_manual(self, job: str, key: str, keep_until_ms: int) -> Any:
            return Claim(job, self.now_ms(), won=True, token=1)

        def take_run_now_guard(self, job: str, hold_ms: int) -> bool:
            return True

        def take_over_many(self, requests: Sequence[Any]) -> list[Any]:
            return [Claim(r.job, r.slot_ms, won=False, reason="taken") for r in requests]

        def release(self, claims: Sequence[Any]) -> None:
            """Nothing is kept: nothing to give back."""

        def extend(self, claim: Any, lease_ms: int, *, restart: bool = False) -> bool:
            return not restart

        def holding(self, claims: Sequence[Any], margin_ms: int = 0) -> list[bool]:
            return [False] * len(claims)  # no record is kept, so none is held

    return StubBackend


def child(size: int, backend: str, idle: float, due: int) -> dict[str, Any]:
    """One measurement in this (fresh) process."""
    import redis
    from celery import Celery

    from celery_anarchon import Scheduler

    prefix = f"anarchon-bench-{common.RUN_ID}-scale:"
    app = Celery("scale", broker="memory://")
    app.conf.update(
        timezone="UTC",
        task_ignore_result=True,
        beat_schedule=mixed_schedule(size),
        anarchon_backend=f"{common.REDIS_URL}?prefix={prefix}" if backend == "redis" else None,
    )
    ticking = ORIGIN
    real0 = time.monotonic()

    def clock() -> float:
        return ticking + (time.monotonic() - real0)

    given = None
    if backend == "stub":
        given = stub_backend_class()(None, instance="stub")
    rss0 = common.rss_bytes()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    sched = Scheduler(app, backend=given, clock=clock)
    start_wall, start_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    rss1 = common.rss_bytes()
    wall0 = time.perf_counter()
    sched.tick()
    first_tick = time.perf_counter() - wall0
    # idle loop, as beat runs it
    ticks: list[float] = []
    end = time.monotonic() + idle
    cpu0 = time.process_time()
    while time.monotonic() < end:
        started = time.perf_counter()
        wait = sched.tick()
        ticks.append(time.perf_counter() - started)
        time.sleep(max(0.0, min(wait, end - time.monotonic())))
    idle_cpu = time.process_time() - cpu0
    quiet = [t for t in ticks if t < 0.005]
    busy = [t for t in ticks if t >= 0.005]
    # idle tick in a tight loop (no heartbeat due: it just ran)
    tight = []
    for _ in range(200):
        started = time.perf_counter()
        sched.tick()
        tight.append(time.perf_counter() - started)
    result = {
        "size": size,
        "backend": backend,
        "startup_s": start_wall,
        "startup_cpu_s": start_cpu,
        "first_tick_s": first_tick,
        "rss_mib": rss1 / 2**20,
        "rss_growth_mib": (rss1 - rss0) / 2**20,
        "idle_window_s": idle,
        "idle_cpu_per_min_s": idle_cpu * 60 / idle,
        "ticks_in_window": len(ticks),
        "heartbeat_ticks": len(busy),
        "heartbeat_tick_s": statistics.median(busy) if busy else None,
        "quiet_tick_us": statistics.median(tight) * 1e6,
        "quiet_ticks_in_loop_us": statistics.median(quiet) * 1e6 if quiet else None,
        "jobs": len(sched.jobs),
    }
    sched.close()
    if backend == "redis":
        client = redis.Redis.from_url(common.REDIS_URL)
        common.redis_delete(client, "{" + prefix + "*")
        client.close()
    if due:
        result.update(due_tick(size, due))
    return result


def due_tick(size: int, due: int) -> dict[str, Any]:
    """One tick with ``due`` jobs due at once among ``size``, stub backend."""
    from celery import Celery

    from celery_anarchon import Scheduler

    app = Celery("scale-due", broker="memory://")
    app.conf.update(
        timezone="UTC", task_ignore_result=True, beat_schedule=mixed_schedule(size, due)
    )
    now = [DUE_AT - 5.0]
    sched = Scheduler(
        app, backend=stub_backend_class()(None, instance="stub"), clock=lambda: now[0]
    )
    sched.tick()  # first heartbeat out of the way
    now[0] = DUE_AT + 0.001 + sched.jobs["job-000000"].options.jitter
    started = time.perf_counter()
    sched.tick()
    took = time.perf_counter() - started
    sched.close()
    count = min(due, size)
    return {"due": count, "due_tick_s": took, "due_tick_per_job_us": took / count * 1e6}


def report(results: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        if "error" not in r:
            groups.setdefault((r["backend"], r["size"]), []).append(r)

    def col(runs: list[dict[str, Any]], key: str, digits: int = 2, scale: float = 1.0) -> str:
        values = [r[key] for r in runs if r.get(key) is not None]
        return common.fmt(common.spread(values), digits, scale) if values else "-"

    rows = []
    for (backend, size), runs in sorted(groups.items()):
        rows.append(
            [
                backend,
                f"{size:,}",
                col(runs, "startup_s"),
                col(runs, "first_tick_s", 3),
                col(runs, "rss_mib", 0),
                col(runs, "rss_growth_mib", 0),
                col(runs, "idle_cpu_per_min_s", 3),
                col(runs, "quiet_tick_us", 1),
                col(runs, "heartbeat_tick_s", 3),
                col(runs, "due_tick_s", 3),
                col(runs, "due_tick_per_job_us", 0),
            ]
        )
    lines = [
        f"Scale: mixed schedules, one instance; idle window {args.idle:g} s scaled to a "
        f"minute; due tick with {args.due} jobs due at once (stub backend); median over "
        f"{args.repeats} repeats (min-max).",
        "",
        common.table(
            [
                "backend",
                "jobs",
                "start-up (s)",
                "first tick (s)",
                "RSS (MiB)",
                "RSS growth (MiB)",
                "idle CPU s / min",
                "quiet tick (µs)",
                "heartbeat tick (s)",
                f"tick with {args.due} due (s)",
                "per due job (µs)",
            ],
            rows,
        ),
    ]
    for backend in sorted({b for b, _ in groups}):
        sizes = sorted(s for b, s in groups if b == backend)
        if len(sizes) > 1:
            small, large = groups[(backend, sizes[0])], groups[(backend, sizes[-1])]
            ratio = statistics.median(r["idle_cpu_per_min_s"] for r in large) / max(
                1e-9, statistics.median(r["idle_cpu_per_min_s"] for r in small)
            )
            lines.append(
                f"- {backend}: idle CPU at {sizes[-1]:,} jobs / at {sizes[0]:,} jobs = {ratio:.1f}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--backends", default="redis,stub")
    parser.add_argument("--idle", type=float, default=20.0, help="idle window, seconds")
    parser.add_argument("--due", type=int, default=1000, help="jobs due at once in the due tick")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write raw results to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    common.exit_on_sigterm()
    if args.child:
        size, backend = args.child.split(":")
        print(json.dumps(child(int(size), backend, args.idle, args.due)))
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if "redis" in backends and not common.service_up("redis"):
        log("Redis is not running on 127.0.0.1:6379: redis skipped")
        backends.remove("redis")
    print(common.header("Scale"))
    results: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for backend in backends:
            for size in sizes:
                log(f"repeat {repeat + 1}/{args.repeats}: {size} jobs, {backend}")
                command = [
                    sys.executable,
                    "-m",
                    "bench.scale",
                    "--child",
                    f"{size}:{backend}",
                    "--idle",
                    str(args.idle),
                    "--due",
                    str(args.due),
                ]
                env = {**os.environ, "PYTHONPATH": str(common.REPO)}
                done = subprocess.run(
                    command,
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=common.REPO,
                    timeout=1800,
                    check=False,
                )
                if done.returncode != 0:
                    log(f"  failed: {done.stderr[-2000:]}")
                    results.append({"size": size, "backend": backend, "error": done.stderr[-2000:]})
                    continue
                result = json.loads(done.stdout.strip().splitlines()[-1])
                result["repeat"] = repeat
                results.append(result)
                log(f"  {json.dumps(result)[:300]}")
    print(report(results, args))
    common.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
