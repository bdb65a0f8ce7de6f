"""Shared helpers of the benchmarks: service URLs, statistics, machine and
service versions, process CPU and memory from ``/proc``, clean-up.

Every benchmark talks to services on 127.0.0.1 only, names everything it
creates with a run-unique prefix (:data:`RUN_ID`) and removes it at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

REDIS_URL = os.environ.get("ANARCHON_BENCH_REDIS", "redis://127.0.0.1:6379/0")
#: Celery broker for the burst benchmark (a database of its own).
BROKER_URL = os.environ.get("ANARCHON_BENCH_BROKER", "redis://127.0.0.1:6379/3")
POSTGRES_URL = os.environ.get(
    "ANARCHON_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test"
)
MYSQL_URL = os.environ.get("ANARCHON_BENCH_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test")
RABBIT_HOST = "127.0.0.1:5672"

#: Run-unique tag in every key, table, queue and vhost a benchmark creates.
RUN_ID = uuid.uuid4().hex[:8]

#: service -> (host, port).
SERVICES = {
    "postgresql": ("127.0.0.1", 5432),
    "mysql": ("127.0.0.1", 3306),
    "redis": ("127.0.0.1", 6379),
    "rabbitmq": ("127.0.0.1", 5672),
}

#: backend name -> the service it needs (None: none).
BACKEND_SERVICE = {
    "sqlite": None,
    "postgresql": "postgresql",
    "mysql": "mysql",
    "redis": "redis",
    "rabbitmq": "rabbitmq",
}


def service_up(name: str | None) -> bool:
    """True when ``name``'s TCP port on 127.0.0.1 accepts a connection."""
    if name is None:
        return True
    try:
        with socket.create_connection(SERVICES[name], timeout=1):
            return True
    except OSError:
        return False


def log(message: str) -> None:
    """Progress to stderr (results go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- statistics ----------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def lateness_stats(late: Sequence[float]) -> dict[str, Any]:
    """Lateness of messages, seconds after their slot: ``p50``, ``p90``,
    ``p99``, ``max`` (None when there is none) and ``over_2s``, how many
    came more than 2 s late."""
    return {
        "p50": percentile(late, 50) if late else None,
        "p90": percentile(late, 90) if late else None,
        "p99": percentile(late, 99) if late else None,
        "max": max(late) if late else None,
        "over_2s": sum(1 for x in late if x > 2.0),
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of per-repeat figures."""
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def fmt(stats: dict[str, float], digits: int = 2, scale: float = 1.0) -> str:
    """``median (min-max)`` of :func:`spread` output."""
    med, lo, hi = (stats[k] * scale for k in ("median", "min", "max"))
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- machine, versions ---------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _dist(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def _git_state() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=False, timeout=10
        )
        return done.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "?"
    dirty = git("status", "--porcelain", "--", "celery_anarchon")
    return f"{head}{' + uncommitted changes in celery_anarchon/' if dirty else ''}"


def machine() -> dict[str, Any]:
    """The machine and library versions a result was measured with."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "celery": _dist("celery"),
        "kombu": _dist("kombu"),
        "redis-py": _dist("redis"),
        "sqlalchemy": _dist("sqlalchemy"),
        "psycopg": _dist("psycopg"),
        "pymysql": _dist("pymysql"),
        "amqp": _dist("amqp"),
        "celery-redbeat": _dist("celery-redbeat"),
        "celery-anarchon": _git_state(),
        "load_avg_at_start": os.getloadavg(),
    }


def service_versions() -> dict[str, str]:
    """The version of each service that is up."""
    found: dict[str, str] = {}
    if service_up("redis"):
        import redis

        with contextlib.suppress(Exception):
            found["redis"] = str(redis.Redis.from_url(REDIS_URL).info("server")["redis_version"])
    if service_up("postgresql"):
        import sqlalchemy as sa

        with contextlib.suppress(Exception):
            engine = sa.create_engine(_sa_url(POSTGRES_URL))
            with engine.connect() as conn:
                found["postgresql"] = str(conn.exec_driver_sql("SHOW server_version").scalar())
            engine.dispose()
    if service_up("mysql"):
        import sqlalchemy as sa

        with contextlib.suppress(Exception):
            engine = sa.create_engine(MYSQL_URL)
            with engine.connect() as conn:
                found["mysql"] = str(conn.exec_driver_sql("SELECT VERSION()").scalar())
            engine.dispose()
    if service_up("rabbitmq"):
        import amqp

        with contextlib.suppress(Exception):
            conn = amqp.Connection(RABBIT_HOST, userid="guest", password="guest")
            conn.connect()
            raw = conn.server_properties.get("version", b"?")
            found["rabbitmq"] = raw.decode() if isinstance(raw, bytes) else str(raw)
            conn.close()
    import sqlite3

    found["sqlite"] = sqlite3.sqlite_version
    return found


def _sa_url(url: str) -> str:
    """SQLAlchemy URL with the psycopg 3 driver for a plain PostgreSQL URL."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def header(title: str) -> str:
    """A results header: what, when, machine, services."""
    info = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "run_id": RUN_ID,
        "machine": machine(),
        "services": service_versions(),
    }
    return f"## {title}\n\n```\n{json.dumps(info, indent=1)}\n```\n"


# -- processes -------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # fields[11], fields[12]: utime, stime (fields 14 and 15 of proc(5)).
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds_exact(pid: int) -> float:
    """CPU seconds of every thread of process ``pid`` as the scheduler
    counts them (``se.sum_exec_runtime`` of ``/proc/<pid>/task/*/sched``,
    microseconds), or :func:`cpu_seconds` (10 ms steps) when the kernel
    does not show it. Threads that exited no longer count."""
    total, found = 0.0, False
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for line in (task / "sched").read_text().splitlines():
                if line.startswith("se.sum_exec_runtime"):
                    total += float(line.split(":", 1)[1]) / 1000.0  # ms
                    found = True
                    break
    return total if found else cpu_seconds(pid)


#: Server processes whose CPU a benchmark reports, by ``/proc/<pid>/comm``.
SERVER_PROCESSES = {
    "redis-server": "redis",
    "postgres": "postgresql",
    "mariadbd": "mysql",
    "beam.smp": "rabbitmq",
}


def server_cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by each local server (every process of it:
    PostgreSQL forks one per connection), keyed ``redis``, ``postgresql``,
    ``mysql``, ``rabbitmq``; a server not running here is absent. Compare
    two readings: a connection's process that exited between them no
    longer counts."""
    found: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        name = SERVER_PROCESSES.get(comm)
        if name is not None:
            found[name] = found.get(name, 0.0) + cpu_seconds(int(entry.name))
    return found


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of ``pid`` (default: this process), bytes."""
    path = Path(f"/proc/{pid or 'self'}/status")
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def stop_process(proc: subprocess.Popen[Any], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; waits for the exit."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# -- clean-up ----------------------------------------------------------------------


def redis_delete(client: Any, pattern: str, limit: int = 10_000_000) -> int:
    """Delete every key matching ``pattern`` (SCAN, bounded); returns how many."""
    deleted = 0
    batch: list[Any] = []
    for key in client.scan_iter(match=pattern, count=5000):
        batch.append(key)
        if len(batch) >= 5000:
            deleted += client.unlink(*batch)
            batch = []
        if deleted + len(batch) >= limit:
            break
    if batch:
        deleted += client.unlink(*batch)
    return int(deleted)


@contextlib.contextmanager
def rabbit_vhost(name: str) -> Iterator[str]:
    """A RabbitMQ vhost of our own (``guest`` may use it), deleted after.

    Needs ``rabbitmqctl`` on this host.
    """
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        raise RuntimeError("rabbitmqctl is not installed: cannot make a vhost for the benchmark")
    subprocess.run([ctl, "-q", "add_vhost", name], capture_output=True, check=False, timeout=60)
    subprocess.run(
        [ctl, "-q", "set_permissions", "-p", name, "guest", ".*", ".*", ".*"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    try:
        yield name
    finally:
        subprocess.run(
            [ctl, "-q", "delete_vhost", name], capture_output=True, check=False, timeout=300
        )


def rabbit_url(vhost: str) -> str:
    """AMQP URL of ``vhost`` on the local broker."""
    return f"amqp://guest:guest@{RABBIT_HOST}/{vhost}"


def drop_sql_tables(url: str, prefix: str) -> None:
    """Drop every table whose name starts with ``prefix`` (PostgreSQL, MySQL)."""
    import sqlalchemy as sa

    engine = sa.create_engine(_sa_url(url))
    try:
        names = [n for n in sa.inspect(engine).get_table_names() if n.startswith(prefix)]
        with engine.begin() as conn:
            for name in names:
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
    finally:
        engine.dispose()


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` so that clean-up (``finally``) runs:
    every process, key, table and queue a benchmark made is removed even when
    it is stopped early (SIGINT may be ignored in a background job)."""

    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def write_json(path: str | None, data: Any) -> None:
    """Save raw results when ``--json PATH`` was given."""
    if path:
        Path(path).write_text(json.dumps(data, indent=1, default=str))
        log(f"raw results in {path}")
