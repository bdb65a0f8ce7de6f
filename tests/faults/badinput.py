"""Bad input (issue 7, scenario 8): each case starts one real beat with a
mistake in it and checks for a clear error and no crash loop.

A case passes when the beat either exits at start-up (non-zero) with a
message that names the problem, or keeps running, says what is wrong, does
not flap between "unavailable" and "back" (each round logs the error anew
and restarts the backoff), and sends nothing it should not.
Cases whose input is not bad after all (RabbitMQ job names that are mapped
to safe queue names) pass when every job is sent, once a slot.
"""

from __future__ import annotations

import re
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..beat.support import UNSERIALIZABLE_ARGS
from ..beats import expected_slots
from ..conftest import POSTGRES_URL, REDIS_URL, service_up
from .campaign import Row, campaign_services
from .harness import FaultRun, free_port, rabbit_url, wait_until
from .servers import RedisServer

#: How long a bad beat is watched, seconds, from its Celery banner on.
WATCH_S = 6.0
#: How long a beat may take to print its banner (import Celery and the app;
#: 1 to 2 s on an idle machine, over 6 s with the whole suite on 2 cores).
STARTUP_S = 60.0
#: Celery prints this before beat's scheduler is set up (where a bad
#: setting stops it).
BANNER = b" is starting."
#: Slots of a healthy job count from this long after the start (the beat
#: starts and ticks) to this long before the stop.
SETTLE_S, TAIL_S = 3.0, 2.0


@dataclass(frozen=True)
class Case:
    """One bad input.

    Attributes:
        name: what is wrong.
        backend: the backend kind it is tried on.
        expect: ``"exit"`` (refused at start-up) or ``"runs"`` (keeps running).
        message: a regular expression the beat's log must match.
        conf: settings of the beat.
        url: ``(folder, run id) -> backend URL``; None: the backend's usual one.
        setup: ``(folder, run id) -> context manager`` run around the beat
            (a foreign table, a server with a password, ...).
        sends: ``None`` (anything), ``0`` (nothing may be sent), ``"all"``
            (every job sent, no slot twice) or a job name (every slot of
            that healthy job sent, once).
    """

    name: str
    backend: str
    expect: str
    message: str
    conf: dict[str, Any]
    url: Callable[[Path, str], str] | None = None
    setup: Callable[[Path, str], Any] | None = None
    sends: int | str | None = 0


@contextmanager
def nothing(folder: Path, run: str) -> Iterator[None]:
    yield


def schedule(**jobs: Any) -> dict[str, Any]:
    return {
        "beat_schedule": {name: {"task": "faults.run", "schedule": s} for name, s in jobs.items()}
    }


# -- setups -----------------------------------------------------------------------

_PASSWORD_SERVERS: dict[str, RedisServer] = {}


@contextmanager
def redis_with_password(folder: Path, run: str) -> Iterator[None]:
    with RedisServer(folder, password="right-password") as server:
        _PASSWORD_SERVERS[run] = server
        try:
            yield
        finally:
            _PASSWORD_SERVERS.pop(run, None)


def wrong_password_url(folder: Path, run: str) -> str:
    port = _PASSWORD_SERVERS[run].port
    return f"redis://:wrong-password@127.0.0.1:{port}/0?prefix=bad{run}:"


@contextmanager
def corrupt_redis_key(folder: Path, run: str) -> Iterator[None]:
    """``every-second``'s history hash is a plain string (another program's key)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    key = "{" + f"bad{run}:every-second" + "}:runs"
    client.set(key, "not ours")
    try:
        yield
    finally:
        client.delete(key)
        for k in client.scan_iter(match="{" + f"bad{run}:*", count=1000):
            client.delete(k)
        client.close()


def _pg(statements: Iterable[str]) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(
        POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1),
        connect_args={"connect_timeout": 3},
    )
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(sa.text(statement))
    finally:
        engine.dispose()


@contextmanager
def foreign_table(folder: Path, run: str) -> Iterator[None]:
    """A table with our runs table's name and other columns."""
    _pg([f"CREATE TABLE bad{run}_runs (id serial PRIMARY KEY, payload text)"])
    try:
        yield
    finally:
        _pg([f"DROP TABLE IF EXISTS bad{run}_{t}" for t in ("runs", "manual", "instances", "meta")])


@contextmanager
def foreign_row(folder: Path, run: str) -> Iterator[None]:
    """Our tables, with a row of an unknown state on ``every-second``'s next slots."""
    from celery_anarchon.backends import backend_from_url

    backend = backend_from_url(f"{POSTGRES_URL}?prefix=bad{run}_", instance="setup")
    backend.open()
    backend.close()
    now_s = int(time.time())
    keep_ms = (now_s + 600) * 1000
    rows = ", ".join(
        f"('every-second', {(now_s + k) * 1000}, 1, 'bogus', 'someone-else', {keep_ms})"
        for k in range(3, 6)
    )
    columns = "job, slot_ms, token, state, owner, keep_until_ms"
    _pg([f"INSERT INTO bad{run}_runs ({columns}) VALUES {rows}"])
    try:
        yield
    finally:
        _pg([f"DROP TABLE IF EXISTS bad{run}_{t}" for t in ("runs", "manual", "instances", "meta")])


@contextmanager
def role_without_create(folder: Path, run: str) -> Iterator[None]:
    """A login role that may connect to ``test`` but not create tables."""
    role = f"anarchon_nocreate_{run}"
    _pg([f"CREATE ROLE {role} LOGIN", f"REVOKE CREATE ON SCHEMA public FROM {role}"])
    try:
        yield
    finally:
        _pg([f"DROP OWNED BY {role}", f"DROP ROLE IF EXISTS {role}"])


# -- the cases ----------------------------------------------------------------------

BAD_INPUT: list[Case] = [
    Case(
        "unreachable backend",
        "redis",
        "runs",
        r"is unavailable",
        {},
        url=lambda f, r: f"redis://127.0.0.1:{free_port()}/0?prefix=bad{r}:",
    ),
    Case(
        "unknown URL scheme",
        "redis",
        "exit",
        r"unknown URL scheme 'reddis'.*Did you mean 'redis'",
        {},
        url=lambda f, r: "reddis://127.0.0.1:6379/0",
    ),
    Case(
        "wrong password",
        "redis",
        "exit",
        r"refused the credentials",
        {},
        url=wrong_password_url,
        setup=redis_with_password,
    ),
    Case(
        "wrong user",
        "postgresql",
        "exit",
        r'refused the credentials.*role "nobody_[0-9a-f]+" does not exist',
        {},
        url=lambda f, r: f"postgresql://nobody_{r}:x@127.0.0.1:5432/test?prefix=bad{r}_",
    ),
    Case(
        "wrong password",
        "rabbitmq",
        "exit",
        r"refused the login|ACCESS_REFUSED|credentials",
        {},
        url=lambda f, r: rabbit_url().replace("guest:guest", "guest:wrong") + f"?prefix=bad.{r}.",
    ),
    Case(
        "cron '0 0 31 2 *' (never fires)",
        "redis",
        "exit",
        r"0 0 31 2 \*",
        schedule(**{"feb-31": "0 0 31 2 *"}),
    ),
    Case(
        "cron 'every day at noon'",
        "redis",
        "exit",
        r"every day at noon",
        schedule(**{"prose": "every day at noon"}),
    ),
    Case(
        "6-field cron, second 61",
        "redis",
        "exit",
        r"\* \* \* \* \* 61",
        schedule(**{"second-61": "* * * * * 61"}),
    ),
    Case(
        "schedule of the wrong type",
        "redis",
        "exit",
        r"wrong-type",
        schedule(**{"wrong-type": [1, 2]}),
    ),
    Case(
        "entry without a task",
        "redis",
        "exit",
        r"beat_schedule\['taskless'\]: no 'task'; every entry needs a task",
        {"beat_schedule": {"taskless": {"schedule": 1.0}}},
    ),
    Case(
        "interval NaN",
        "redis",
        "exit",
        r"beat_schedule\['nan'\]\['schedule'\]: interval nan s is not a finite number",
        schedule(nan=float("nan")),
    ),
    Case(
        "interval 0.001 s (below the floor)",
        "redis",
        "exit",
        r"interval 0.001 s is below the floor of 0.1 s",
        schedule(tiny=0.001),
    ),
    Case(
        "args the serializer refuses",
        "redis",
        "runs",
        r"beat_schedule\['nonjson'\]: the serializer 'json' refuses its args",
        {
            # A task this app does not register: no argument check, the serializer's only.
            "beat_schedule": {
                name: {"task": "faults.any", "schedule": 1.0} for name in ("nonjson", "good")
            },
            UNSERIALIZABLE_ARGS: ["nonjson"],
        },
        sends="good",
    ),
    Case(
        "job names RabbitMQ queues cannot hold",
        "rabbitmq",
        "runs",
        r"sent",
        schedule(
            **{
                "proj.tasks.add(1, 2)": 1.0,
                "ünïcødé jöb": 1.0,
                "slash/and#hash*star": 1.0,
                "x" * 300: 1.0,
            }
        ),
        sends="all",
    ),
    Case(
        "jitter + max_late + max_skew >= slot_ttl",
        "rabbitmq",
        "exit",
        r"slot_ttl",
        {"anarchon_max_late": 60.0},
        url=lambda f, r: f"{rabbit_url()}?prefix=bad.{r}.&slot_ttl=30",
    ),
    Case(
        "foreign key where our history is",
        "redis",
        "runs",
        r"WRONGTYPE|claim failed|unavailable",
        schedule(**{"every-second": 1.0, "other": 1.0}),
        url=lambda f, r: f"{REDIS_URL}?prefix=bad{r}:",
        setup=corrupt_redis_key,
        sends="other",
    ),
    Case(
        "foreign table with our name",
        "postgresql",
        "exit",
        r"_runs lacks column\(s\) job.*prefix",
        {},
        url=lambda f, r: f"{POSTGRES_URL}?prefix=bad{r}_",
        setup=foreign_table,
    ),
    Case(
        "foreign row in our table",
        "postgresql",
        "runs",
        r"sent",
        schedule(**{"every-second": 1.0}),
        url=lambda f, r: f"{POSTGRES_URL}?prefix=bad{r}_",
        setup=foreign_row,
        sends=None,
    ),
    Case(
        "no permission to create tables",
        "postgresql",
        "runs",
        r"permission denied",
        {},
        url=lambda f, r: f"postgresql://anarchon_nocreate_{r}@127.0.0.1:5432/test?prefix=bad{r}_",
        setup=role_without_create,
    ),
]


def run_case(case: Case, folder: Path) -> Row:
    """Run one bad-input case; the row's notes say what was observed."""
    row = Row(f"bad input: {case.name}", case.backend)
    run_id = uuid.uuid4().hex[:8]
    conf = dict(case.conf)
    started = time.monotonic()
    setup = case.setup or nothing
    try:
        with setup(folder, run_id):
            url = case.url(folder, run_id) if case.url else None
            with FaultRun(case.backend, folder, conf=conf, url=url) as run:
                proc = run.cluster.start(1)[0]
                # Watch from the banner, not from the fork: under load the
                # imports alone can outlast the watch (a beat that was about
                # to refuse would read as "kept running").
                path = run.cluster.log_path(proc)
                wait_until(
                    lambda: (
                        proc.poll() is not None or (path.exists() and BANNER in path.read_bytes())
                    ),
                    STARTUP_S,
                    interval=0.2,
                )
                run.started_at = time.time()
                deadline = time.monotonic() + WATCH_S
                while time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.2)
                alive = proc.poll() is None
                run.stop()
                log = run.cluster.log_path(proc).read_text(errors="replace")
                published = Counter(
                    (h["anarchon_job"], int(h["anarchon_slot"])) for h in run.published()
                )
                jobs = set(run.cluster.conf.get("beat_schedule", {})) or set(run.schedules)
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {exc}"
        return row
    finally:
        row.seconds = round(time.monotonic() - started, 1)
    found = re.search(case.message, log, re.S)
    outages = log.count("is unavailable")
    observed = [
        "kept running" if alive else f"exited ({proc.returncode})",
        f"{sum(published.values())} sent",
    ]
    first_error = _first_error(log)
    if first_error:
        observed.append(f"says: {first_error}")
    if case.expect == "exit" and alive:
        row.failed.append("did not refuse to start")
    if case.expect == "exit" and not alive and proc.returncode == 0:
        row.failed.append("exited 0")
    if case.expect == "runs" and not alive:
        row.failed.append("crashed")
    if not found:
        row.failed.append(f"no message matching {case.message!r}")
    flaps = log.count("is back after")
    if flaps >= 2:
        # Unavailable, "back", unavailable again...: each round logs the
        # error anew and starts the backoff over, a retry loop in the log.
        row.failed.append(f"outage flapped {flaps} times in {WATCH_S:g} s ({outages} errors)")
    if case.sends == 0 and published:
        row.failed.append("sent although misconfigured")
    if isinstance(case.sends, str) and case.sends != "all":
        expected = expected_slots(
            {case.sends: 1.0}, run.started_at + SETTLE_S, run.stopped_at - TAIL_S
        )[case.sends]
        unsent = [s for s in expected if (case.sends, s) not in published]
        if unsent:
            row.failed.append(f"{len(unsent)} of {len(expected)} slots of the healthy job unsent")
    if case.sends == "all":
        missing = [j for j in jobs if not any(job == j for job, _ in published)]
        twice = [s for s, n in published.items() if n > 1]
        if missing:
            row.failed.append(f"never sent: {missing}")
        if twice:
            row.failed.append(f"sent twice: {twice}")
    row.notes.append("; ".join(observed))
    return row


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if re.search(r"ERROR|CRITICAL|Error:|error:", line) and "SecurityWarning" not in line:
            text = re.sub(r"^\[[^\]]*\]\s*", "", line).strip()
            return text[:300]
    return ""


def run_bad_input(backends: Iterable[str], log: Any = print) -> list[Row]:
    """Every bad-input case whose backend is in ``backends`` and running."""
    cases = [c for c in BAD_INPUT if c.backend in set(backends)]
    rows = []
    with campaign_services({c.backend for c in cases}), tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(cases):
            if not service_up(case.backend):
                rows.append(Row(f"bad input: {case.name}", case.backend, skipped="not running"))
                continue
            log(f"[bad input {i + 1}/{len(cases)}] {case.name} on {case.backend} ...")
            row = run_case(case, Path(tmp) / f"bad-{i:02d}")
            log(f"    {row.verdict()}  {' '.join(row.notes)}  ({row.seconds} s)")
            rows.append(row)
    return rows


__all__ = ["BAD_INPUT", "Case", "run_bad_input", "run_case"]
