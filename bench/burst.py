"""Benchmark 2: a burst of jobs all due in the same second, real ``celery
beat`` processes, a real Redis broker.

    python -m bench.burst [--jobs 10000] [--period 20] [--rounds 2] [--repeats 3]
        [--configs celery,redbeat,anarchon-redis-1,anarchon-redis-3,...]
        [--jitters 0,2] [--rabbit-jobs 1000] [--profile DIR]

Each configuration runs ``celery -A bench.bench_app beat`` processes:

* ``celery``: Celery's default ``PersistentScheduler``, one process;
* ``redbeat``: celery-redbeat, one process (it holds the lock);
* ``anarchon-<backend>-<n>``: ``n`` celery-anarchon instances claiming in
  ``<backend>`` (redis, postgresql, mysql, sqlite, rabbitmq), once per jitter
  in ``--jitters`` (``anarchon_jitter``).

``--jobs`` jobs run every ``--period`` seconds, all due at the same instants
(anarchon: intervals anchored on the epoch; Celery and redbeat: their
``last_run_at`` set one period before the first measured slot ``S``). The
benchmark waits until every process finished set-up; from then a reader
(:mod:`bench.arrivals`) takes every message off the queue as it arrives, in
batches, and stamps it with the time it was read. What it read before
``S`` minus 1.5 s is dropped. A message's lateness is its read time minus
its round's slot, and a round's is the time from its slot to the read of
its last message (also of its 50 %, 90 %, 99 % message). CPU seconds are
read from ``/proc`` for every beat process over the measured rounds. Every
message read is checked: for anarchon, each ``(anarchon_job,
anarchon_slot)`` of the measured rounds must appear exactly once.

Celery's broker is Redis, or for ``anarchon-<backend>-<n>-amqp`` a RabbitMQ
vhost of the run's own (``-amqp-confirm``: with ``confirm_publish``).

Configurations run interleaved, repeat after repeat, so that every figure of
a repeat was measured under the same load. Everything the run creates (the
queue, keys, tables, a RabbitMQ vhost, temporary folders, processes) is
removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

from . import common
from .arrivals import Reader, reader_for
from .common import log

SCHEDULERS = {
    "publish": "",
    "celery": "celery.beat:PersistentScheduler",
    "redbeat": "redbeat.RedBeatScheduler",
    "anarchon": "celery_anarchon.Scheduler",
}
BACKENDS = ["redis", "postgresql", "mysql", "sqlite", "rabbitmq"]
DEFAULT_CONFIGS = (
    "publish-1,publish-3,celery,redbeat,anarchon-redis-1,anarchon-redis-3,"
    "anarchon-postgresql-1,anarchon-postgresql-3,anarchon-rabbitmq-1,anarchon-rabbitmq-3"
)

#: Poll period of the queue length, seconds.
POLL_S = 0.005
#: The queue is emptied and CPU counters read this long before the slot.
LEAD_S = 1.5


@dataclass(frozen=True)
class Config:
    """One scheduler set-up under test."""

    kind: str
    backend: str | None = None
    instances: int = 1
    jitter: float | None = None
    #: Celery's broker: ``redis``, ``amqp`` (RabbitMQ, publisher confirms
    #: off) or ``amqp-confirm`` (``confirm_publish`` on).
    broker: str = "redis"

    @property
    def label(self) -> str:
        if self.kind == "publish":
            return f"publish floor x{self.instances}"
        if self.kind != "anarchon":
            return self.kind
        on = "" if self.broker == "redis" else f", broker {BROKER_LABELS[self.broker]}"
        return f"anarchon {self.backend} x{self.instances} jitter {self.jitter:g}{on}"


#: Celery broker of a configuration, by its suffix.
BROKER_LABELS = {"amqp": "RabbitMQ", "amqp-confirm": "RabbitMQ with confirms"}


def parse_configs(text: str, jitters: Sequence[float]) -> list[Config]:
    """``celery,redbeat,anarchon-redis-3`` -> configs (anarchon ones once
    per jitter)."""
    configs: list[Config] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part in ("celery", "redbeat"):
            configs.append(Config(part))
            continue
        floor = re.fullmatch(r"publish-(\d+)", part)
        if floor:
            configs.append(Config("publish", None, int(floor.group(1))))
            continue
        match = re.fullmatch(r"anarchon-([a-z]+)-(\d+)(?:-(amqp|amqp-confirm))?", part)
        if not match or match.group(1) not in BACKENDS:
            raise ValueError(
                f"unknown configuration {part!r}: use celery, redbeat or "
                f"anarchon-<{'|'.join(BACKENDS)}>-<instances>[-amqp|-amqp-confirm]"
            )
        for jitter in jitters:
            configs.append(
                Config(
                    "anarchon",
                    match.group(1),
                    int(match.group(2)),
                    jitter,
                    match.group(3) or "redis",
                )
            )
    return configs


def redbeat_installed() -> bool:
    try:
        import redbeat  # noqa: F401
    except ImportError:
        return False
    return True


# -- resources per run -----------------------------------------------------------


@contextlib.contextmanager
def claim_backend(cfg: Config, tag: str) -> Iterator[str | None]:
    """The ``anarchon_backend`` URL for ``cfg`` (a prefix, tables or a vhost
    of this run's own); removes them afterwards."""
    if cfg.kind != "anarchon":
        yield None
        return
    if cfg.backend == "redis":
        prefix = f"anarchon-bench-{tag}:"
        try:
            yield f"{common.REDIS_URL}?prefix={prefix}"
        finally:
            client = redis.Redis.from_url(common.REDIS_URL)
            common.redis_delete(client, "{" + prefix + "*")
            client.close()
    elif cfg.backend in ("postgresql", "mysql"):
        url = common.POSTGRES_URL if cfg.backend == "postgresql" else common.MYSQL_URL
        prefix = f"anarchon_bench_{tag.replace('-', '_')}_"
        try:
            yield f"{url}?prefix={prefix}"
        finally:
            common.drop_sql_tables(url, prefix)
    elif cfg.backend == "sqlite":
        folder = Path(tempfile.mkdtemp(prefix="anarchon-bench-sqlite-"))
        try:
            yield f"sqlite:///{folder / 'claims.db'}"
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    elif cfg.backend == "rabbitmq":
        with common.rabbit_vhost(f"anarchon-bench-{tag}") as vhost:
            yield common.rabbit_url(vhost)
    else:
        raise ValueError(cfg.backend)


@contextlib.contextmanager
def celery_broker(cfg: Config, tag: str) -> Iterator[str]:
    """Celery's broker URL for ``cfg``: the Redis broker, or a RabbitMQ
    vhost of this run's own, removed afterwards."""
    if cfg.broker == "redis":
        yield common.BROKER_URL
        return
    with common.rabbit_vhost(f"anarchon-bench-{tag}-broker") as vhost:
        yield common.rabbit_url(vhost)


@dataclass
class Run:
    """The processes and names of one measured run."""

    cfg: Config
    jobs: int
    period: float
    folder: Path
    queue: str
    broker: redis.Redis
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    launched: float = 0.0
    #: Celery's broker URL for the beats.
    broker_url: str = common.BROKER_URL
    #: Once started, what :meth:`length` counts: messages read so far.
    reader: Reader | None = None

    def start(
        self, backend_url: str | None, first_slot: float, tag: str, args: argparse.Namespace
    ) -> None:
        conf: dict[str, Any] = {}
        if self.cfg.jitter is not None:
            conf["anarchon_jitter"] = self.cfg.jitter
            conf["anarchon_max_late"] = args.max_late
        if self.cfg.broker == "amqp-confirm":
            conf["broker_transport_options"] = {"confirm_publish": True}
        env = {
            **os.environ,
            "BENCH_KIND": self.cfg.kind,
            "BENCH_BROKER": self.broker_url,
            "BENCH_QUEUE": self.queue,
            "BENCH_JOBS": str(self.jobs),
            "BENCH_PERIOD": str(self.period),
            "BENCH_FIRST": repr(first_slot),
            "BENCH_BACKEND": backend_url or "",
            "BENCH_REDBEAT_URL": common.REDIS_URL,
            "BENCH_REDBEAT_PREFIX": f"anarchon-bench-{tag}-redbeat:",
            "BENCH_CONF": json.dumps(conf),
            "BENCH_READY_DIR": str(self.folder),
            "BENCH_ROUNDS": str(args.rounds),
            "PYTHONPATH": str(common.REPO),
        }
        self.launched = time.time()
        for index in range(self.cfg.instances):
            logfile = open(self.folder / f"beat-{index + 1}.log", "wb")  # noqa: SIM115
            command = [
                sys.executable,
                "-m",
                "bench.publisher",
                str(index),
                str(self.cfg.instances),
            ]
            if self.cfg.kind != "publish":
                command = self.beat_command(index)
            self.procs.append(
                subprocess.Popen(
                    command, cwd=self.folder, env=env, stdout=logfile, stderr=subprocess.STDOUT
                )
            )
            logfile.close()

    def beat_command(self, index: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench.bench_app",
            "beat",
            "-S",
            SCHEDULERS[self.cfg.kind],
            "-l",
            "INFO",
            "-s",
            str(self.folder / f"celerybeat-schedule-{index + 1}"),
        ]

    def wait_ready(self, timeout: float) -> float:
        """Seconds from launch until the last process finished set-up.

        Raises:
            RuntimeError: a process exited or did not get ready in time.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None and self.cfg.kind != "publish":
                    raise RuntimeError(f"{self.cfg.label}: a beat exited:\n{self.logs()}")
            marks = list(self.folder.glob("ready-*"))
            if len(marks) >= len(self.procs):
                return max(float(m.read_text()) for m in marks) - self.launched
            time.sleep(0.1)
        raise RuntimeError(f"{self.cfg.label}: not ready within {timeout:.0f} s:\n{self.logs()}")

    def cpu(self) -> list[float]:
        return [common.cpu_seconds(p.pid) for p in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            common.stop_process(proc, timeout=30)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
            for p in sorted(self.folder.glob("beat-*.log"))
        )

    def length(self) -> int:
        """Messages in the queue, or read from it once :attr:`reader` runs."""
        if self.reader is not None:
            return self.reader.count
        return int(self.broker.llen(self.queue))


def clean_broker(client: redis.Redis, queue: str) -> None:
    client.delete(queue)
    common.redis_delete(client, f"*{queue}*")


# -- measuring ---------------------------------------------------------------------


def first_at(timeline: Sequence[tuple[float, int]], target: int) -> float | None:
    """The first time the queue length reached ``target``."""
    for at, count in timeline:
        if count >= target:
            return at
    return None


def count_at(timeline: Sequence[tuple[float, int]], when: float) -> int:
    """The queue length at ``when`` (last observation not after it)."""
    count = 0
    for at, n in timeline:
        if at > when:
            break
        count = n
    return count


def wait_for_launch(period: float, max_late: float) -> None:
    """Sleep until no slot lies within ``max_late`` before now and at least
    10 s remain before the next slot (when ``max_late + 10 < period``), so
    that anarchon instances start with no slot to catch up and the first
    slot they see is the measured one."""
    if max_late + 10 >= period:
        return
    now = time.time()
    last = math.floor(now / period) * period
    start = last + max_late + 0.5
    if now > last + period - 10:
        start += period
    time.sleep(max(0.0, start - now))


def lateness(
    timeline: Sequence[tuple[float, int]], slot: float, jobs: int, period: float, rounds: int
) -> dict[str, Any]:
    """Seconds from its slot to its arrival, for every message of the
    measured rounds, taking the queue as first in, first out by round (the
    ``n``-th message belongs to round ``n // jobs``): percentiles and how
    many arrived more than 2 s after their slot."""
    late = late_seconds(timeline, slot, jobs, period, rounds)
    if not late:
        return {}
    return {"messages": len(late), **common.lateness_stats(late)}


def late_seconds(
    timeline: Sequence[tuple[float, int]], slot: float, jobs: int, period: float, rounds: int
) -> list[float]:
    """Each message's seconds after its round's slot, in arrival order
    (milliseconds kept: the figures' raw data)."""
    late: list[float] = []
    seen = 0
    for at, count in timeline:
        for n in range(seen, min(count, jobs * rounds)):
            late.append(round(at - (slot + (n // jobs) * period), 3))
        seen = max(seen, count)
    return late


def arrival_timeline(reader: Reader) -> list[tuple[float, int]]:
    """``(read time, messages read by then)`` at each read of ``reader``."""
    timeline, total = [], 0
    for at, items in reader.batches:
        total += len(items)
        timeline.append((at, total))
    return timeline


def choose_slot(run: Run, ready_at: float, fixed: float | None) -> float:
    """The first measured slot: ``fixed`` (Celery, redbeat), else the first
    multiple of the period at least 3 s after set-up, moved on a period while
    messages of an earlier round (start-up catch-up) still arrive."""
    period = run.period
    slot = fixed if fixed is not None else math.ceil((ready_at + 3) / period) * period
    for _ in range(3):  # bounded: at most three periods of waiting
        time.sleep(max(0.0, slot - LEAD_S - 0.7 - time.time()))
        before = run.length()
        time.sleep(0.5)
        if run.length() == before or fixed is not None:
            return slot
        slot += period
    return slot


def measure(
    cfg: Config, args: argparse.Namespace, index: int, profile_dir: Path | None
) -> dict[str, Any]:
    jobs = args.rabbit_jobs if cfg.backend == "rabbitmq" else args.jobs
    period, rounds = args.period, args.rounds
    tag = f"{common.RUN_ID}-{index}"
    folder = Path(tempfile.mkdtemp(prefix="anarchon-bench-burst-"))
    broker = redis.Redis.from_url(common.BROKER_URL)
    run = Run(cfg, jobs, period, folder, f"bench-{tag}", broker)
    result: dict[str, Any] = {"config": cfg.label, "jobs": jobs, "period": period}
    try:
        with claim_backend(cfg, tag) as backend_url, celery_broker(cfg, tag) as broker_url:
            run.broker_url = broker_url
            fixed = None
            if cfg.kind != "anarchon":
                allowance = args.setup_allowance
                if allowance is None:
                    allowance = (3 if cfg.kind == "publish" else 8) + jobs / 1000 * 2
                fixed = math.ceil((time.time() + allowance) / period) * period
            else:
                wait_for_launch(period, args.max_late)
            run.start(backend_url, fixed or 0.0, tag, args)
            startup = run.wait_ready(timeout=120 + jobs / 100)
            result["startup_s"] = startup
            reader = run.reader = reader_for(broker_url, run.queue)
            reader.start()
            slot = choose_slot(run, run.launched + startup, fixed)
            if time.time() > slot - LEAD_S:
                result["error"] = f"set-up took {startup:.1f} s, past the first slot"
                return result
            time.sleep(max(0.0, slot - LEAD_S - time.time()))
            reader.reset()
            cpu0, servers0 = run.cpu(), common.server_cpu_seconds()
            spy = start_profile(run, profile_dir, period, cfg, index) if profile_dir else None
            _, cpu_rounds = watch(run, slot, jobs, rounds, args.wait)
            cpu1, servers1 = run.cpu(), common.server_cpu_seconds()
            if spy is not None:
                stop_profile(spy)
            time.sleep(1.0)
            run.stop()
            reader.finish(quiet_s=1.0)
            if reader.error is not None:
                raise reader.error
            timeline = arrival_timeline(reader)
            result.update(summarise(timeline, slot, jobs, period, rounds))
            result["lateness"] = lateness(timeline, slot, jobs, period, rounds)
            result["late_s"] = late_seconds(timeline, slot, jobs, period, rounds)
            result["cpu_s"] = sum(cpu1) - sum(cpu0)
            # Redis is also the broker: its CPU counts the publishes of every
            # configuration; PostgreSQL's only the claims of its own.
            result["server_cpu_s"] = {
                name: servers1[name] - servers0.get(name, 0.0)
                for name in servers1
                if name in ("redis", "postgresql")
                or name == cfg.backend
                or (name == "rabbitmq" and cfg.broker != "redis")
            }
            result["cpu_per_round_s"] = cpu_rounds
            result["cpu_by_process_s"] = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
            headers = [h for _, h in reader.messages()]
            result.update(verify(cfg, headers, slot, jobs, period, rounds))
            if cfg.kind == "anarchon":
                result["sent_by_instance"] = sent_by_instance(folder, slot, period, rounds)
            if cfg.backend == "rabbitmq" and backend_url is not None:
                result["declare_floor_s"] = rabbit_floor(backend_url, jobs)
            result["slot"] = slot
            return result
    except Exception as exc:  # a failed run is reported, the others go on
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{cfg.label}: {result['error'][:2000]}")
        return result
    finally:
        run.stop()
        if run.reader is not None and run.reader.is_alive():
            run.reader.halt.set()
        clean_broker(broker, run.queue)
        broker.close()
        if cfg.kind == "redbeat":
            client = redis.Redis.from_url(common.REDIS_URL)
            common.redis_delete(client, f"anarchon-bench-{tag}-redbeat:*")
            client.close()
        if args.keep_logs:
            log(f"logs kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


def watch(
    run: Run, slot: float, jobs: int, rounds: int, wait: float
) -> tuple[list[tuple[float, int]], list[float]]:
    """Poll the queue length until every round arrived or the deadline:
    ``(time, length)`` at each change, and CPU seconds per round."""
    period = run.period
    deadline = slot + (rounds - 1) * period + max(period, wait)
    timeline: list[tuple[float, int]] = []
    cpu_marks = [sum(run.cpu())]
    last = -1
    while time.time() < deadline:
        count = run.length()
        now = time.time()
        if count != last:
            timeline.append((now, count))
            last = count
            while len(cpu_marks) <= rounds and count >= jobs * len(cpu_marks):
                cpu_marks.append(sum(run.cpu()))
        if count >= jobs * rounds:
            break
        time.sleep(POLL_S)
    per_round = [b - a for a, b in zip(cpu_marks, cpu_marks[1:], strict=False)]
    return timeline, per_round


def summarise(
    timeline: Sequence[tuple[float, int]], slot: float, jobs: int, period: float, rounds: int
) -> dict[str, Any]:
    """Per round: seconds from the slot until the queue held 50/90/99/100 %
    of the round, and how many of the round arrived within one period."""
    out: list[dict[str, Any]] = []
    for k in range(rounds):
        start = slot + k * period
        base = k * jobs
        row: dict[str, Any] = {}
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("done", 1.0)):
            at = first_at(timeline, base + max(1, math.ceil(q * jobs)))
            row[name] = None if at is None else at - start
        row["within_period"] = max(0, min(jobs, count_at(timeline, start + period) - base))
        out.append(row)
    final = timeline[-1][1] if timeline else 0
    return {"rounds": out, "messages_seen": final}


def verify(
    cfg: Config,
    headers: Sequence[dict[str, Any]],
    slot: float,
    jobs: int,
    period: float,
    rounds: int,
) -> dict[str, Any]:
    """Exactly once: every ``(job, slot)`` of the measured rounds appears
    once in the queue (anarchon headers); other schedulers: counts only."""
    if cfg.kind not in ("anarchon", "publish"):
        return {"messages": len(headers)}
    from .bench_app import job_name

    wanted = {
        (job_name(i), int(round((slot + k * period) * 1000)))
        for i in range(jobs)
        for k in range(rounds)
    }
    seen = Counter((h.get("anarchon_job"), int(h.get("anarchon_slot") or 0)) for h in headers)
    in_rounds = {key: n for key, n in seen.items() if key in wanted}
    return {
        "messages": len(headers),
        "expected_slots": len(wanted),
        "slots_sent": len(in_rounds),
        "missing": len(wanted) - len(in_rounds),
        "duplicates": sum(n - 1 for n in in_rounds.values() if n > 1),
        "other_slots": sum(n for key, n in seen.items() if key not in wanted),
        "exactly_once": len(in_rounds) == len(wanted) and all(n == 1 for n in in_rounds.values()),
    }


_SENT = re.compile(r"anarchon: sent \S+ @ (\S+) ")


def sent_by_instance(folder: Path, slot: float, period: float, rounds: int) -> list[int]:
    """Slots of the measured rounds each instance logged as sent."""
    wanted = {
        datetime.fromtimestamp(slot + k * period, timezone.utc)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
        for k in range(rounds)
    }
    counts = []
    for path in sorted(folder.glob("beat-*.log"), key=lambda p: int(p.stem.split("-")[1])):
        text = path.read_text(errors="replace")
        counts.append(sum(1 for m in _SENT.finditer(text) if m.group(1) in wanted))
    return counts


def rabbit_floor(url: str, count: int) -> float:
    """Seconds to declare ``count`` new gate queues, pipelined over the
    backend's number of channels (the declare-only floor)."""
    from .claims import RabbitFloor

    vhost = url.rsplit("/", 1)[1]
    floor = RabbitFloor(vhost, "floor.")
    try:
        started = time.perf_counter()
        floor.batch([str(i) for i in range(count)])
        return time.perf_counter() - started
    finally:
        floor.close()


# -- profiling ---------------------------------------------------------------------


def start_profile(
    run: Run, folder: Path | None, period: float, cfg: Config, index: int
) -> subprocess.Popen[bytes] | None:
    """py-spy on the first beat process over the first round (raw stacks,
    idle frames included so that waits on the network show)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if folder is None or not Path(spy).exists():
        log("py-spy not found: pip install py-spy (no profile taken)")
        return None
    folder.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^\w]+", "-", cfg.label)
    out = folder / f"{index:02d}-{name}.txt"
    return subprocess.Popen(
        [
            spy,
            "record",
            "--pid",
            str(run.procs[0].pid),
            "--duration",
            str(int(max(2, min(period - 2, 30)))),
            "--rate",
            "200",
            "--format",
            "raw",
            "--idle",
            "--nonblocking",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_profile(spy: subprocess.Popen[bytes]) -> None:
    """Stop py-spy early the way Ctrl-C does (SIGINT: it writes what it has)."""
    if spy.poll() is None:
        spy.send_signal(signal.SIGINT)
    try:
        spy.wait(60)
    except subprocess.TimeoutExpired:
        common.stop_process(spy)


# -- report ------------------------------------------------------------------------


def _secs(values: Sequence[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "not reached"
    text = common.fmt(common.spread(known), 2)
    missing = len(values) - len(known)
    return text + (f" [{missing} run(s) not reached]" if missing else "")


def _late(runs: Sequence[dict[str, Any]]) -> str:
    known = [r["lateness"] for r in runs if r.get("lateness")]
    if not known:
        return "-"
    p99 = common.spread([k["p99"] for k in known])["median"]
    worst = max(k["max"] for k in known)
    over = max(k["over_2s"] for k in known)
    return f"{p99:.2f} / {worst:.2f}, {over}"


def _server_cpu(runs: Sequence[dict[str, Any]]) -> str:
    """Median CPU seconds per round of each local server, e.g. ``redis
    4.10, postgresql 6.02``."""
    names = sorted({n for r in runs for n in r.get("server_cpu_s", {})})
    parts = []
    for name in names:
        per_round = [
            r["server_cpu_s"][name] / max(1, len(r["rounds"]))
            for r in runs
            if name in r.get("server_cpu_s", {})
        ]
        parts.append(f"{name} {common.spread(per_round)['median']:.2f}")
    return ", ".join(parts) or "-"


def _range(values: Sequence[int]) -> str:
    return f"{min(values)}-{max(values)}" if values else "-"


def report(results: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    by_config: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_config.setdefault(r["config"], []).append(r)
    rows = []
    redbeat_done = [r["rounds"][0]["done"] for r in by_config.get("redbeat", []) if "rounds" in r]
    for label, runs in by_config.items():
        good = [r for r in runs if "rounds" in r]
        errors = [r["error"] for r in runs if "error" in r]
        if not good:
            rows.append(
                [
                    label,
                    runs[0]["jobs"],
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    errors[0][:80],
                ]
            )
            continue
        first = [r["rounds"][0] for r in good]
        later = [r["rounds"][-1] for r in good]
        cpu = [r["cpu_s"] / max(1, len(r["rounds"])) for r in good]
        server = _server_cpu(good)
        once = [r.get("exactly_once") for r in good]
        split = good[-1].get("sent_by_instance")
        rows.append(
            [
                label,
                good[0]["jobs"],
                _secs([f["p50"] for f in first]),
                _secs([f["p99"] for f in first]),
                _secs([f["done"] for f in first]),
                _range([f["within_period"] for f in first]),
                _secs([r["done"] for r in later]),
                common.fmt(common.spread(cpu), 2),
                server,
                _late(good),
                "-" if once[0] is None else f"{sum(bool(o) for o in once)}/{len(once)}",
                (f"split {split}; " if split else "")
                + (f"{len(errors)} failed run(s)" if errors else ""),
            ]
        )
    headers = [
        "configuration",
        "jobs",
        "round 1 p50 (s)",
        "round 1 p99 (s)",
        "round 1 done (s)",
        "round 1 within a period",
        f"round {args.rounds} done (s)",
        "CPU s per round (all processes)",
        "server CPU s per round",
        "all rounds: lateness p99 / max (s), > 2 s",
        "exactly once",
        "notes",
    ]
    lines = [
        f"Burst: jobs every {args.period:g} s, all due together, {args.rounds} round(s) "
        f"measured, {args.repeats} repeat(s); seconds after the slot, median over repeats "
        "(min-max). Celery's broker: Redis unless the configuration names RabbitMQ.",
        "",
        common.table(headers, rows),
    ]
    if redbeat_done:
        lines += ["", "Round 1 done relative to redbeat's (same run):"]
        for label, runs in by_config.items():
            good = [r for r in runs if "rounds" in r and r["rounds"][0]["done"] is not None]
            ratios = []
            for r in good:
                peer = [
                    x
                    for x in by_config.get("redbeat", [])
                    if x.get("repeat") == r.get("repeat") and "rounds" in x
                ]
                if peer and peer[0]["rounds"][0]["done"]:
                    ratios.append(r["rounds"][0]["done"] / peer[0]["rounds"][0]["done"])
            if ratios:
                lines.append(f"- {label}: {common.fmt(common.spread(ratios), 2)}")
    for label, runs in by_config.items():
        floors = [r for r in runs if r.get("declare_floor_s") and "rounds" in r]
        if floors:
            ratios = [
                r["rounds"][0]["done"] / r["declare_floor_s"]
                for r in floors
                if r["rounds"][0]["done"]
            ]
            lines.append(
                f"- {label}: declare-only floor for {floors[0]['jobs']} gates "
                f"{common.fmt(common.spread([r['declare_floor_s'] for r in floors]), 2)} s; "
                f"round 1 / floor {common.fmt(common.spread(ratios), 2) if ratios else '-'}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.burst", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--rabbit-jobs", type=int, default=1_000, help="jobs on RabbitMQ")
    parser.add_argument("--period", type=float, default=60.0, help="seconds")
    parser.add_argument("--rounds", type=int, default=1, help="rounds measured per run")
    parser.add_argument(
        "--max-late",
        type=float,
        default=50.0,
        help="anarchon_max_late, seconds; below period - 10, instances start clean",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--jitters", default="2", help="anarchon_jitter values, seconds")
    parser.add_argument(
        "--wait", type=float, default=90.0, help="longest wait after the last round's slot"
    )
    parser.add_argument(
        "--setup-allowance",
        type=float,
        default=None,
        help="seconds the baselines (publish floor, celery, redbeat) get to start before "
        "their slot; default 3 (publish) or 8, plus 2 per 1,000 jobs",
    )
    parser.add_argument("--profile", help="folder for py-spy profiles of the first instance")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--json", help="write raw results to this file")
    args = parser.parse_args(argv)
    common.exit_on_sigterm()
    jitters = [float(j) for j in args.jitters.split(",") if j.strip()]
    configs = parse_configs(args.configs, jitters)
    if any(c.kind == "redbeat" for c in configs) and not redbeat_installed():
        log("celery-redbeat is not installed: pip install celery-redbeat (redbeat skipped)")
        configs = [c for c in configs if c.kind != "redbeat"]
    if not common.service_up("redis"):
        log("the burst benchmark needs Redis on 127.0.0.1:6379 (the broker)")
        return 2
    usable = []
    for cfg in configs:
        service = common.BACKEND_SERVICE.get(cfg.backend or "redis")
        if common.service_up(service):
            usable.append(cfg)
        else:
            log(f"{cfg.label}: {service} not running, skipped")
    print(common.header("Burst"))
    results = []
    index = 0
    profile_dir = Path(args.profile) if args.profile else None
    for repeat in range(args.repeats):
        for cfg in usable:
            index += 1
            log(f"repeat {repeat + 1}/{args.repeats}: {cfg.label}")
            profile = profile_dir if repeat == 0 else None
            result = measure(cfg, args, index, profile)
            result["repeat"] = repeat
            results.append(result)
            brief = {
                k: v
                for k, v in result.items()
                if k in ("rounds", "cpu_s", "exactly_once", "error", "sent_by_instance")
            }
            log(f"  {json.dumps(brief, default=str)[:400]}")
    print(report(results, args))
    if profile_dir:
        from .profile import summarise_folder

        print(summarise_folder(profile_dir))
    common.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
