"""The operator web page's render cost: how long a page takes to render, and
how many backend round trips it makes, at 1,000, 10,000 and 100,000 jobs.

    python -m bench.web [--sizes 1000,10000,100000] [--backends redis,postgresql,sqlite]
        [--history 2] [--repeats 5] [--json PATH]
    python -m bench.web --quick       # 100 and 1,000 jobs, one render each

For each backend and size, the benchmark stores a fresh set of jobs under a
run-unique prefix: half ``beat_schedule`` entries (code), half stored jobs
(written with ``write_stored_many``, as ``celery anarchon add`` would one at
a time), one job in 10 on a cron, one in 100 paused. Each job gets
``--history`` runs sent in the last hour (claimed and marked ``sent``), and
one job in 20 a miss as well. Then it builds the page
(:func:`celery_anarchon.web.create_app`, read only) and renders, through
Flask's test client in this process (no HTTP, no browser: the server-side
cost alone):

* **Jobs**: ``/jobs``, the first page of 50 sorted by name;
* **Jobs, filtered**: ``/jobs?state=trouble-24h`` (a miss, loss or failure
  in the last 24 h): reads the recent history of every job first;
* **Job**: ``/jobs/NAME`` of one job (its definition, charts, history);
* **Cluster**: ``/``, whose last hour's totals read every job's history.

Each page is rendered once to warm up (the first render opens the backend),
then ``--repeats`` times; the figure is the median wall time. The round
trips of one render are counted at the driver: SQLAlchemy's
``before_cursor_execute`` events (one per SQL statement) on SQL backends;
``Redis.execute_command`` calls (one per command outside a pipeline) plus
``Pipeline.execute`` calls (one per pipeline) on Redis.

Everything written is removed at the end (keys of the prefix, tables of the
prefix, the SQLite file's folder).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import common
from .common import log

PAGES = {
    "Jobs": "/jobs",
    "Jobs, filtered": "/jobs?state=trouble-24h",
    "Job": "/jobs/{job}",
    "Cluster": "/",
}

#: Stored writes and claims per backend call while seeding.
CHUNK = 1000

HOUR_MS = 3600_000


def backend_url(kind: str, size: int, folder: Path) -> tuple[str, str]:
    """A fresh backend URL of ``kind`` for ``size`` jobs, and its prefix."""
    prefix = f"bw{common.RUN_ID}_{size}_"
    if kind == "redis":
        return f"{common.REDIS_URL}?prefix=anarchon-bench-web:{common.RUN_ID}:{size}:", prefix
    if kind == "postgresql":
        return f"{common.POSTGRES_URL}?prefix={prefix}", prefix
    if kind == "sqlite":
        return f"sqlite:///{folder / f'web-{size}.db'}", prefix
    raise SystemExit(f"unknown backend {kind!r}: redis, postgresql or sqlite")


def job_name(i: int) -> str:
    return f"tenant-{i % 97:02d}.job-{i:06d}"


def schedule_of(i: int) -> Any:
    return "*/5 * * * *" if i % 10 == 0 else 60.0


def code_schedule(size: int) -> dict[str, dict[str, Any]]:
    """The ``beat_schedule`` half: the even-numbered jobs."""
    return {
        job_name(i): {"task": "bench.noop", "schedule": schedule_of(i)} for i in range(0, size, 2)
    }


def seed(url: str, size: int, history: int) -> dict[str, float]:
    """Store the odd-numbered jobs, pause one job in 100, and write the
    history; seconds each part took."""
    from celery_anarchon.backends import backend_from_url
    from celery_anarchon.backends.base import AbsentRecord, ClaimRequest, State
    from celery_anarchon.backends.store import JOB, PAUSE, StoredWrite
    from celery_anarchon.stored import Definition, Pause

    backend = backend_from_url(url, instance="bench-web-seeder")
    backend.open()
    took: dict[str, float] = {}
    try:
        started = time.perf_counter()
        writes = [
            StoredWrite(
                JOB,
                job_name(i),
                Definition.build(job_name(i), "bench.noop", schedule_of(i)).body(),
                exists=False,
            )
            for i in range(1, size, 2)
        ]
        writes += [
            StoredWrite(PAUSE, job_name(i), Pause(job_name(i), True, "bench").body())
            for i in range(0, size, 100)
        ]
        for i in range(0, len(writes), CHUNK):
            backend.write_stored_many(writes[i : i + CHUNK])  # type: ignore[attr-defined]
        took["stored"] = time.perf_counter() - started

        started = time.perf_counter()
        now = backend.now_ms()
        minute = now - now % 60_000
        slots = [minute - (k + 1) * 60_000 for k in range(history)]
        requests = [
            ClaimRequest(
                job_name(i),
                slot,
                window_before_ms=2 * HOUR_MS,
                window_after_ms=10_000,
                keep_until_ms=slot + 2 * HOUR_MS,
            )
            for i in range(size)
            for slot in slots
        ]
        for i in range(0, len(requests), CHUNK):
            claims = backend.claim(requests[i : i + CHUNK])
            backend.mark_many([c for c in claims if c.won], State.SENT)
        missed = [
            AbsentRecord(job_name(i), minute - 30 * 60_000, State.MISSED, "bench: no instance")
            for i in range(0, size, 20)
        ]
        for i in range(0, len(missed), CHUNK):
            backend.record_many_if_absent(missed[i : i + CHUNK])
        took["history"] = time.perf_counter() - started
    finally:
        backend.close()
    return took


@contextmanager
def counting(kind: str, backend: Any) -> Iterator[list[int]]:
    """A one-element list counting the backend's round trips while the
    block runs (see the module docstring)."""
    count = [0]
    if kind == "redis":
        import redis

        patched: list[tuple[Any, str, Any]] = []
        for cls, attr in ((redis.Redis, "execute_command"), (redis.client.Pipeline, "execute")):
            original = cls.__dict__[attr]

            def wrapped(self: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
                count[0] += 1
                return _original(self, *args, **kw)

            setattr(cls, attr, wrapped)
            patched.append((cls, attr, original))
        try:
            yield count
        finally:
            for cls, attr, original in patched:
                setattr(cls, attr, original)
    else:
        import sqlalchemy as sa

        def counted(*args: Any) -> None:
            count[0] += 1

        engine = backend._engine
        sa.event.listen(engine, "before_cursor_execute", counted)
        try:
            yield count
        finally:
            sa.event.remove(engine, "before_cursor_execute", counted)


def render_all(kind: str, url: str, size: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Each page's median render time (ms) and round trips of one render."""
    from celery import Celery

    from celery_anarchon.web import create_app

    app = Celery("benchweb", broker="memory://")
    app.conf.update(
        timezone="UTC",
        task_ignore_result=True,
        anarchon_backend=url,
        beat_schedule=code_schedule(size),
    )
    started = time.perf_counter()
    web = create_app(app)
    built_s = time.perf_counter() - started
    shared = web.extensions["anarchon"]
    client = web.test_client()
    found: dict[str, dict[str, Any]] = {"_app": {"create_app_s": built_s}}
    for page, path in PAGES.items():
        path = path.format(job=job_name(size // 2 + 1))
        try:
            check(client.get(path), path)  # warm up; the first render opens the backend
            with counting(kind, shared.control.backend) as trips:
                check(client.get(path), path)
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                check(client.get(path), path)
                times.append((time.perf_counter() - started) * 1000)
        except RuntimeError as exc:
            log(f"  {kind} {size}: {page}: {exc}")
            found[page] = {"error": str(exc)}
            continue
        found[page] = {
            "ms": statistics.median(times),
            "min_ms": min(times),
            "max_ms": max(times),
            "round_trips": trips[0],
        }
        log(f"  {kind} {size}: {page}: {found[page]['ms']:.1f} ms, {trips[0]} round trip(s)")
    shared.control.close()
    return found


def check(response: Any, path: str) -> None:
    """Raises RuntimeError, with the banner's text, when a page did not
    render as it should."""
    import re

    body = response.get_data(as_text=True)
    banner = re.search(r'id="banner"[^>]*>([^<]*)<', body)
    if response.status_code != 200 or banner:
        why = banner.group(1) if banner else body[:500]
        raise RuntimeError(f"{path}: HTTP {response.status_code}: {why}")


def clean(kind: str, url: str, prefix: str) -> None:
    if kind == "redis":
        import redis

        client = redis.Redis.from_url(common.REDIS_URL)
        common.redis_delete(client, f"*anarchon-bench-web:{common.RUN_ID}:*")
        client.close()
    elif kind == "postgresql":
        common.drop_sql_tables(common.POSTGRES_URL, prefix)


def run(kind: str, sizes: Sequence[int], history: int, repeats: int) -> list[dict[str, Any]]:
    folder = Path(tempfile.mkdtemp(prefix="bench-web-"))
    results = []
    try:
        for size in sizes:
            url, prefix = backend_url(kind, size, folder)
            log(f"{kind}: seeding {size} jobs")
            try:
                took = seed(url, size, history)
                log(f"  seeded in {took['stored']:.1f} s (stored) + {took['history']:.1f} s")
                pages = render_all(kind, url, size, repeats)
                results.append({"backend": kind, "jobs": size, "seed_s": took, "pages": pages})
            finally:
                clean(kind, url, prefix)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return results


def report(results: Sequence[dict[str, Any]], sizes: Sequence[int]) -> str:
    """One row per backend and page; per size, the median ms and the
    round trips of one render."""
    headers = ["backend", "page"] + [f"{size:,} jobs: ms / round trips" for size in sizes]
    rows = []
    for kind in dict.fromkeys(r["backend"] for r in results):
        by_size = {r["jobs"]: r["pages"] for r in results if r["backend"] == kind}
        for page in PAGES:
            cells = []
            for size in sizes:
                found = by_size.get(size, {}).get(page)
                if found is None:
                    cells.append("-")
                elif "error" in found:
                    cells.append("banner")
                else:
                    cells.append(f"{found['ms']:.1f} / {found['round_trips']}")
            rows.append([kind, page, *cells])
    return common.table(headers, rows)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (``/proc/loadavg``)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--backends", default="redis,postgresql,sqlite")
    parser.add_argument("--history", type=int, default=2, help="runs per job (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed renders per page")
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 jobs, 1 render")
    parser.add_argument("--json", help="save the raw results here")
    args = parser.parse_args(argv)
    common.exit_on_sigterm()
    sizes = [100, 1000] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeats = 1 if args.quick else args.repeats
    kinds = [k for k in args.backends.split(",") if k]
    before = load_average()
    log(f"load average before: {before}")
    results = []
    for kind in kinds:
        if not common.service_up(common.BACKEND_SERVICE[kind]):
            print(f"{kind}: not running, skipped", file=sys.stderr)
            continue
        results += run(kind, sizes, args.history, repeats)
    print(common.header("The web page's render cost"))
    after = load_average()
    print(f"load average (/proc/loadavg): before {before}; after {after}\n")
    print(report(results, sizes))
    common.write_json(args.json, {"sizes": sizes, "load": [before, after], "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
