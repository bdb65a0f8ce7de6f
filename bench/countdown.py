"""Celery's native countdown against parking (issue 18), with real ``celery
worker`` processes and real brokers.

    python -m bench.countdown [--only rss|redelivery|consumer-timeout]
        [--rss-count 100000] [--rss-countdown 3600] [--concurrency 2]
        [--take-timeout 900] [--settle 10]
        [--redelivery-count 20] [--visibility-timeout 10]
        [--redelivery-countdown 240] [--restore-interval S]
        [--restore-throttle N] [--redelivery-grace S]
        [--ct-countdown 2700] [--consumer-timeout 60] [--ct-grace S]
        [--ct-port 5680] [--ct-dist-port 25680]
        [--quick] [--keep DIR] [--json PATH]

Every part sends the same task both ways, side by side in one run:
*native* (``apply_async(countdown=...)``, held by the worker) and *ours*
(``celery_anarchon.delayed.park(..., countdown=...)``, released by a real
``celery beat -S celery_anarchon.Scheduler``, run by a worker with
``celery_anarchon.worker.install``). The task, ``bench.countdown_run(tag,
seq)``, counts each execution (``HINCRBY``) and logs it (time, pid,
``redelivered`` flag) in Redis. The workers and beat run this module as
their app (``celery -A bench.countdown``), configured by the ``BENCH_CD_*``
environment variables the benchmark sets.

Redis: database 13 (``ANARCHON_BENCH_COUNTDOWN_REDIS``) holds the Redis
broker (every kombu key under ``cd-<run>-broker:``, kombu's
``global_keyprefix``), the parked tasks (``anarchon_backend`` prefix
``cd-<run>:``) and the records (``<run>:...``); every key naming the run is
deleted at the end of each part.

1. ``rss``: two fresh prefork workers (``--concurrency`` children each) on a
   Redis broker, one per queue. Baseline memory of each (main process plus
   children: ``VmRSS`` summed, and ``Pss`` from ``smaps_rollup``, which
   counts a shared page once). Then ``--rss-count`` ``apply_async(countdown=
   --rss-countdown)`` to the first; how long until the worker has taken them
   all (the queue empty, kombu's ``unacked`` hash holding every one), and
   its memory then. Then as many ``park_many`` (chunks of 1,000) with the
   same countdown; the second worker's memory after ``--settle`` s. Nothing
   comes due during the part, so no beat runs in it.
2. ``redelivery``: Redis broker with ``visibility_timeout`` =
   ``--visibility-timeout`` (and kombu's restore sweep, every
   ``unacked_restore_interval`` x ``unacked_restore_throttle`` s, 10 x 10
   by default), ``--redelivery-count`` tasks with ``countdown`` =
   ``--redelivery-countdown`` each way; executions per task after the
   countdown plus ``--redelivery-grace`` s.
3. ``consumer-timeout``: a RabbitMQ node of the benchmark's own (``rabbitmq-
   server`` on ``--ct-port``, node ``bench-ct-<run>@localhost``, data under
   a temporary folder deleted at the end) with ``consumer_timeout`` =
   ``--consumer-timeout`` s; one task with ``countdown`` = ``--ct-countdown``
   each way (ours parked on Redis, released to that node). The native
   worker is restarted whenever it exits, as a supervisor would. Counted
   until the countdown plus ``--ct-grace`` s: channel closes
   (``PRECONDITION_FAILED`` in the worker's log, timeouts in the node's),
   deliveries (the worker's ``received`` lines), worker exits, executions
   and when they ran.

``--quick`` makes every part small enough for a smoke test (the consumer-
timeout part still takes four minutes: 150 s countdown, 30 s timeout).
``--keep DIR`` keeps every process's log under ``DIR/<part>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery, Task

from . import common
from .common import log

#: The task both ways send.
TASK = "bench.countdown_run"

#: The benchmark's own Redis database (broker, parked tasks, records).
REDIS_URL = os.environ.get("ANARCHON_BENCH_COUNTDOWN_REDIS", "redis://127.0.0.1:6379/13")

#: rabbitmq-server and rabbitmqctl themselves (not the Debian wrappers in
#: /usr/sbin, which switch to the ``rabbitmq`` user).
RABBIT_BIN = Path(os.environ.get("ANARCHON_BENCH_RABBIT_BIN", "/usr/lib/rabbitmq/bin"))

PARTS = ("rss", "redelivery", "consumer-timeout")


# -- the app the workers and beat run ------------------------------------------------


def _worker_conf() -> dict[str, Any]:
    """``app.conf`` of the worker and beat processes, from ``BENCH_CD_*``."""
    options: dict[str, Any] = {}
    for name in ("visibility_timeout", "unacked_restore_interval", "unacked_restore_throttle"):
        value = os.environ.get(f"BENCH_CD_{name.upper()}")
        if value:
            options[name] = float(value) if name == "visibility_timeout" else int(value)
    if os.environ.get("BENCH_CD_KEYPREFIX"):
        options["global_keyprefix"] = os.environ["BENCH_CD_KEYPREFIX"]
    return {
        "broker_url": os.environ.get("BENCH_CD_BROKER", REDIS_URL),
        "task_default_queue": os.environ.get("BENCH_CD_QUEUE", "bench-countdown"),
        "broker_transport_options": options,
        "broker_connection_retry_on_startup": True,
        "task_ignore_result": True,
        "timezone": "UTC",
        "beat_schedule": {},
        "anarchon_backend": os.environ.get("BENCH_CD_BACKEND") or None,
    }


app = Celery("bench-countdown", set_as_current=False)
app.conf.update(_worker_conf())
if os.environ.get("BENCH_CD_GATE") == "1":
    import celery_anarchon.worker

    celery_anarchon.worker.install(app)

_recorder: redis.Redis | None = None


@app.task(name=TASK, bind=True)
def countdown_run(self: Task, tag: str, seq: int) -> None:
    """Counts one execution of task ``seq`` of ``tag`` and logs it.

    Args:
        tag: the part and side (``<run>:<part>:native`` or ``...:ours``).
        seq: the task's number within them.
    """
    global _recorder
    if _recorder is None:
        _recorder = redis.Redis.from_url(REDIS_URL)
    info = self.request.delivery_info or {}
    entry: dict[str, Any] = {"seq": seq, "at": time.time(), "pid": os.getpid()}
    entry["redelivered"] = info.get("redelivered")
    pipe = _recorder.pipeline(transaction=False)
    pipe.hincrby(f"{tag}:runs", str(seq), 1)
    pipe.rpush(f"{tag}:log", json.dumps(entry))
    pipe.execute()


# -- processes -----------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, from ``/proc/*/stat``."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def _status_kb(pid: int, path: str, key: str) -> int:
    with suppress(OSError):
        for line in Path(f"/proc/{pid}/{path}").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def memory(pid: int) -> dict[str, int]:
    """Memory of ``pid`` and its children, bytes: ``rss`` (``VmRSS`` summed;
    a page shared after a fork counts in each), ``pss`` (``Pss`` of
    ``smaps_rollup`` summed: a shared page divided among its sharers),
    ``main_rss`` (the main process alone) and ``processes``."""
    pids = descendants(pid)
    return {
        "rss": sum(_status_kb(p, "status", "VmRSS:") for p in pids),
        "pss": sum(_status_kb(p, "smaps_rollup", "Pss:") for p in pids),
        "main_rss": _status_kb(pid, "status", "VmRSS:"),
        "processes": len(pids),
    }


@dataclass
class Proc:
    """One process the benchmark starts (a worker, a beat), in a session of
    its own so that its pool children are stopped with it."""

    name: str
    command: list[str]
    env: dict[str, str]
    folder: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    exits: list[tuple[float, int]] = field(default_factory=list)

    @property
    def logfile(self) -> Path:
        return self.folder / f"{self.name}.log"

    def start(self) -> None:
        out = open(self.logfile, "ab")  # noqa: SIM115 - the child writes it
        self.starts += 1
        self.proc = subprocess.Popen(
            self.command,
            cwd=self.folder,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart_if_exited(self) -> bool:
        """Start it again when it has exited (a supervisor's restart);
        True when it did."""
        if self.proc is None or self.proc.poll() is None:
            return False
        self.exits.append((time.time(), self.proc.returncode))
        log(f"{self.name} exited ({self.proc.returncode}); starting it again")
        self.start()
        return True

    def text(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def wait_for(self, needle: str, timeout: float) -> None:
        """Until ``needle`` is in its log; RuntimeError when it exits or
        ``timeout`` seconds pass first."""
        deadline = time.time() + timeout
        while needle not in self.text():
            if not self.alive() or time.time() > deadline:
                raise RuntimeError(f"{self.name}: no {needle!r} in its log:\n{self.text()[-3000:]}")
            time.sleep(0.2)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (a warm shutdown), then SIGKILL to its session after
        ``timeout`` s, and to any child left."""
        if self.proc is None:
            return
        pid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"{self.name}: no exit {timeout:.0f} s after SIGTERM; SIGKILL")
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # the session it leads: its own children
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def python() -> str:
    venv = common.REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def proc_env(
    broker: str, queue: str, backend: str = "", gate: bool = False, **transport: Any
) -> dict[str, str]:
    env = {
        **os.environ,
        "BENCH_CD_BROKER": broker,
        "BENCH_CD_QUEUE": queue,
        "BENCH_CD_BACKEND": backend,
        "BENCH_CD_GATE": "1" if gate else "",
        "PYTHONPATH": str(common.REPO),
    }
    for name, value in transport.items():
        env[f"BENCH_CD_{name.upper()}"] = "" if value is None else str(value)
    return env


def records(text: str, needle: str) -> int:
    """How many log records (lines that start with ``[``: not a traceback's)
    contain ``needle``."""
    return sum(needle in line for line in text.splitlines() if line.startswith("["))


def worker(name: str, folder: Path, env: dict[str, str], concurrency: int) -> Proc:
    command = [python(), "-m", "celery", "-A", "bench.countdown", "worker"]
    command += ["-Q", env["BENCH_CD_QUEUE"], "-c", str(concurrency), "-P", "prefork"]
    command += ["-n", f"{name}-{common.RUN_ID}@%h", "-l", "INFO"]
    command += ["--without-mingle", "--without-gossip", "--without-heartbeat"]
    return Proc(name, command, env, folder)


def beat(name: str, folder: Path, env: dict[str, str]) -> Proc:
    command = [python(), "-m", "celery", "-A", "bench.countdown", "beat"]
    command += ["-S", "celery_anarchon.Scheduler", "-l", "INFO"]
    command += ["-s", str(folder / f"{name}-schedule")]
    return Proc(name, command, env, folder)


@contextmanager
def running(procs: Sequence[Proc], ready: float = 90.0) -> Iterator[None]:
    """Starts ``procs`` and waits for each (a worker's ``ready.``, a beat's
    ``beat: Starting``); stops them all at the end."""
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_for(" ready." if "worker" in p.command else "beat: Starting", ready)
        yield
    finally:
        for p in procs:
            p.stop()


# -- Redis helpers --------------------------------------------------------------------


#: Every Redis key of the broker (kombu's ``global_keyprefix``: queues,
#: bindings, the ``unacked`` hash and index) starts with this.
KEYPREFIX = f"cd-{common.RUN_ID}-broker:"
#: The ``anarchon_backend`` of ours: the parked tasks and the gate's marks.
BACKEND_URL = f"{REDIS_URL}?prefix=cd-{common.RUN_ID}:"


@contextmanager
def own_keys() -> Iterator[redis.Redis]:
    """A client of :data:`REDIS_URL`; every key that names the run
    (:data:`KEYPREFIX`, the store's ``{cd-<run>:...}``, the records
    ``<run>:...``) is deleted at the end."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        yield client
    finally:
        with suppress(redis.RedisError):
            common.redis_delete(client, f"*{common.RUN_ID}*")
        client.close()


def runs_of(client: redis.Redis, tag: str, count: int) -> dict[str, Any]:
    """Executions per task of ``tag``: ``executions`` (total), ``distinct``
    (tasks run at least once), ``never`` and ``extra`` (executions beyond
    the first), ``per_task`` (executions -> tasks), and the log."""
    runs = {int(k): int(v) for k, v in client.hgetall(f"{tag}:runs").items()}
    per_task = Counter(runs.get(i, 0) for i in range(count))
    entries = [json.loads(e) for e in client.lrange(f"{tag}:log", 0, -1)]
    total = sum(runs.values())
    return {
        "tasks": count,
        "executions": total,
        "distinct": len(runs),
        "never": count - len(runs),
        "extra": total - len(runs),
        "per_task": dict(sorted(per_task.items())),
        "log": entries,
    }


def park_app(backend: str, broker: str) -> Celery:
    parking = Celery("bench-countdown-park", broker=broker, set_as_current=False)
    parking.conf.update(anarchon_backend=backend, timezone="UTC", task_ignore_result=True)
    return parking


def park(parking: Celery, tag: str, count: int, countdown: float, queue: str) -> float:
    """Park ``count`` tasks due in ``countdown`` s (chunks of 1,000);
    returns the seconds it took."""
    from celery_anarchon import delayed

    started = time.perf_counter()
    for start in range(0, count, 1000):
        calls = [
            {"task": TASK, "args": (tag, i), "countdown": countdown, "options": {"queue": queue}}
            for i in range(start, min(count, start + 1000))
        ]
        delayed.park_many(parking, calls)
    return time.perf_counter() - started


def send_native(broker: str, tag: str, count: int, countdown: float, queue: str) -> float:
    """``count`` ``send_task(countdown=...)`` (what ``apply_async`` does),
    one producer; returns the seconds it took. On Redis, the keys are under
    :data:`KEYPREFIX`, as the workers read them."""
    sender = Celery("bench-countdown-send", broker=broker, set_as_current=False)
    if broker.startswith("redis"):
        sender.conf.broker_transport_options = {"global_keyprefix": KEYPREFIX}
    started = time.perf_counter()
    with sender.producer_or_acquire() as producer:
        for i in range(count):
            sender.send_task(TASK, (tag, i), countdown=countdown, queue=queue, producer=producer)
    seconds = time.perf_counter() - started
    sender.close()
    return seconds


def load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


@contextmanager
def part_folder(args: argparse.Namespace, part: str) -> Iterator[Path]:
    """The folder of a part's logs and schedule files: ``--keep``'s
    subfolder ``part``, kept; else a temporary one, deleted afterwards."""
    if args.keep:
        path = Path(args.keep) / part
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix=f"bench-countdown-{part}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- 1. worker memory ----------------------------------------------------------------


def part_rss(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    native_q, ours_q = f"cd-{common.RUN_ID}-rss-native", f"cd-{common.RUN_ID}-rss-ours"
    backend = BACKEND_URL
    result: dict[str, Any] = {"count": args.rss_count, "countdown_s": args.rss_countdown}
    result["load_start"] = load()
    with own_keys() as client:
        native = worker(
            "worker-native",
            folder,
            proc_env(REDIS_URL, native_q, keyprefix=KEYPREFIX),
            args.concurrency,
        )
        ours = worker(
            "worker-ours",
            folder,
            proc_env(REDIS_URL, ours_q, backend=backend, gate=True, keyprefix=KEYPREFIX),
            args.concurrency,
        )
        with running([native, ours]):
            time.sleep(args.settle)
            result["native_baseline"] = memory(native.pid)
            result["ours_baseline"] = memory(ours.pid)
            log(f"baselines: native {result['native_baseline']}, ours {result['ours_baseline']}")

            tag = f"{common.RUN_ID}:rss:native"
            result["native_send_s"] = send_native(
                REDIS_URL, tag, args.rss_count, args.rss_countdown, native_q
            )
            sent_at = time.time()
            log(f"sent {args.rss_count} countdown tasks in {result['native_send_s']:.1f} s")
            samples = []
            taken_at = None
            while time.time() - sent_at < args.take_timeout:
                queued = client.llen(KEYPREFIX + native_q)
                unacked = client.hlen(KEYPREFIX + "unacked")
                samples.append((time.time() - sent_at, queued, unacked, memory(native.pid)["rss"]))
                if queued == 0 and unacked >= args.rss_count:
                    taken_at = time.time()
                    break
                time.sleep(1)
            result["native_taken_s"] = None if taken_at is None else taken_at - sent_at
            result["native_take_samples"] = samples
            time.sleep(args.settle)
            result["native_loaded"] = memory(native.pid)
            result["native_unacked"] = client.hlen(KEYPREFIX + "unacked")
            result["native_queued"] = client.llen(KEYPREFIX + native_q)
            log(f"native: taken in {result['native_taken_s']} s, {result['native_loaded']}")

            parking = park_app(backend, REDIS_URL)
            result["ours_park_s"] = park(
                parking, f"{common.RUN_ID}:rss:ours", args.rss_count, args.rss_countdown, ours_q
            )
            from celery_anarchon import delayed

            result["ours_parked"] = delayed.count(parking)
            time.sleep(max(args.settle, 10.0))
            result["ours_loaded"] = memory(ours.pid)
            result["ours_queued"] = client.llen(KEYPREFIX + ours_q)
            result["unacked_after_ours"] = client.hlen(KEYPREFIX + "unacked")
            delayed.store_for(parking)[0].close()
            log(f"ours: parked in {result['ours_park_s']:.1f} s, {result['ours_loaded']}")
            result["load_end"] = load()
        # the native worker's warm shutdown gives every held task back
    result["native_worker_exits"] = native.exits
    for side in ("native", "ours"):
        base, loaded = result[f"{side}_baseline"], result[f"{side}_loaded"]
        result[f"{side}_per_task"] = {
            k: (loaded[k] - base[k]) / args.rss_count for k in ("rss", "pss", "main_rss")
        }
    return result


def print_rss(r: dict[str, Any]) -> None:
    mib = 1024 * 1024

    def pair(side: str, key: str, per: float, digits: int) -> str:
        got = r[f"{side}_{key}"]
        return f"{got['rss'] / per:.{digits}f} / {got['pss'] / per:.{digits}f}"

    def row(label: str, key: str, per: float = mib, digits: int = 1) -> list[str]:
        return [label, pair("native", key, per, digits), pair("ours", key, per, digits)]

    def main_rss(side: str) -> str:
        before, after = r[f"{side}_baseline"]["main_rss"], r[f"{side}_loaded"]["main_rss"]
        return f"{before / mib:.1f} -> {after / mib:.1f}"

    taken = r["native_taken_s"]
    count, countdown = r["count"], r["countdown_s"]
    print(f"### Worker memory with {count:,} pending tasks (countdown {countdown:.0f} s)\n")
    rows = [
        row("baseline RSS / PSS, main + children (MiB)", "baseline"),
        row("with the tasks pending: RSS / PSS (MiB)", "loaded"),
        row("per pending task: RSS / PSS (bytes)", "per_task", per=1, digits=0),
        ["main process RSS: baseline -> pending (MiB)", main_rss("native"), main_rss("ours")],
        ["send / park (s)", f"{r['native_send_s']:.1f}", f"{r['ours_park_s']:.1f}"],
        [
            "all held by the worker, from the first send (s)",
            "not within the timeout" if taken is None else f"{r['native_send_s'] + taken:.1f}",
            "(none fetched)",
        ],
        [
            "unacked on the broker / still queued",
            f"{r['native_unacked']:,} / {r['native_queued']:,}",
            f"{r['unacked_after_ours'] - r['native_unacked']:+,} / {r['ours_queued']:,}"
            f" ({r['ours_parked']:,} parked in the store)",
        ],
    ]
    print(common.table(["figure", "native countdown", "parked (ours)"], rows))
    print(f"\nload average at start {r['load_start']}, at end {r['load_end']}\n")


# -- 2. Redis redelivery -------------------------------------------------------------


def part_redelivery(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    native_q, ours_q = f"cd-{common.RUN_ID}-rd-native", f"cd-{common.RUN_ID}-rd-ours"
    backend = BACKEND_URL
    transport = {
        "keyprefix": KEYPREFIX,
        "visibility_timeout": args.visibility_timeout,
        "unacked_restore_interval": args.restore_interval,
        "unacked_restore_throttle": args.restore_throttle,
    }
    n, countdown = args.redelivery_count, args.redelivery_countdown
    grace = args.redelivery_grace
    if grace is None:
        grace = 2 * args.visibility_timeout + 20
    result: dict[str, Any] = {"count": n, "countdown_s": countdown, "grace_s": grace, **transport}
    result["load_start"] = load()
    tags = {side: f"{common.RUN_ID}:rd:{side}" for side in ("native", "ours")}
    with own_keys() as client:
        native = worker(
            "worker-native", folder, proc_env(REDIS_URL, native_q, **transport), args.concurrency
        )
        ours_env = proc_env(REDIS_URL, ours_q, backend=backend, gate=True, **transport)
        ours = worker("worker-ours", folder, ours_env, args.concurrency)
        releaser = beat("beat", folder, ours_env)
        with running([native, ours, releaser]):
            parking = park_app(backend, REDIS_URL)
            started = time.time()
            send_native(REDIS_URL, tags["native"], n, countdown, native_q)
            park(parking, tags["ours"], n, countdown, ours_q)
            from celery_anarchon import delayed

            delayed.store_for(parking)[0].close()
            log(f"sent and parked {n} each, countdown {countdown} s; waiting {grace:.0f} s more")
            while time.time() < started + countdown + grace:
                for p in (native, ours, releaser):
                    p.restart_if_exited()
                time.sleep(1)
            result["load_end"] = load()
            for side in ("native", "ours"):
                found = runs_of(client, tags[side], n)
                for entry in found["log"]:
                    entry["late_s"] = entry["at"] - (started + countdown)
                result[side] = found
        result["native_deliveries"] = records(native.text(), "] received")
        result["ours_deliveries"] = records(ours.text(), "] received")
        result["ours_discarded"] = ours.text().count("discarded a second delivery")
        result["exits"] = {p.name: p.exits for p in (native, ours, releaser)}
    return result


def late(side: dict[str, Any]) -> str:
    """The earliest and latest execution of a side, seconds after due."""
    times = [e["late_s"] for e in side["log"]]
    return f"{min(times):+.1f} / {max(times):+.1f}" if times else "-"


def print_redelivery(r: dict[str, Any]) -> None:
    n = r["count"]
    print(
        f"### Redis: {n} tasks, countdown {r['countdown_s']:.0f} s, "
        f"visibility_timeout {r['visibility_timeout']:.0f} s, kombu's restore sweep every "
        f"{r['unacked_restore_interval'] or 10} s x {r['unacked_restore_throttle'] or 10}\n"
    )
    rows = []
    for label, fn in (
        ("executions", lambda s: s["executions"]),
        (
            "tasks run more than once",
            lambda s: sum(c for k, c in s["per_task"].items() if int(k) > 1),
        ),
        ("executions beyond the first (duplicates)", lambda s: s["extra"]),
        ("executions per task (mean)", lambda s: f"{s['executions'] / n:.2f}"),
        ("tasks never run", lambda s: s["never"]),
        (
            "tasks by executions",
            lambda s: ", ".join(f"{k}x: {v}" for k, v in s["per_task"].items()),
        ),
    ):
        rows.append([label, fn(r["native"]), fn(r["ours"])])
    rows.append(
        ["deliveries to the worker (received)", r["native_deliveries"], r["ours_deliveries"]]
    )
    rows.append(["second deliveries discarded by the gate", "-", r["ours_discarded"]])
    rows.append(
        ["executions after their due time: first / last (s)", late(r["native"]), late(r["ours"])]
    )
    print(common.table(["figure", "native countdown", "parked (ours)"], rows))
    print(f"\nload average at start {r['load_start']}, at end {r['load_end']}\n")


# -- 3. RabbitMQ consumer_timeout ----------------------------------------------------


@dataclass
class RabbitNode:
    """A RabbitMQ node of the benchmark's own: its own name, ports, data and
    ``rabbitmq.conf`` (``consumer_timeout``), no plugins; the shared node is
    not touched. ``stop`` halts it and deletes its data."""

    folder: Path
    port: int
    dist_port: int
    consumer_timeout_ms: int
    name: str = field(default_factory=lambda: f"bench-ct-{common.RUN_ID}@localhost")
    proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        f = self.folder
        return {
            **os.environ,
            "RABBITMQ_CONF_ENV_FILE": str(f / "rabbitmq-env.conf"),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(f / "mnesia"),
            "RABBITMQ_LOG_BASE": str(f / "log"),
            "RABBITMQ_CONFIG_FILE": str(f / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(f / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(f / "node.pid"),
        }

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def ctl(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(RABBIT_BIN / "rabbitmqctl"), "-n", self.name, *command],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def start(self) -> None:
        for sub in ("mnesia", "log"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        (self.folder / "enabled_plugins").write_text("[].\n")
        (self.folder / "rabbitmq.conf").write_text(
            f"consumer_timeout = {self.consumer_timeout_ms}\n"
        )
        (self.folder / "rabbitmq-env.conf").write_text("ERL_EPMD_ADDRESS=127.0.0.1\n")
        out = open(self.folder / "server.out", "wb")  # noqa: SIM115 - the child writes it
        self.proc = subprocess.Popen(
            [str(RABBIT_BIN / "rabbitmq-server")],
            cwd=self.folder,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        deadline = time.time() + 120
        while self.ctl("ping", timeout=30).returncode != 0:
            if self.proc.poll() is not None or time.time() > deadline:
                text = (self.folder / "server.out").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"RabbitMQ node {self.name} did not start:\n{text}")
            time.sleep(1)
        waited = self.ctl("await_startup", "--timeout", "120", timeout=150)
        if waited.returncode != 0:
            raise RuntimeError(f"RabbitMQ node {self.name} did not start: {waited.stderr}")
        got = self.ctl("eval", "application:get_env(rabbit, consumer_timeout).").stdout.strip()
        if got != f"{{ok,{self.consumer_timeout_ms}}}":
            raise RuntimeError(f"node {self.name}: consumer_timeout is {got}")
        log(f"RabbitMQ node {self.name} on port {self.port}, consumer_timeout {got}")

    def version(self) -> str:
        return self.ctl("version").stdout.strip()

    def log_text(self) -> str:
        return "".join(
            p.read_text(errors="replace") for p in sorted((self.folder / "log").glob("*.log"))
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.ctl("stop", timeout=120)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                log(f"node {self.name} still up after stop; SIGKILL to its session")
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def part_consumer_timeout(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    node_dir = Path(tempfile.mkdtemp(prefix="bench-ct-node-"))
    countdown, timeout_s = args.ct_countdown, args.consumer_timeout
    grace = args.ct_grace if args.ct_grace is not None else 2 * timeout_s + 60
    node = RabbitNode(node_dir, args.ct_port, args.ct_dist_port, int(timeout_s * 1000))
    native_q, ours_q = f"cd-{common.RUN_ID}-ct-native", f"cd-{common.RUN_ID}-ct-ours"
    backend = BACKEND_URL
    tags = {side: f"{common.RUN_ID}:ct:{side}" for side in ("native", "ours")}
    result: dict[str, Any] = {"countdown_s": countdown, "consumer_timeout_s": timeout_s}
    result.update(grace_s=grace, load_start=load(), node=node.name)
    events: list[tuple[float, str]] = []
    with own_keys() as client, ExitStack() as stack:
        stack.callback(shutil.rmtree, node_dir, True)
        stack.callback(node.stop)
        node.start()
        result["rabbitmq"] = node.version()
        native = worker("worker-native", folder, proc_env(node.url, native_q), 1)
        ours_env = proc_env(node.url, ours_q, backend=backend, gate=True)
        ours = worker("worker-ours", folder, ours_env, 1)
        releaser = beat("beat", folder, ours_env)
        stack.enter_context(running([native, ours, releaser]))
        parking = park_app(backend, node.url)
        started = time.time()
        send_native(node.url, tags["native"], 1, countdown, native_q)
        park(parking, tags["ours"], 1, countdown, ours_q)
        from celery_anarchon import delayed

        delayed.store_for(parking)[0].close()
        due = started + countdown
        log(f"sent and parked one task each, countdown {countdown} s; until {due + grace:.0f}")
        closes_seen = 0
        while time.time() < due + grace:
            for p in (native, ours, releaser):
                if p.restart_if_exited():
                    events.append((time.time() - started, f"{p.name} exited; restarted"))
            closes = records(native.text(), "PRECONDITION_FAILED")
            if closes != closes_seen:
                events.append(
                    (time.time() - started, f"channel closes in the worker log: {closes}")
                )
                log(events[-1][1])
                closes_seen = closes
            time.sleep(2)
        result["load_end"] = load()
        for side in ("native", "ours"):
            found = runs_of(client, tags[side], 1)
            for entry in found["log"]:
                entry["after_send_s"] = entry["at"] - started
                entry["late_s"] = entry["at"] - due
            result[side] = found
        text = native.text()
        result["native_closes"] = records(text, "PRECONDITION_FAILED")
        result["native_lost"] = records(text, "Connection to broker lost")
        result["native_unrecoverable"] = records(text, "Unrecoverable error")
        result["native_deliveries"] = records(text, "] received")
        result["ours_deliveries"] = records(ours.text(), "] received")
        result["ours_closes"] = records(ours.text(), "PRECONDITION_FAILED")
        server = node.log_text()
        result["node_timeouts"] = server.count("timed out waiting for delivery acknowledgement")
        result["node_log_lines"] = [
            line for line in server.splitlines() if "acknowledgement" in line
        ][:20]
        result["native_worker_lines"] = [
            line
            for line in text.splitlines()
            if any(
                k in line
                for k in ("PRECONDITION", "received", "lost", "Unrecoverable", "succeeded")
            )
        ][:60]
        result["exits"] = {p.name: p.exits for p in (native, ours, releaser)}
        result["events"] = events
    return result


def print_consumer_timeout(r: dict[str, Any]) -> None:
    print(
        f"### RabbitMQ ({r.get('rabbitmq', '?')}): countdown {r['countdown_s']:.0f} s, "
        f"consumer_timeout {r['consumer_timeout_s']:.0f} s\n"
    )

    def runs(side: dict[str, Any]) -> str:
        return (
            ", ".join(f"{e['after_send_s']:.1f} s (late {e['late_s']:+.1f} s)" for e in side["log"])
            or "never"
        )

    rows = [
        ["executions", r["native"]["executions"], r["ours"]["executions"]],
        ["ran after the send at", runs(r["native"]), runs(r["ours"])],
        ["channel closes, PRECONDITION_FAILED (worker log)", r["native_closes"], r["ours_closes"]],
        ["deliveries to the worker (received)", r["native_deliveries"], r["ours_deliveries"]],
        [
            "worker exits (restarted)",
            len(r["exits"]["worker-native"]),
            len(r["exits"]["worker-ours"]),
        ],
        ["'Connection to broker lost' (worker log)", r["native_lost"], "-"],
        ["consumer timeouts in the node's log", r["node_timeouts"], "(both sides)"],
    ]
    print(common.table(["figure", "native countdown", "parked (ours)"], rows))
    print(f"\nload average at start {r['load_start']}, at end {r['load_end']}\n")


# -- main ------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.countdown", description=__doc__.split("\n")[0]
    )
    p.add_argument("--only", choices=PARTS, action="append", help="a part to run (repeatable)")
    p.add_argument("--rss-count", type=int, default=100_000)
    p.add_argument("--rss-countdown", type=float, default=3600.0, help="seconds")
    p.add_argument("--concurrency", type=int, default=2, help="prefork children per worker")
    p.add_argument("--take-timeout", type=float, default=900.0, help="seconds")
    p.add_argument("--settle", type=float, default=10.0, help="seconds before a memory reading")
    p.add_argument("--redelivery-count", type=int, default=20)
    p.add_argument("--visibility-timeout", type=float, default=10.0, help="seconds")
    p.add_argument("--redelivery-countdown", type=float, default=240.0, help="seconds")
    p.add_argument("--restore-interval", type=int, default=None, help="kombu's, seconds")
    p.add_argument("--restore-throttle", type=int, default=None, help="kombu's")
    p.add_argument("--redelivery-grace", type=float, default=None, help="seconds")
    p.add_argument("--ct-countdown", type=float, default=2700.0, help="seconds")
    p.add_argument("--consumer-timeout", type=float, default=60.0, help="seconds")
    p.add_argument("--ct-grace", type=float, default=None, help="seconds")
    p.add_argument("--ct-port", type=int, default=5680)
    p.add_argument("--ct-dist-port", type=int, default=25680)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    p.add_argument("--keep", help="keep the logs in this folder")
    p.add_argument("--json", help="write the raw results here")
    args = p.parse_args(argv)
    if args.quick:
        args.rss_count, args.settle, args.take_timeout = 2000, 3.0, 120.0
        args.redelivery_count, args.visibility_timeout = 5, 3.0
        args.redelivery_countdown, args.restore_interval, args.restore_throttle = 8.0, 1, 1
        args.redelivery_grace = 6.0
        args.ct_countdown, args.consumer_timeout, args.ct_grace = 150.0, 30.0, 60.0
    return args


RUNNERS = {
    "rss": (part_rss, print_rss),
    "redelivery": (part_redelivery, print_redelivery),
    "consumer-timeout": (part_consumer_timeout, print_consumer_timeout),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    common.exit_on_sigterm()
    parts = args.only or list(PARTS)
    print(common.header("Native countdown against parking (bench.countdown)"))
    results: dict[str, Any] = {"args": vars(args)}
    failed = False
    for part in parts:
        run, show = RUNNERS[part]
        log(f"part {part}")
        try:
            with part_folder(args, part) as folder:
                results[part] = run(args, folder)
        except Exception as exc:  # reported, and the other parts still run
            log(f"part {part} failed: {exc!r}")
            results[part] = {"error": repr(exc)}
            failed = True
            continue
        show(results[part])
        sys.stdout.flush()
    common.write_json(args.json, results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
