"""Durable delayed tasks (issue 17): what a parked task costs in Redis,
PostgreSQL, MySQL/MariaDB and SQLite, how fast ``park`` is, and how fast and
how punctually real beats release what is parked.

    python -m bench.delayed [--redis-count 1000000] [--pg-count 100000]
        [--redis-single 20000] [--pg-single 2000] [--chunk 1000]
        [--instances 3] [--spread 0] [--late-count 20000] [--late-seconds 20]
        [--push-count 200] [--push-rate 20] [--poll 2] [--margin 5]
        [--stall 30] [--settle 3] [--backend redis,postgresql[,mysql,sqlite]]
        [--profile DIR] [--tiny] [--json PATH]

Per backend of ``--backend``, in turn, each under a run-unique prefix (Redis
keys, PostgreSQL tables) removed at the end, also on SIGTERM:

1. **Parks**, on a prefix of their own that no beat releases (nothing
   there is ever due: every task is due in a day), so nothing leaves the
   store while it is measured:

   - *single*: ``--redis-single`` / ``--pg-single`` calls of
     ``celery_anarchon.delayed.park`` in a loop, each timed (after one
     untimed call that connects and, on PostgreSQL, creates the tables);
   - *pipelined*: then the burst's count (``--redis-count`` /
     ``--pg-count``) with ``park_many`` in chunks of ``--chunk``; only the
     ``park_many`` calls are timed (not building their arguments);
   - *memory per task*, around the pipelined parks: Redis ``INFO memory``
     ``used_memory`` after minus before, over the count (the whole server:
     others' keys and connections move it too), and the ``MEMORY USAGE ..
     SAMPLES 0`` of the store's keys over the count (the store's own);
     PostgreSQL ``pg_total_relation_size`` of the table (heap, TOAST and
     indexes; also ``pg_relation_size`` and ``pg_indexes_size``) after
     minus before, over the count; MySQL the table's ``data_length +
     index_length`` after ``ANALYZE TABLE`` (InnoDB's page counts);
     SQLite the file's pages (``page_count * page_size``). MySQL and SQLite
     take ``--pg-count`` and ``--pg-single``.
2. ``--instances`` real ``celery -A bench.bench_app beat -S
   celery_anarchon.Scheduler`` processes (``beat_schedule`` empty; Celery's
   broker is Redis database 1, ``ANARCHON_BENCH_DELAYED_BROKER`` to change;
   ``anarchon_backend`` the run's other prefix; ``anarchon_delayed_poll`` =
   ``--poll``), each with its releaser thread, and a reader draining the
   broker queue (``RPOP`` of up to 1,000 messages, a ``BRPOP`` of 0.2 s when
   the queue is empty, so a message is stamped at most one read after it
   arrived). The beats import this module (Celery's ``imports``), which
   registers the parked task, ``bench.delayed_parked(due_ms, seq)``, so the
   releasers publish it through its ``apply_async`` as they would a
   project's task.
3. The burst's tasks are parked again, the same way, on the beats' prefix,
   all due at ``T0`` (or spread evenly over ``--spread`` seconds from it):
   ``T0`` is 1.5 times the pipelined parks' time of step 1, plus
   ``--margin`` seconds, after this parking starts, so that it ends before
   ``T0`` while the releasers sleep (a run in which it did not says so: its
   burst overlapped the parking).
4. **Release burst**: from ``T0`` the beats release everything; tasks
   released per second from the first to the last message read, and from
   ``T0`` to the last; every task id must be read exactly once (duplicates,
   missing and unknown ids are counted); lateness (read time minus the due
   time carried in the task's first argument, the very ms the store
   holds), and how many were read before their due time (must be 0). In a
   burst the lateness is the queue of the burst itself. The release rate
   of each 10 s window too, and CPU seconds of each beat and of the servers
   over the burst; ``--profile DIR``: py-spy on the first beat over the
   burst (``python -m bench.profile DIR`` summarises it).
5. **Lateness at a rate the cluster keeps up with**: ``--late-count`` tasks
   parked beforehand, due evenly over ``--late-seconds`` seconds: lateness
   p50, p99, max, the early count and how many came later than 100 ms,
   against the goal p99 <= 100 ms + the poll bound (``--poll``,
   ``anarchon_delayed_poll``), and the CPU the beats and servers spent on
   it; per second of due time in the ``--json`` file.
6. **Push**: ``--push-count`` tasks parked one by one at ``--push-rate`` a
   second, each due at once, into a store with nothing else parked, while
   the releasers sleep (for the poll bound): their lateness shows whether
   ``park`` wakes a releaser (Redis pub/sub, PostgreSQL ``NOTIFY``) or the
   poll does.

Then ``--settle`` seconds more of reading, and the store must be empty (no
task left pending or in flight, so no take-over can publish one again
later). The beats' log lines at WARNING or above are counted.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis
from celery import Celery, shared_task

from . import common, runtime
from .arrivals import BATCH, Reader
from .burst import Config, claim_backend, clean_broker, stop_profile
from .common import log

#: The task every parked message names (registered in the beats by Celery's
#: ``imports`` of this module).
TASK = "bench.delayed_parked"

#: Celery's broker of the beats: Redis database 1 (its own queue per run).
BROKER_URL = os.environ.get("ANARCHON_BENCH_DELAYED_BROKER", "redis://127.0.0.1:6379/1")

#: A part's tasks are due this many times the time their parking took in
#: step 1 (at the rate of step 1) after their parking starts, plus
#: ``--margin``.
ESTIMATE_FACTOR = 1.5
#: Lateness goal of issue 17, on top of the poll bound, milliseconds.
GOAL_MS = 100.0
#: Release rate target of issue 17 for Redis with three instances, tasks/s.
RATE_TARGET = 10_000.0

BACKENDS = ("redis", "postgresql", "mysql", "sqlite")
#: What runs without ``--backend`` (MySQL and SQLite when asked for).
DEFAULT_BACKENDS = ("redis", "postgresql")


@shared_task(name=TASK)
def parked(due_ms: int, seq: int) -> None:
    """The parked task (nothing runs it: the benchmark reads the broker).

    Args:
        due_ms: its due time, epoch ms, as the store keeps it.
        seq: its number within its part.
    """


# -- parking ---------------------------------------------------------------------------


@contextmanager
def parking_app(backend_url: str, poll_s: float) -> Iterator[Celery]:
    """A Celery app whose ``anarchon_backend`` is ``backend_url``, to park
    with; its delayed store is closed afterwards."""
    from celery_anarchon import delayed

    app = Celery("bench-delayed", broker=BROKER_URL, set_as_current=False)
    app.conf.update(
        anarchon_backend=backend_url,
        anarchon_delayed_poll=poll_s,
        timezone="UTC",
        task_ignore_result=True,
    )
    try:
        yield app
    finally:
        delayed.store_for(app)[0].close()


def eta_at(due_ms: int) -> tuple[datetime, int]:
    """An aware eta near ``due_ms`` and the epoch ms ``park`` makes of it
    (``int(eta.timestamp() * 1000)``: the float round trip can lose a ms),
    which is the due time the store keeps and the message carries."""
    eta = datetime.fromtimestamp(due_ms / 1000, tz=timezone.utc)
    return eta, int(eta.timestamp() * 1000)


def park_single(app: Celery, count: int) -> dict[str, Any]:
    """``count`` calls of ``park`` in a loop, due in a day, each timed.

    Returns:
        ``calls``, ``seconds`` (the loop), ``per_s``, ``p50_us``, ``p99_us``.
    """
    from celery_anarchon import delayed

    eta, due = eta_at(int(time.time() * 1000) + 86_400_000)
    delayed.park(app, TASK, args=[due, -1], eta=eta)  # connects; creates the tables
    each: list[float] = []
    started = time.perf_counter()
    for i in range(count):
        begun = time.perf_counter()
        delayed.park(app, TASK, args=[due, i], eta=eta)
        each.append(time.perf_counter() - begun)
    seconds = time.perf_counter() - started
    return {
        "calls": count,
        "seconds": seconds,
        "per_s": count / seconds if seconds > 0 else None,
        "p50_us": common.percentile(each, 50) * 1e6 if each else None,
        "p99_us": common.percentile(each, 99) * 1e6 if each else None,
    }


def park_many(
    app: Celery, count: int, chunk: int, due_of: Callable[[int], int]
) -> tuple[list[str], list[int], float]:
    """Park ``count`` tasks with ``park_many`` in chunks of ``chunk``, task
    ``i`` due at ``due_of(i)`` (epoch ms).

    Returns:
        the ids and the due times (ms, as kept), in order, and the seconds
        the ``park_many`` calls took (building their arguments not counted).
    """
    from celery_anarchon import delayed

    ids: list[str] = []
    dues: list[int] = []
    spent = 0.0
    for start in range(0, count, chunk):
        calls = []
        for i in range(start, min(count, start + chunk)):
            eta, due = eta_at(due_of(i))
            calls.append({"task": TASK, "args": [due, i], "eta": eta})
            dues.append(due)
        begun = time.perf_counter()
        ids += delayed.park_many(app, calls)
        spent += time.perf_counter() - begun
    return ids, dues, spent


# -- memory ------------------------------------------------------------------------------


def redis_memory(store: Any) -> dict[str, int]:
    """``used_memory`` of the Redis server and the ``MEMORY USAGE`` (every
    element counted) of the store's keys, bytes: every key under one of its
    shards' hash tags (``store._tags``, whatever names the layout gives the
    keys under them)."""
    client = redis.Redis.from_url(common.REDIS_URL)
    try:
        used = int(client.info("memory")["used_memory"])
        keys = [key for tag in store._tags for key in client.scan_iter(match=f"{tag}:*")]
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.memory_usage(key, samples=0)
        own = sum(int(size or 0) for size in pipe.execute())
        return {"used_memory": used, "keys": own}
    finally:
        client.close()


def postgres_memory(store: Any) -> dict[str, int]:
    """``pg_total_relation_size`` (heap, TOAST, indexes), ``pg_relation_size``
    (heap) and ``pg_indexes_size`` of the store's table, bytes."""
    import sqlalchemy as sa

    name = '"' + store.backend.prefix + 'delayed"'
    query = sa.text(
        "SELECT pg_total_relation_size(c), pg_relation_size(c), pg_indexes_size(c) "
        "FROM to_regclass(:name) AS c"
    )
    engine = sa.create_engine(common._sa_url(common.POSTGRES_URL))
    try:
        with engine.connect() as conn:
            total, heap, indexes = conn.execute(query, {"name": name}).one()
    finally:
        engine.dispose()
    return {"total": int(total or 0), "heap": int(heap or 0), "indexes": int(indexes or 0)}


def mysql_memory(store: Any) -> dict[str, int]:
    """``data_length + index_length`` of the store's table (after ``ANALYZE
    TABLE``, so InnoDB's page counts are fresh), ``data_length`` (heap) and
    ``index_length``, bytes."""
    import sqlalchemy as sa

    name = store.backend.prefix + "delayed"
    with store.backend._write("analyze the delayed table") as conn:
        conn.execute(sa.text(f"ANALYZE TABLE `{name}`")).all()
        heap, indexes = conn.execute(
            sa.text(
                "SELECT data_length, index_length FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name = :name"
            ),
            {"name": name},
        ).one()
    return {"total": int(heap) + int(indexes), "heap": int(heap), "indexes": int(indexes)}


def sqlite_memory(store: Any) -> dict[str, int]:
    """The SQLite file's pages, bytes (the whole file: the claims' tables
    too, which do not grow while parking)."""
    with store.backend._read("count the file's pages") as conn:
        pages = int(conn.exec_driver_sql("PRAGMA page_count").scalar_one())
        size = int(conn.exec_driver_sql("PRAGMA page_size").scalar_one())
    return {"total": pages * size}


def memory(kind: str, store: Any) -> dict[str, int]:
    found = {
        "redis": redis_memory,
        "postgresql": postgres_memory,
        "mysql": mysql_memory,
        "sqlite": sqlite_memory,
    }[kind]
    return found(store)


def per_task(before: dict[str, int], after: dict[str, int], count: int) -> dict[str, float]:
    """Bytes per task of each figure: after minus before, over ``count``."""
    return {k: (after[k] - before[k]) / count for k in after} if count else {}


# -- the beats and the reader ------------------------------------------------------------------


@dataclass
class DelayedBeat(runtime.Beat):
    """A real ``celery beat`` whose only work is its releaser: no job, the
    parked task registered, Celery's broker :data:`BROKER_URL`, its
    default queue ``queue``, ``anarchon_delayed_poll`` = ``poll_s``."""

    queue: str = ""
    poll_s: float = 2.0

    def start(self) -> None:
        self.ready_dir.mkdir(exist_ok=True)
        conf = {
            "beat_schedule": {},
            "worker_log_format": runtime.LOG_FORMAT,
            "imports": ["bench.delayed"],
            "anarchon_delayed_poll": self.poll_s,
        }
        env = {
            **os.environ,
            "BENCH_KIND": "anarchon",
            "BENCH_BROKER": BROKER_URL,
            "BENCH_QUEUE": self.queue,
            "BENCH_JOBS": "0",
            "BENCH_BACKEND": self.backend_url,
            "BENCH_CONF": json.dumps(conf),
            "BENCH_READY_DIR": str(self.ready_dir),
            "PYTHONPATH": str(self.checkout),
        }
        command = [sys.executable, "-m", "celery", "-A", "bench.bench_app", "beat"]
        command += ["-S", "celery_anarchon.Scheduler", "-l", self.level]
        command += ["-s", str(self.folder / f"{self.name}-schedule")]
        with open(self.logfile, "wb") as out:
            self.launched = time.time()
            self.proc = subprocess.Popen(
                command, cwd=self.folder, env=env, stdout=out, stderr=subprocess.STDOUT
            )


def beats_for(url: str, folder: Path, queue: str, args: argparse.Namespace) -> list[DelayedBeat]:
    return [
        DelayedBeat(f"beat-{i}", url, folder, queue=queue, poll_s=args.poll)
        for i in range(args.instances)
    ]


class Drain(Reader):
    """Drains the Redis list of the queue (kombu's Redis transport
    ``LPUSH``-es): ``RPOP`` of up to :data:`~bench.arrivals.BATCH` messages,
    and a ``BRPOP`` of 0.2 s when it is empty, so a message is stamped at
    most one read after it arrived. ``batches`` holds ``(read time, raw
    messages)``; parsed only after the run."""

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                if self.read_once():
                    continue
                generation = self._generation
                got = self.client.brpop([self.queue], timeout=0.2)
                if got:
                    self._keep(time.time(), [got[1]], generation)
        except BaseException as exc:  # reported by the benchmark
            self.error = exc

    #: reads that took a full batch: the queue held that many or more, so
    #: the reader was behind by at least :data:`~bench.arrivals.BATCH`
    full_reads = 0

    def read_once(self) -> int:
        generation = self._generation
        items = self.client.rpop(self.queue, BATCH)
        if not items:
            return 0
        self._keep(time.time(), list(items), generation)
        self.full_reads += len(items) >= BATCH
        return len(items)

    def arrivals(self) -> Iterator[tuple[float, str, int]]:
        """``(read time, task id, due ms)`` of every message read: the id
        from the Celery headers, the due time from the task's first
        argument (the body: base64 of Celery's JSON ``[args, kwargs,
        embed]``)."""
        for at, items in self.batches:
            for raw in items:
                envelope = json.loads(raw)
                body = envelope["body"]
                if envelope.get("properties", {}).get("body_encoding") == "base64":
                    body = base64.b64decode(body)
                args = json.loads(body)[0]
                yield at, str(envelope["headers"]["id"]), int(args[0])


def wait_for(reader: Drain, total: int, last_due_s: float, stall_s: float, beats: Any) -> bool:
    """Until the reader has read ``total`` messages, or nothing new came for
    ``stall_s`` seconds once ``last_due_s`` (epoch s) passed; True when all
    came.

    Raises:
        RuntimeError: the reader failed or a beat exited.
    """
    seen, since = reader.count, time.monotonic()
    while reader.count < total:
        if reader.error is not None:
            raise RuntimeError(f"the reader failed: {reader.error!r}")
        for beat in beats:
            beat.check_alive()
        time.sleep(0.05)
        if reader.count != seen:
            seen, since = reader.count, time.monotonic()
        elif time.time() > last_due_s + stall_s and time.monotonic() - since > stall_s:
            log(f"  stalled at {reader.count:,} of {total:,} messages for {stall_s:g} s")
            return False
    return True


def sleep_until(epoch_s: float) -> None:
    time.sleep(max(0.0, epoch_s - time.time()))


# -- analysis -------------------------------------------------------------------------------


def by_due_second(first_reads: Sequence[tuple[int, float]], start_ms: int) -> list[list[float]]:
    """Per second of due time from ``start_ms``: ``[second, tasks, p50 ms,
    p99 ms, max ms]`` of the lateness of each id's first read, from
    ``(due ms, lateness ms)`` pairs."""
    seconds: dict[int, list[float]] = {}
    for due, ms in first_reads:
        seconds.setdefault((due - start_ms) // 1000, []).append(ms)
    return [
        [
            second,
            len(late),
            round(common.percentile(late, 50), 1),
            round(common.percentile(late, 99), 1),
            round(max(late), 1),
        ]
        for second, late in sorted(seconds.items())
    ]


def analyse(
    arrivals: Sequence[tuple[float, str, int]], ids: Sequence[str], start_ms: int
) -> dict[str, Any]:
    """The figures of one part from its messages ``(read s, id, due ms)``.

    Returns:
        ``parked``, ``read``, ``duplicates`` (reads beyond the first of an
        id), ``missing`` (ids never read), ``early`` (reads before the due
        time), lateness ms of each id's first read (``p50_ms``, ``p99_ms``,
        ``max_ms``, ``min_ms``, ``over_100ms``, and ``by_due_second``),
        ``first_s`` and ``last_s`` (first and last read, seconds after
        ``start_ms``), ``rate`` (reads per second from the first to the
        last), ``rate_from_start`` (from ``start_ms``), ``per_10s`` (reads
        in each 10 s from the first) and the ``slowest_10s`` and
        ``fastest_10s`` rates of its full windows.
    """
    reads = Counter(task_id for _, task_id, _ in arrivals)
    firsts: dict[str, float] = {}
    late: list[float] = []
    first_reads: list[tuple[int, float]] = []
    early = 0
    for at, task_id, due in sorted(arrivals):
        ms = at * 1000 - due
        early += ms < 0
        if task_id not in firsts:
            firsts[task_id] = at
            late.append(ms)
            first_reads.append((due, ms))
    times = [at for at, _, _ in arrivals]
    first, last = (min(times), max(times)) if times else (None, None)
    bins = Counter(int((at - first) // 10) for at in times) if first is not None else Counter()
    full = [bins[i] / 10 for i in range(max(bins, default=0))]  # the last is partial
    span = (last - first) if first is not None and last is not None else 0.0
    return {
        "parked": len(ids),
        "read": len(arrivals),
        "duplicates": sum(n - 1 for n in reads.values() if n > 1),
        "missing": sum(1 for i in ids if i not in reads),
        "early": early,
        "p50_ms": common.percentile(late, 50) if late else None,
        "p99_ms": common.percentile(late, 99) if late else None,
        "max_ms": max(late) if late else None,
        "min_ms": min(late) if late else None,
        "over_100ms": sum(1 for ms in late if ms > 100),
        "slowest_10s": min(full) if full else None,
        "fastest_10s": max(full) if full else None,
        "per_10s": [bins[i] for i in range(max(bins, default=-1) + 1)],
        "by_due_second": by_due_second(first_reads, start_ms),
        "first_s": None if first is None else first - start_ms / 1000,
        "last_s": None if last is None else last - start_ms / 1000,
        "rate": (len(arrivals) - 1) / span if span > 0 else None,
        "rate_from_start": (
            len(arrivals) / (last - start_ms / 1000)
            if last is not None and last > start_ms / 1000
            else None
        ),
    }


# -- one backend ----------------------------------------------------------------------------


@dataclass
class Run:
    """One backend's run: the parking app and store, the beats, the reader,
    and the ids each part parked with the ms its figures count from."""

    args: argparse.Namespace
    kind: str
    app: Celery
    store: Any
    beats: list[DelayedBeat]
    reader: Drain
    park_rate: float
    phases: dict[str, list[str]] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)

    @property
    def expected(self) -> int:
        """Messages every part so far should have put on the queue."""
        return sum(len(ids) for ids in self.phases.values())

    def due_after(self, count: int) -> int:
        """A due time (epoch ms) by which ``count`` tasks parked from now on
        are parked: at step 1's pipelined rate, :data:`ESTIMATE_FACTOR`
        times, plus ``--margin``."""
        ahead = ESTIMATE_FACTOR * count / self.park_rate + self.args.margin
        return int((time.time() + ahead) * 1000)

    def wait(self, last_due_ms: int) -> bool:
        return wait_for(self.reader, self.expected, last_due_ms / 1000, self.args.stall, self.beats)


def cpu_now(beats: Sequence[DelayedBeat]) -> dict[str, dict[str, float]]:
    """CPU seconds so far of each beat, of each local server and of this
    process (the reader's thread, and the parks)."""
    return {
        "beats": {b.name: common.cpu_seconds_exact(b.pid) for b in beats},
        "servers": common.server_cpu_seconds(),
        "bench": {"reader and parker": common.cpu_seconds_exact(os.getpid())},
    }


def cpu_since(before: dict[str, dict[str, float]], beats: Sequence[DelayedBeat]) -> dict[str, Any]:
    """CPU seconds of each beat, server and this process since ``before``
    (:func:`cpu_now`); a server's at least 0 (a process of it that exited
    in between, another client's connection, takes its CPU with it)."""
    now = cpu_now(beats)
    return {
        group: {n: max(0.0, now[group][n] - before[group].get(n, 0.0)) for n in now[group]}
        for group in now
    }


def measure(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """Every part on one backend (module docstring); an error is reported
    in the result, and the clean-up runs."""
    from celery_anarchon import delayed

    count = args.redis_count if kind == "redis" else args.pg_count
    result: dict[str, Any] = {"backend": kind, "count": count, "load_before": os.getloadavg()}
    folder = Path(tempfile.mkdtemp(prefix="anarchon-bench-delayed-"))
    queue = f"bench-{common.RUN_ID}-delayed-{kind[:2]}"
    broker = redis.Redis.from_url(BROKER_URL)
    beats: list[DelayedBeat] = []
    try:
        with ExitStack() as stack:
            cfg = Config("anarchon", kind)
            url = stack.enter_context(claim_backend(cfg, f"{common.RUN_ID}-dl{kind[:2]}"))
            single_url = stack.enter_context(claim_backend(cfg, f"{common.RUN_ID}-ds{kind[:2]}"))
            assert url is not None and single_url is not None
            single_app = stack.enter_context(parking_app(single_url, args.poll))
            app = stack.enter_context(parking_app(url, args.poll))
            park_rate = park_part(args, kind, single_app, count, result)

            stack.callback(clean_broker, broker, queue)  # after the beats stopped
            beats = beats_for(url, folder, queue, args)
            stack.enter_context(runtime.running(beats))
            runtime.wait_ready(beats, timeout=180)
            delayed.count(app)  # the tables exist (the releasers made them, or now)
            reader = Drain(BROKER_URL, queue)
            reader.start()
            stack.callback(_stop_reader, reader)
            run = Run(args, kind, app, delayed.store_for(app)[0], beats, reader, park_rate)

            burst_part(run, count, result)
            if args.late_count:
                lateness_part(run, result)
            if args.push_count:
                push_part(run)
            time.sleep(args.settle)
            reader.finish(quiet_s=0.5)
            result["left_in_store"] = delayed.count(app)
            result.update(classify(reader, run.phases, run.starts))
        # after the beats stopped: their last lines count too
        result["problems"] = runtime.problems(beats)
    except Exception as exc:  # reported; the other backend goes on
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{kind}: {result['error'][:2000]}")
    finally:
        broker.close()
        shutil.rmtree(folder, ignore_errors=True)
    result["load_after"] = os.getloadavg()
    return result


def park_part(
    args: argparse.Namespace, kind: str, app: Celery, count: int, result: dict[str, Any]
) -> float:
    """Step 1 on the prefix no beat releases: the single parks, then the
    pipelined ones with the memory around them; returns the pipelined
    rate, tasks per second."""
    from celery_anarchon import delayed

    singles = args.redis_single if kind == "redis" else args.pg_single
    log(f"{kind}: {singles:,} single parks")
    result["single"] = park_single(app, singles)
    log(f"  {result['single']['per_s'] or 0:,.0f} parks/s")
    store = delayed.store_for(app)[0]
    log(f"{kind}: {count:,} parks with park_many")
    before = memory(kind, store)
    begun = time.time()
    ids, _, spent = park_many(app, count, args.chunk, lambda i: _far_ms())
    wall = time.time() - begun
    after = memory(kind, store)
    result["many"] = {
        "tasks": count,
        "chunk": args.chunk,
        "seconds": spent,
        "per_s": count / spent if spent > 0 else None,
        "wall_s": wall,
    }
    result["memory_before"], result["memory_after"] = before, after
    result["memory_per_task"] = per_task(before, after, count)
    result["stored_count"] = delayed.count(app) - singles - 1
    one = store.get(ids[0])
    result["payload_bytes"] = None if one is None else len(one.payload.encode())
    log(
        f"  {result['many']['per_s'] or 0:,.0f} tasks/s; "
        f"{json.dumps(result['memory_per_task'])} bytes per task"
    )
    return count / spent if spent > 0 else 1e6


def burst_part(run: Run, count: int, result: dict[str, Any]) -> None:
    """Steps 3 and 4: park the burst again, on the beats' prefix, due at
    ``T0``; then wait for its release."""
    args, kind = run.args, run.kind
    begun = time.time()
    t0_ms = run.due_after(count)
    spread_ms = int(args.spread * 1000)
    log(f"{kind}: parking {count:,} again, due at T0 in {t0_ms / 1000 - begun:.1f} s")
    ids, _, spent = park_many(
        run.app, count, args.chunk, lambda i: t0_ms + (i * spread_ms) // count
    )
    parked_at = time.time()
    result["burst_park"] = {
        "per_s": count / spent if spent > 0 else None,
        "ended_before_t0_s": t0_ms / 1000 - parked_at,
    }
    log(
        f"  {result['burst_park']['per_s'] or 0:,.0f} tasks/s; parking ended "
        f"{result['burst_park']['ended_before_t0_s']:.1f} s before T0"
    )
    run.phases["burst"], run.starts["burst"] = ids, t0_ms

    sleep_until(t0_ms / 1000 - 0.5)
    cpu = cpu_now(run.beats)
    load, full_reads = os.getloadavg(), run.reader.full_reads
    spy = start_spy(run.beats[0].pid, Path(args.profile), kind, count) if args.profile else None
    try:
        sleep_until(t0_ms / 1000)
        log(f"{kind}: T0, releasing {count:,}")
        complete = run.wait(t0_ms + spread_ms)
        ended = time.time()
    finally:
        if spy is not None:
            stop_profile(spy)
    result["burst_run"] = {
        "complete": complete,
        "spread_s": args.spread,
        "load_at_start": load,
        "load_at_end": os.getloadavg(),
        "seconds": ended - t0_ms / 1000,
        "cpu_s": cpu_since(cpu, run.beats),
        "full_reads": run.reader.full_reads - full_reads,
    }
    log(f"  read {run.reader.count:,} of {run.expected:,} in {ended - t0_ms / 1000:.1f} s")


def lateness_part(run: Run, result: dict[str, Any]) -> None:
    """Step 5: ``--late-count`` tasks parked, then due evenly over
    ``--late-seconds``; wait for them."""
    args = run.args
    late_ms = int(args.late_seconds * 1000)
    t1_ms = run.due_after(args.late_count)
    log(
        f"{run.kind}: lateness, {args.late_count:,} due over {args.late_seconds:g} s "
        f"from {t1_ms / 1000 - time.time():.1f} s on"
    )
    ids, _, _ = park_many(
        run.app, args.late_count, args.chunk, lambda i: t1_ms + (i * late_ms) // args.late_count
    )
    run.phases["lateness"], run.starts["lateness"] = ids, t1_ms
    sleep_until(t1_ms / 1000 - 0.2)
    cpu = cpu_now(run.beats)
    load = os.getloadavg()
    run.wait(t1_ms + late_ms)
    result["lateness_run"] = {
        "load_at_start": load,
        "load_at_end": os.getloadavg(),
        "cpu_s": cpu_since(cpu, run.beats),
    }


def push_part(run: Run) -> None:
    """Step 6: ``--push-count`` parks, one at a time at ``--push-rate``,
    each due at once, while the releasers sleep; wait for them."""
    from celery_anarchon import delayed

    args = run.args
    log(f"{run.kind}: push, {args.push_count} parks at {args.push_rate:g}/s, due at once")
    time.sleep(max(1.0, args.poll / 2))  # the releasers are asleep
    ids: list[str] = []
    run.phases["push"] = ids
    begun = time.time()
    run.starts["push"] = int(begun * 1000)
    for i in range(args.push_count):
        sleep_until(begun + i / args.push_rate)
        eta, due = eta_at(int(time.time() * 1000))
        ids.append(delayed.park(run.app, TASK, args=[due, i], eta=eta))
    run.wait(int(time.time() * 1000))


def _far_ms() -> int:
    """A due time no run reaches: in a day."""
    return int(time.time() * 1000) + 86_400_000


def _stop_reader(reader: Drain) -> None:
    if reader.is_alive():
        reader.halt.set()
        reader.join(5)
    reader.close()


def classify(reader: Drain, phases: dict[str, list[str]], starts: dict[str, int]) -> dict[str, Any]:
    """Each message read counted for the part that parked its id; the
    figures of each part, and how many read messages no part parked."""
    part_of = {task_id: name for name, ids in phases.items() for task_id in ids}
    by_part: dict[str, list[tuple[float, str, int]]] = {name: [] for name in phases}
    unknown = 0
    for arrival in reader.arrivals():
        name = part_of.get(arrival[1])
        if name is None:
            unknown += 1
        else:
            by_part[name].append(arrival)
    found: dict[str, Any] = {"unknown_messages": unknown}
    for name, ids in phases.items():
        found[name] = analyse(by_part[name], ids, starts[name])
    return found


def start_spy(pid: int, folder: Path, kind: str, count: int) -> subprocess.Popen[bytes] | None:
    """py-spy on beat ``pid`` over the burst (raw stacks, idle frames)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        log("py-spy not found: pip install py-spy (no profile taken)")
        return None
    folder.mkdir(parents=True, exist_ok=True)
    command = [spy, "record", "--pid", str(pid), "--rate", "100", "--format", "raw", "--idle"]
    command += ["--nonblocking", "--duration", str(max(5, min(600, count // 1000 + 30)))]
    command += ["--output", str(folder / f"delayed-{kind}-beat-0.txt")]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# -- report -------------------------------------------------------------------------------------


def _n(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _met(ok: bool | None) -> str:
    return "-" if ok is None else "met" if ok else "**NOT met**"


def rows_of(r: dict[str, Any], args: argparse.Namespace) -> dict[str, str]:
    """The report's figures of one backend, by row label."""
    if "error" in r and "burst" not in r:
        return {"error": r["error"][:200]}
    goal = GOAL_MS + args.poll * 1000
    kind = r["backend"]
    m = r.get("memory_per_task", {})
    single, many = r.get("single", {}), r.get("many", {})
    burst, late, push = r.get("burst", {}), r.get("lateness", {}), r.get("push", {})
    run, lrun = r.get("burst_run", {}), r.get("lateness_run", {})
    rows: dict[str, str] = {
        "tasks parked (burst)": _n(r["count"]),
        "payload of one task (bytes)": _n(r.get("payload_bytes")),
    }
    if kind == "redis":
        rows["memory per task, whole (bytes)"] = f"{_n(m.get('used_memory'))} (used_memory)"
        rows["memory per task, the store's own (bytes)"] = (
            f"{_n(m.get('keys'))} (MEMORY USAGE of its keys)"
        )
    elif kind == "sqlite":
        rows["memory per task, whole (bytes)"] = f"{_n(m.get('total'))} (the file's pages)"
    else:
        what = "total relation size" if kind == "postgresql" else "data + index length"
        rows["memory per task, whole (bytes)"] = f"{_n(m.get('total'))} ({what})"
        rows["memory per task, the store's own (bytes)"] = (
            f"{_n(m.get('heap'))} heap + {_n(m.get('indexes'))} indexes"
        )
    rows.update(
        {
            "park, single calls": f"{_n(single.get('calls'))} calls",
            "park, single (calls/s)": _n(single.get("per_s")),
            "park, single, p50 / p99 per call (µs)": (
                f"{_n(single.get('p50_us'))} / {_n(single.get('p99_us'))}"
            ),
            "park_many, chunks of": _n(many.get("chunk")),
            "park_many (tasks/s)": _n(many.get("per_s")),
            "burst: parked again (tasks/s), ended before T0 (s)": (
                f"{_n(r.get('burst_park', {}).get('per_s'))}, "
                f"{_n(r.get('burst_park', {}).get('ended_before_t0_s'), 1)}"
            ),
            "burst: instances": str(args.instances),
            "burst: read / duplicates / missing": (
                f"{_n(burst.get('read'))} / {_n(burst.get('duplicates'))} / "
                f"{_n(burst.get('missing'))}"
            ),
            "burst: released before due": _n(burst.get("early")),
            "burst: first / last message after T0 (s)": (
                f"{_n(burst.get('first_s'), 2)} / {_n(burst.get('last_s'), 2)}"
            ),
            "burst: release rate, first to last message (tasks/s)": _n(burst.get("rate")),
            "burst: release rate, slowest / fastest 10 s (tasks/s)": (
                f"{_n(burst.get('slowest_10s'))} / {_n(burst.get('fastest_10s'))}"
            ),
            "burst: release rate, T0 to last message (tasks/s)": _n(burst.get("rate_from_start")),
            "burst: lateness p50 / p99 / max (s)": (
                f"{_n(_s(burst.get('p50_ms')), 2)} / {_n(_s(burst.get('p99_ms')), 2)} / "
                f"{_n(_s(burst.get('max_ms')), 2)}"
            ),
            "burst: CPU s of each beat": _cpu_beats(run),
            "burst: beats' CPU per task released (µs)": _n(_per_task_us(run, burst.get("read"))),
            "burst: CPU s of redis / postgresql / the benchmark": (
                f"{_cpu_servers(run)} / "
                f"{_n(sum(run.get('cpu_s', {}).get('bench', {}).values()), 1)}"
            ),
            "burst: reads that found 1,000 or more waiting": _n(run.get("full_reads")),
            "burst: load (1 min) at T0 / at the end": (
                f"{_load(run.get('load_at_start'))} / {_load(run.get('load_at_end'))}"
            ),
        }
    )
    rate = burst.get("rate")
    if kind == "redis":
        rows[f"target: release >= {RATE_TARGET:,.0f}/s"] = _met(
            None if rate is None else rate >= RATE_TARGET
        )
    else:
        rows[f"target: release >= {RATE_TARGET:,.0f}/s"] = "(Redis's target)"
    if late:
        rows.update(
            {
                "lateness: tasks, due evenly over": (
                    f"{_n(late.get('parked'))} over {args.late_seconds:g} s"
                ),
                "lateness: read / duplicates / missing": (
                    f"{_n(late.get('read'))} / {_n(late.get('duplicates'))} / "
                    f"{_n(late.get('missing'))}"
                ),
                "lateness: released before due": _n(late.get("early")),
                "lateness: later than 100 ms": _n(late.get("over_100ms")),
                "lateness: CPU s of the beats / redis / postgresql": (
                    f"{_n(sum(lrun.get('cpu_s', {}).get('beats', {}).values()), 1)} / "
                    f"{_cpu_servers(lrun)}"
                ),
                "lateness: p50 / p99 / max (ms)": (
                    f"{_n(late.get('p50_ms'))} / {_n(late.get('p99_ms'))} / "
                    f"{_n(late.get('max_ms'))}"
                ),
                f"goal: p99 <= {GOAL_MS:g} ms + poll {args.poll:g} s = {goal:,.0f} ms": _met(
                    None if late.get("p99_ms") is None else late["p99_ms"] <= goal
                ),
                f"p99 <= {GOAL_MS:g} ms (without the poll bound)": _met(
                    None if late.get("p99_ms") is None else late["p99_ms"] <= GOAL_MS
                ),
            }
        )
    if push:
        rows.update(
            {
                "push: parks due at once, into an empty store": (
                    f"{_n(push.get('parked'))} at {args.push_rate:g}/s"
                ),
                "push: read / duplicates / missing / early": (
                    f"{_n(push.get('read'))} / {_n(push.get('duplicates'))} / "
                    f"{_n(push.get('missing'))} / {_n(push.get('early'))}"
                ),
                "push: lateness p50 / p99 / max (ms)": (
                    f"{_n(push.get('p50_ms'))} / {_n(push.get('p99_ms'))} / "
                    f"{_n(push.get('max_ms'))}"
                ),
            }
        )
    rows.update(
        {
            "messages no part parked": _n(r.get("unknown_messages")),
            "left in the store at the end": _n(r.get("left_in_store")),
            "beat log lines at WARNING or above": _n(len(r.get("problems", []))),
            "load (1 min) before / after the backend's run": (
                f"{_load(r.get('load_before'))} / {_load(r.get('load_after'))}"
            ),
        }
    )
    if "error" in r:
        rows["error"] = r["error"][:200]
    return rows


def _cpu_beats(run: dict[str, Any]) -> str:
    beats = run.get("cpu_s", {}).get("beats", {})
    return ", ".join(_n(v, 1) for v in beats.values()) or "-"


def _cpu_servers(run: dict[str, Any]) -> str:
    servers = run.get("cpu_s", {}).get("servers", {})
    return f"{_n(servers.get('redis'), 1)} / {_n(servers.get('postgresql'), 1)}"


def _per_task_us(run: dict[str, Any], tasks: int | None) -> float | None:
    beats = run.get("cpu_s", {}).get("beats", {})
    return sum(beats.values()) / tasks * 1e6 if beats and tasks else None


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _load(value: Any) -> str:
    return "-" if not value else f"{value[0]:.2f}"


def report(results: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    columns = [rows_of(r, args) for r in results]
    labels: list[str] = []
    for column in columns:
        labels += [label for label in column if label not in labels]
    names = {"redis": "Redis", "postgresql": "PostgreSQL", "mysql": "MariaDB", "sqlite": "SQLite"}
    headers = ["figure", *(names[r["backend"]] for r in results)]
    rows = [[label, *(c.get(label, "-") for c in columns)] for label in labels]
    lines = [
        f"Delayed tasks: {args.instances} beat instance(s), anarchon_delayed_poll "
        f"{args.poll:g} s; lateness = read time on the broker queue minus the due time "
        "(the task's first argument).",
        "",
        common.table(headers, rows),
    ]
    for r in results:
        for problem in sorted(set(r.get("problems", [])))[:10]:
            lines.append(f"- {r['backend']}: {problem[:300]}")
    return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.delayed", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--redis-count", type=int, default=1_000_000, help="tasks in the burst")
    parser.add_argument(
        "--pg-count", type=int, default=100_000, help="tasks in the burst (also MySQL, SQLite)"
    )
    parser.add_argument("--redis-single", type=int, default=20_000, help="single park calls")
    parser.add_argument("--pg-single", type=int, default=2_000, help="single park calls")
    parser.add_argument("--chunk", type=int, default=1000, help="tasks per park_many call")
    parser.add_argument("--instances", type=int, default=3, help="beats releasing")
    parser.add_argument("--spread", type=float, default=0.0, help="burst due over s from T0")
    parser.add_argument("--late-count", type=int, default=20_000, help="lateness tasks (0: none)")
    parser.add_argument("--late-seconds", type=float, default=20.0, help="due evenly over, s")
    parser.add_argument("--push-count", type=int, default=200, help="push parks (0: none)")
    parser.add_argument("--push-rate", type=float, default=20.0, help="push parks per second")
    parser.add_argument("--poll", type=float, default=2.0, help="anarchon_delayed_poll, s")
    parser.add_argument("--margin", type=float, default=5.0, help="s between parking and due")
    parser.add_argument("--stall", type=float, default=30.0, help="give up after s of nothing")
    parser.add_argument("--settle", type=float, default=3.0, help="s of reading at the end")
    parser.add_argument(
        "--backend",
        default=",".join(DEFAULT_BACKENDS),
        help="some of redis, postgresql, mysql, sqlite (default redis,postgresql)",
    )
    parser.add_argument("--profile", help="folder for a py-spy profile of a beat in the burst")
    parser.add_argument("--tiny", action="store_true", help="a few seconds, for the test suite")
    parser.add_argument("--json", help="write raw results to this file")
    args = parser.parse_args(argv)
    if args.tiny:
        args.redis_count = args.pg_count = 200
        args.redis_single = args.pg_single = 50
        args.late_count, args.late_seconds = 200, 2.0
        args.push_count, args.push_rate = 10, 10.0
        args.margin, args.stall, args.settle = 1.0, 15.0, 1.0
    if min(args.redis_count, args.pg_count, args.chunk, args.instances) < 1:
        parser.error("--redis-count, --pg-count, --chunk and --instances must be at least 1")
    if args.push_count and args.push_rate <= 0 or args.late_seconds <= 0 or args.poll <= 0:
        parser.error("--push-rate, --late-seconds and --poll must be above 0")
    backends = []
    for backend in (b.strip() for b in args.backend.split(",") if b.strip()):
        if backend not in BACKENDS:
            parser.error(f"--backend {backend}: use {', '.join(BACKENDS)}")
        if common.service_up(common.BACKEND_SERVICE[backend]):
            backends.append(backend)
        else:
            log(f"{backend} is not running on 127.0.0.1: skipped")
    if not common.service_up("redis"):
        log("this benchmark needs Redis on 127.0.0.1:6379 (Celery's broker)")
        return 2
    common.exit_on_sigterm()
    print(common.header("Delayed tasks"))
    started = time.time()
    results = [measure(args, backend) for backend in backends]
    print(report(results, args))
    print(
        f"\nRun took {time.time() - started:.0f} s; load (1 min, 5 min, 15 min) at the end: "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}."
    )
    common.write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
