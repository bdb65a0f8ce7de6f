"""Benchmark 4: what each backend keeps per job at steady state.

    python -m bench.footprint [--backends redis,postgresql,mysql,sqlite,rabbitmq]
                              [--jobs 50] [--period 20] [--history-size 100]

For ``--jobs`` jobs every ``--period`` seconds, the benchmark plays the
scheduler's writes for every slot of the last ``history_size + 20`` periods
(oldest first, through the backend's own ``claim`` and ``mark(sent)``, with
the scheduler's claim windows and keep-until times), which is the state a
backend is in after running that long: history trimmed to ``history_size``,
claim records of the slots a late instance could still try
(``jitter + max_late + max_skew + 60 s`` = 132 s with the defaults) still
kept. Then it counts what is stored and its size:

* Redis: keys per job by kind, and ``MEMORY USAGE`` of each;
* PostgreSQL, MySQL, SQLite: rows per job, and the tables' size on disk
  (``pg_total_relation_size``; InnoDB ``data_length + index_length`` after
  ``ANALYZE``; SQLite pages after a checkpoint);
* RabbitMQ: gate queues alive per job (``slot_ttl / period``: only the gates
  of the last ``slot_ttl`` are claimed, others have expired at steady state),
  the memory of a gate queue, and each job's history stream (messages and
  the byte cap it is trimmed to).

"Written per job per day" is the size of one run's stored record times the
runs per day (``86400 / period``): the churn a backend absorbs, not growth.
Everything made is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend, ClaimRequest, State

from . import common
from .common import log

ALL = ["redis", "postgresql", "mysql", "sqlite", "rabbitmq"]

#: Defaults of the scheduler: jitter, max_late, max_skew, keep margin (ms).
JITTER_MS, MAX_LATE_MS, MAX_SKEW_MS, KEEP_MARGIN_MS = 2_000, 60_000, 10_000, 60_000
#: History periods played beyond history_size.
EXTRA_PERIODS = 20
#: RabbitMQ gate lifetime (the backend's default slot_ttl), seconds.
SLOT_TTL_S = 300


def request(job: str, slot_ms: int, now_ms: int, history_size: int) -> ClaimRequest:
    """The scheduler's request for ``slot_ms``, its window stretched back
    so that a past slot can be played now."""
    return ClaimRequest(
        job=job,
        slot_ms=slot_ms,
        window_before_ms=now_ms - slot_ms + MAX_LATE_MS + JITTER_MS,
        window_after_ms=MAX_SKEW_MS,
        keep_until_ms=slot_ms + JITTER_MS + MAX_LATE_MS + MAX_SKEW_MS + KEEP_MARGIN_MS,
        history_size=history_size,
    )


def play(backend: Backend, jobs: Sequence[str], slots: Sequence[int], history_size: int) -> int:
    """Claim and mark sent every slot of every job; returns runs written."""
    written = 0
    for slot in slots:
        now = time.time_ns() // 1_000_000
        claims = backend.claim([request(job, slot, now, history_size) for job in jobs])
        for claim in claims:
            if not claim.won:
                raise RuntimeError(f"slot {claim.slot_ms} of {claim.job} lost: {claim.reason}")
            backend.mark(claim, State.SENT, task_id=str(uuid.uuid4()))
            written += 1
    return written


def slots_to_play(period_s: float, count: int) -> list[int]:
    """The last ``count`` slots of a job every ``period_s``, oldest first."""
    period_ms = int(period_s * 1000)
    last = (time.time_ns() // 1_000_000) // period_ms * period_ms
    return [last - k * period_ms for k in range(count - 1, -1, -1)]


# -- per backend ---------------------------------------------------------------------


def redis_footprint(args: argparse.Namespace) -> dict[str, Any]:
    import redis

    prefix = f"anarchon-bench-{common.RUN_ID}-fp:"
    backend = backend_from_url(
        common.REDIS_URL, instance="bench:footprint", options={"prefix": prefix}
    )
    client = redis.Redis.from_url(common.REDIS_URL, decode_responses=True)
    jobs = [f"job-{i:04d}" for i in range(args.jobs)]
    try:
        backend.open()
        play(
            backend,
            jobs,
            slots_to_play(args.period, args.history_size + EXTRA_PERIODS),
            args.history_size,
        )
        kinds: Counter[str] = Counter()
        sizes: Counter[str] = Counter()
        for key in client.scan_iter(match="{" + prefix + "*", count=1000):
            kind = key.rsplit("}:", 1)[1].split(":", 1)[0]
            kinds[kind] += 1
            sizes[kind] += int(client.memory_usage(key, samples=0) or 0)
        runs = sum(int(client.hlen(f"{{{prefix}{job}}}:runs")) for job in jobs)
        total = sum(sizes.values())
        return {
            "stored": {k: kinds[k] / args.jobs for k in sorted(kinds)},
            "records_per_job": runs / args.jobs,
            "bytes_per_job": total / args.jobs,
            "bytes_by_kind_per_job": {k: sizes[k] / args.jobs for k in sorted(sizes)},
            "bytes_per_run": (sizes["runs"] + sizes["index"]) / max(1, runs),
            "what": "keys",
        }
    finally:
        backend.close()
        common.redis_delete(client, "{" + prefix + "*")
        client.close()


@contextlib.contextmanager
def sql_backend(name: str) -> Iterator[tuple[Backend, str, str]]:
    """An opened SQL backend of this run's own and its URL and table prefix."""
    prefix = f"anarchon_bench_{common.RUN_ID}_fp_"
    folder: Path | None = None
    if name == "sqlite":
        folder = Path(tempfile.mkdtemp(prefix="anarchon-bench-fp-"))
        url = f"sqlite:///{folder / 'footprint.db'}"
    else:
        url = common.POSTGRES_URL if name == "postgresql" else common.MYSQL_URL
    backend = backend_from_url(url, instance="bench:footprint", options={"prefix": prefix})
    try:
        backend.open()
        yield backend, url, prefix
    finally:
        backend.close()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            common.drop_sql_tables(url, prefix)


def sql_footprint(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import sqlalchemy as sa

    jobs = [f"job-{i:04d}" for i in range(args.jobs)]
    with sql_backend(name) as (backend, url, prefix):
        play(
            backend,
            jobs,
            slots_to_play(args.period, args.history_size + EXTRA_PERIODS),
            args.history_size,
        )
        engine = sa.create_engine(common._sa_url(url))
        try:
            with engine.begin() as conn:
                rows = {
                    table: int(
                        conn.exec_driver_sql(f"SELECT count(*) FROM {prefix}{table}").scalar_one()
                    )
                    for table in ("runs", "manual", "instances", "meta")
                }
                size = _sql_bytes(conn, name, prefix)
        finally:
            engine.dispose()
    return {
        "stored": {
            f"{t} rows": n / args.jobs for t, n in rows.items() if n and t in ("runs", "manual")
        },
        "records_per_job": rows["runs"] / args.jobs,
        "bytes_per_job": size / args.jobs,
        "bytes_per_run": size / max(1, rows["runs"]),
        "what": "rows",
    }


def _sql_bytes(conn: Any, kind: str, prefix: str) -> int:
    """Bytes on disk of the runs table and its indexes."""
    if kind == "postgresql":
        return int(conn.exec_driver_sql(f"SELECT pg_total_relation_size('{prefix}runs')").scalar())
    if kind == "mysql":
        conn.exec_driver_sql(f"ANALYZE TABLE {prefix}runs").all()
        return int(
            conn.exec_driver_sql(
                "SELECT data_length + index_length FROM information_schema.tables "
                f"WHERE table_schema = DATABASE() AND table_name = '{prefix}runs'"
            ).scalar()
        )
    conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").all()
    pages = int(conn.exec_driver_sql("PRAGMA page_count").scalar())
    free = int(conn.exec_driver_sql("PRAGMA freelist_count").scalar())
    page = int(conn.exec_driver_sql("PRAGMA page_size").scalar())
    return (pages - free) * page


def rabbit_footprint(args: argparse.Namespace) -> dict[str, Any]:
    jobs = [f"job-{i:04d}" for i in range(args.jobs)]
    gates_per_job = math.ceil(SLOT_TTL_S / args.period)
    with common.rabbit_vhost(f"anarchon-bench-{common.RUN_ID}-fp") as vhost:
        backend = backend_from_url(
            common.rabbit_url(vhost), instance="bench:footprint", options={"prefix": "fp."}
        )
        try:
            backend.open()
            play(backend, jobs, slots_to_play(args.period, gates_per_job), args.history_size)
        finally:
            backend.close()
        time.sleep(2)  # let the broker publish queue statistics
        queues = _rabbit_queues(vhost)
    gates = [q for q in queues if ".slot." in q["name"]]
    streams = [q for q in queues if q["name"].endswith(".history")]
    gate_memory = sorted(int(q["memory"]) for q in gates)
    median_gate = gate_memory[len(gate_memory) // 2] if gate_memory else 0
    from celery_anarchon.backends.rabbitmq import history_arguments

    cap = history_arguments(args.history_size, jobs[0])["x-max-length-bytes"]
    return {
        "stored": {
            "gate queues": len(gates) / args.jobs,
            "history streams": len(streams) / args.jobs,
        },
        "records_per_job": sum(int(q["messages"] or 0) for q in streams) / args.jobs,
        "bytes_per_job": median_gate * gates_per_job + cap,
        "gate_queue_memory_bytes": median_gate,
        "stream_cap_bytes": cap,
        "bytes_per_run": 2 * (400 + len(jobs[0])),
        "what": "queues",
        "note": "bytes: gate process memory x gates alive + history stream byte cap",
    }


def _rabbit_queues(vhost: str) -> list[dict[str, str]]:
    ctl = shutil.which("rabbitmqctl") or "rabbitmqctl"
    done = subprocess.run(
        [
            ctl,
            "-q",
            "list_queues",
            "-p",
            vhost,
            "name",
            "type",
            "messages",
            "memory",
            "--no-table-headers",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = []
    for line in done.stdout.splitlines():
        parts = line.split("\t")
        if len(parts) == 4:
            out.append(dict(zip(("name", "type", "messages", "memory"), parts, strict=True)))
    return out


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    if name == "redis":
        result = redis_footprint(args)
    elif name == "rabbitmq":
        result = rabbit_footprint(args)
    else:
        result = sql_footprint(name, args)
    runs_per_day = 86_400 / args.period
    result["backend"] = name
    result["written_per_job_per_day"] = result["bytes_per_run"] * runs_per_day
    return result


def report(results: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    rows = []
    for r in results:
        stored = ", ".join(f"{v:g} {k}" for k, v in r["stored"].items())
        rows.append(
            [
                r["backend"],
                stored,
                f"{r['records_per_job']:g}",
                f"{r['bytes_per_job'] / 1024:.1f}",
                f"{r['bytes_per_run']:.0f}",
                f"{r['written_per_job_per_day'] / 2**20:.2f}",
                r.get("note", ""),
            ]
        )
    return "\n".join(
        [
            f"Footprint per job at steady state: a job every {args.period:g} s, "
            f"history_size {args.history_size}, default windows ({args.jobs} jobs measured):",
            "",
            common.table(
                [
                    "backend",
                    "kept per job",
                    "history records per job",
                    "KiB per job",
                    "bytes per run",
                    "written MiB per job per day",
                    "note",
                ],
                rows,
            ),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.footprint", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--backends", default=",".join(ALL))
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--period", type=float, default=20.0, help="seconds")
    parser.add_argument("--history-size", type=int, default=100)
    parser.add_argument("--json", help="write raw results to this file")
    args = parser.parse_args(argv)
    common.exit_on_sigterm()
    print(common.header("Backend footprint"))
    results = []
    for name in (n.strip() for n in args.backends.split(",") if n.strip()):
        if name not in ALL:
            parser.error(f"unknown backend {name!r}; choose from {', '.join(ALL)}")
        if not common.service_up(common.BACKEND_SERVICE[name]):
            log(f"{name}: service not running on 127.0.0.1, skipped")
            continue
        log(f"{name}: playing {args.jobs} jobs")
        results.append(measure(name, args))
    print(report(results, args))
    common.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
