"""SQLBackend beyond the shared contract: schema, processes racing for the
same slots, MySQL affected-row counting, the database clock, trimming,
takeover, timeouts and recovery; against real SQLite, PostgreSQL and MariaDB.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import select
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

from celery_anarchon.backends import backend_from_url, sql
from celery_anarchon.backends.base import Claim, ClaimRequest, InstanceInfo, State
from celery_anarchon.backends.sql import CLIENT_FOUND_ROWS, SCHEMA_VERSION, SQLBackend
from celery_anarchon.exceptions import BackendUnavailable, ConfigurationError

from ..conftest import MYSQL_URL, POSTGRES_URL, require_service

pytestmark = pytest.mark.services

HOUR_MS = 3600 * 1000
DAY_MS = 24 * HOUR_MS

Make = Callable[..., SQLBackend]


# -- fixtures ----------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql", "mysql"])
def kind(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_service(name)
    return name


@pytest.fixture
def url(kind: str, tmp_path: Path) -> str:
    return {
        "sqlite": f"sqlite:///{tmp_path / 'claims.db'}",
        "postgresql": POSTGRES_URL,
        "mysql": MYSQL_URL,
    }[kind]


def engine_for(url: str, **kw: Any) -> sa.Engine:
    """A plain SQLAlchemy engine on the test database (not the backend's)."""
    return sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1), **kw)


@pytest.fixture
def raw(url: str) -> Iterator[sa.Engine]:
    engine = engine_for(url)
    yield engine
    engine.dispose()


@pytest.fixture
def prefix(raw: sa.Engine) -> Iterator[str]:
    """A table prefix of this test's own; its tables are dropped after."""
    name = f"s{uuid.uuid4().hex[:8]}_"
    yield name
    with raw.begin() as conn:
        for table in sa.inspect(conn).get_table_names():
            if table.startswith(name):
                conn.execute(sa.text(f"DROP TABLE {table}"))


@pytest.fixture
def make(url: str, prefix: str) -> Iterator[Make]:
    """Build opened backends on this test's tables; all closed at the end."""
    made: list[SQLBackend] = []

    def build(instance: str = "host-a", **options: Any) -> SQLBackend:
        backend = SQLBackend(url, instance=instance, prefix=prefix, **options)
        backend.open()
        made.append(backend)
        return backend

    yield build
    for backend in made:
        backend.close()


@pytest.fixture
def job() -> str:
    return f"job-{uuid.uuid4().hex[:10]}"


def request_for(job: str, slot_ms: int, **kw: int) -> ClaimRequest:
    fields = {
        "window_before_ms": 60_000,
        "window_after_ms": 10_000,
        "keep_until_ms": slot_ms + 120_000,
        "lease_ms": 30_000,
    }
    fields.update(kw)
    return ClaimRequest(job=job, slot_ms=slot_ms, **fields)


# -- schema --------------------------------------------------------------------


def test_open_records_the_schema_version(make: Make, raw: sa.Engine, prefix: str) -> None:
    make()
    with raw.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names())
        version = conn.execute(sa.text(f"SELECT value FROM {prefix}meta")).scalar_one()
    assert {f"{prefix}{t}" for t in ("runs", "manual", "instances", "meta")} <= tables
    assert version == str(SCHEMA_VERSION)


def test_tables_of_a_newer_schema_are_refused(
    make: Make, raw: sa.Engine, url: str, prefix: str
) -> None:
    make()
    with raw.begin() as conn:
        conn.execute(sa.text(f"UPDATE {prefix}meta SET value = '{SCHEMA_VERSION + 1}'"))
    with pytest.raises(ConfigurationError, match="newer celery-anarchon"):
        SQLBackend(url, instance="late", prefix=prefix).open()


def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "wal.db"
    backend = SQLBackend(f"sqlite:///{path}", instance="a")
    backend.open()
    backend.close()
    with engine_for(f"sqlite:///{path}").connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


# -- processes racing ------------------------------------------------------------


def _race(url: str, prefix: str, instance: str, job: str, slots: list[int], barrier: Any,
          results: Any) -> None:  # fmt: skip
    """Child process: open (creating the tables, racing the others) and claim
    every slot in batches of 20, in an order of its own."""
    try:
        backend = SQLBackend(url, instance=instance, prefix=prefix)
        requests = [request_for(job, s, window_before_ms=DAY_MS, window_after_ms=DAY_MS)
                    for s in slots]  # fmt: skip
        batches = [requests[i : i + 20] for i in range(0, len(requests), 20)]
        random.Random(instance).shuffle(batches)
        barrier.wait(30)
        backend.open()
        won = [c.slot_ms for batch in batches for c in backend.claim(batch) if c.won]
        backend.close()
        results.put((instance, won))
    except Exception as exc:  # reported to the parent, which fails the test
        results.put((instance, repr(exc)))


def test_processes_claim_each_of_200_slots_once(
    url: str, prefix: str, make: Make, job: str
) -> None:
    ctx = multiprocessing.get_context("fork")  # a spawned child takes seconds to start
    count = 4
    barrier, results = ctx.Barrier(count), ctx.Queue()
    base = int(time.time() * 1000) - 40_000
    slots = [base + i * 200 for i in range(200)]
    procs = [
        ctx.Process(target=_race, args=(url, prefix, f"proc-{i}", job, slots, barrier, results))
        for i in range(count)
    ]
    for proc in procs:
        proc.start()
    answers = dict(results.get(timeout=90) for _ in procs)
    for proc in procs:
        proc.join(30)
    assert all(isinstance(won, list) for won in answers.values()), answers
    winners = Counter(slot for won in answers.values() for slot in won)
    assert sorted(winners) == slots
    assert set(winners.values()) == {1}
    recorded = {(r.slot_ms, r.instance) for r in make("reader").history(job)}
    assert recorded == {(s, inst) for inst, won in answers.items() for s in won}


# -- MySQL / MariaDB affected rows -----------------------------------------------


def _strip_found_rows(_d: Any, _r: Any, _a: Any, cparams: dict[str, Any]) -> None:
    cparams["client_flag"] = cparams.get("client_flag", 0) & ~CLIENT_FOUND_ROWS


@pytest.mark.parametrize("kind", ["mysql"], indirect=True)
def test_mysql_engine_counts_changed_rows_not_found_rows(url: str) -> None:
    # The hazard: with SQLAlchemy's default flag, a duplicate's no-op update
    # reports one affected row, exactly like an insert.
    default = engine_for(url)
    with default.begin() as conn:
        conn.exec_driver_sql("CREATE TEMPORARY TABLE probe (k INT PRIMARY KEY)")
        insert = "INSERT INTO probe VALUES (1) ON DUPLICATE KEY UPDATE k = k"
        assert [conn.exec_driver_sql(insert).rowcount for _ in range(2)] == [1, 1]
    default.dispose()
    # Our own engine connects without CLIENT_FOUND_ROWS: 1 then 0.
    backend = SQLBackend(url, instance="a", prefix=f"s{uuid.uuid4().hex[:8]}_")
    engine = backend._create_engine()
    with engine.begin() as conn:
        assert not conn.connection.dbapi_connection.client_flag & CLIENT_FOUND_ROWS  # type: ignore[union-attr]
        conn.exec_driver_sql("CREATE TEMPORARY TABLE probe (k INT PRIMARY KEY)")
        assert [conn.exec_driver_sql(insert).rowcount for _ in range(2)] == [1, 0]
    engine.dispose()


@pytest.mark.parametrize("kind", ["mysql"], indirect=True)
def test_mysql_user_engine_with_found_rows_is_refused(url: str, prefix: str) -> None:
    engine = engine_for(url)
    try:
        with pytest.raises(ConfigurationError, match="CLIENT_FOUND_ROWS"):
            SQLBackend(None, client=engine, instance="a", prefix=prefix).open()
    finally:
        engine.dispose()


def test_a_repeated_late_sent_with_identical_values_is_still_true(
    make: Make, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MySQL counts changed rows, and a 'sent' repeated in the same
    # millisecond with the same task id changes none; the token matched, so
    # mark() must still say True. The database clock is pinned to get there.
    backend = make()
    claim = backend.claim([request_for(job, backend.now_ms())])[0]
    monkeypatch.setattr(backend, "_now_expr", lambda: 12345)
    assert backend.mark(claim, State.SENT, task_id="t")
    assert backend.mark(claim, State.SENT, task_id="t")
    assert not backend.mark(Claim(job, claim.slot_ms, won=True, token=2), State.SENT)
    [record] = backend.history(job)
    assert (record.state, record.sent_at_ms, record.task_id) == (State.SENT, 12345, "t")


# -- states ------------------------------------------------------------------------


def test_running_gate_opens_once_under_concurrent_deliveries(make: Make, job: str) -> None:
    workers = [make(f"worker-{i}") for i in range(6)]
    claim = workers[0].claim([request_for(job, workers[0].now_ms())])[0]
    workers[0].mark(claim, State.SENT, task_id="t")
    barrier = threading.Barrier(len(workers))
    started: list[bool] = []

    def deliver(worker: SQLBackend) -> None:
        barrier.wait()
        started.append(worker.mark(claim, State.RUNNING))

    threads = [threading.Thread(target=deliver, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(started) == [False] * 5 + [True]


def test_a_late_sent_fills_in_and_keeps_the_state(make: Make, job: str) -> None:
    backend = make()
    claim = backend.claim([request_for(job, backend.now_ms())])[0]
    assert backend.mark(claim, State.RUNNING)
    assert backend.mark(claim, State.SUCCEEDED)
    assert backend.mark(claim, State.SENT, task_id="late")
    assert not backend.mark(claim, State.FAILED, error="too late")
    [record] = backend.history(job)
    assert (record.state, record.task_id, record.error) == (State.SUCCEEDED, "late", None)
    assert record.sent_at_ms is not None and record.finished_at_ms is not None


def test_mark_refuses_states_it_does_not_write(make: Make, job: str) -> None:
    backend = make()
    claim = backend.claim([request_for(job, backend.now_ms())])[0]
    assert not backend.mark(claim, State.CLAIMED)  # never a move forward
    with pytest.raises(ValueError, match="record_many_if_absent"):
        backend.mark(claim, State.MISSED)


# -- clock and window --------------------------------------------------------------


def test_claim_window_is_judged_by_the_database_clock(
    make: Make, kind: str, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = make()
    real_now = sql.dialects._process_now_ms()
    # This process's clock now runs an hour fast.
    monkeypatch.setattr(
        sql.dialects, "_process_now_ms", lambda: time.time_ns() // 1_000_000 + HOUR_MS
    )
    answer = backend.claim([request_for(job, real_now)])[0]
    if kind == "sqlite":  # no server: SQLite's clock is this process's
        assert (answer.won, answer.reason) == (False, "window")
        return
    assert answer.won
    db_now = backend.now_ms()
    assert abs(db_now - real_now) < 5_000
    beyond = backend.claim([request_for(job, db_now + 15_000)])[0]
    assert (beyond.won, beyond.reason) == (False, "window")


def test_now_is_epoch_milliseconds_utc(make: Make) -> None:
    backend = make()
    before = time.time_ns() // 1_000_000
    now = backend.now_ms()
    after = time.time_ns() // 1_000_000
    assert isinstance(now, int)
    assert before - 1_000 <= now <= after + 1_000


# -- history bounds --------------------------------------------------------------


def test_trim_by_age_spares_records_still_kept(make: Make, job: str) -> None:
    backend = make()
    now = backend.now_ms()
    old = [now - DAY_MS + i * 1000 for i in range(20)]
    kept = old[:5]  # old, but a late instance could still try them
    backend.claim(
        [
            request_for(
                job,
                s,
                window_before_ms=2 * DAY_MS,
                keep_until_ms=now + HOUR_MS if s in kept else s + 1,
            )
            for s in old
        ]
    )
    # history_size 10 trims at this write; by count alone, 9 old records
    # would stay: the age bound removes them.
    last = ClaimRequest(
        job, now, 60_000, 10_000, now + 120_000, history_size=10, history_ttl_ms=12 * HOUR_MS
    )
    assert backend.claim([last])[0].won
    assert sorted(r.slot_ms for r in backend.history(job)) == [*kept, now]


def test_trim_by_count_spares_records_still_kept(make: Make, job: str) -> None:
    backend = make()
    now = backend.now_ms()
    slots = [now - 50_000 + i * 1000 for i in range(12)]
    kept = slots[:3]
    for slot in slots:
        keep = now + HOUR_MS if slot in kept else slot + 1
        backend.claim([request_for(job, slot, keep_until_ms=keep)])
    last = ClaimRequest(job, now, 60_000, 10_000, now + 120_000, history_size=2)
    backend.claim([last])
    assert sorted(r.slot_ms for r in backend.history(job)) == [*kept, slots[-1], now]


def test_trim_is_amortised_within_a_tenth_of_history_size(make: Make, job: str) -> None:
    backend = make()
    now = backend.now_ms()
    sizes = []
    for i in range(45):
        slot = now - 50_000 + i * 1000
        req = ClaimRequest(job, slot, 60_000, 10_000, slot + 1, history_size=20)
        backend.claim([req])
        sizes.append(len(backend.history(job)))
    assert max(sizes) <= 20 + 20 // 10
    assert max(sizes) > 20  # amortised: not a trim per write


def test_trims_wait_for_housekeeping_once_it_is_called(make: Make, job: str) -> None:
    backend = make()
    backend.housekeep(0)  # the caller does upkeep: trims leave the claim path
    now = backend.now_ms()
    slots = [now - 50_000 + i * 1000 for i in range(6)]
    for slot in slots:
        backend.claim([ClaimRequest(job, slot, 60_000, 10_000, slot + 1, history_size=2)])
    assert len(backend.history(job)) == 6  # no claim trimmed
    backend.housekeep(10.0)
    assert [r.slot_ms for r in backend.history(job)] == slots[:-3:-1]


def test_a_trim_waits_for_housekeeping_a_bounded_time(
    make: Make, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = make()
    backend.housekeep(0)  # then the caller never calls it again
    # A wait far longer than the three claims below take on a loaded machine
    # (a 0.2 s one was not), run out by moving the backend's monotonic clock.
    wait_s = 10.0
    monkeypatch.setattr(sql.history, "MAX_TRIM_WAIT_S", wait_s)
    skipped = [0.0]
    clock = SimpleNamespace(**vars(time))  # the time module, but for monotonic()
    clock.monotonic = lambda: time.monotonic() + skipped[0]
    monkeypatch.setattr(sql.history, "time", clock)
    now = backend.now_ms()
    slots = [now - 50_000 + i * 1000 for i in range(4)]
    for slot in slots[:3]:
        backend.claim([ClaimRequest(job, slot, 60_000, 10_000, slot + 1, history_size=2)])
    assert len(backend.history(job)) == 3  # waiting for housekeeping
    skipped[0] += wait_s + 0.1  # the wait runs out
    backend.claim([ClaimRequest(job, slots[3], 60_000, 10_000, slots[3] + 1, history_size=2)])
    assert [r.slot_ms for r in backend.history(job)] == slots[:-3:-1]  # trimmed by the write


def test_a_bursts_jobs_are_trimmed_in_different_rounds(make: Make, job: str) -> None:
    backend = make()
    backend.housekeep(0)
    now = backend.now_ms()
    names = [f"{job}-{i}" for i in range(200)]
    due = []
    for round_ in range(19):  # history_size 100: a trim every 10th write of a job
        slot = now - 50_000 + round_ * 1000
        backend.claim([ClaimRequest(name, slot, 60_000, 10_000, slot + 1) for name in names])
        due.append(len(backend._trims_due))
        backend.housekeep(10.0)
    assert due[:9] == [0] * 9  # a new job's first writes are never trimmed
    assert sum(due) == 200  # then each job once in its next ten writes
    assert max(due) < 60  # spread over the rounds, not all in one


# -- takeover and release ----------------------------------------------------------


def test_take_over_an_expired_lease_fences_the_old_owner(make: Make, job: str) -> None:
    a, b, c = make("host-a"), make("host-b"), make("host-c")
    req = request_for(job, a.now_ms() - 1_000, lease_ms=0)
    old = a.claim([req])[0]
    time.sleep(0.005)  # let the zero-length lease run out on the database clock
    new = b.take_over_many([request_for(job, req.slot_ms)])[0]  # with a 30 s lease
    assert (new.won, new.token) == (True, 2)
    assert not c.take_over_many([req])[0].won  # b's lease runs
    assert not a.mark(old, State.SENT, task_id="stale")
    assert b.mark(new, State.SENT, task_id="fresh")
    history = [(r.state, r.instance, r.token) for r in a.history(job)]
    assert history == [(State.SENT, "host-b", 2), (State.SUPERSEDED, "host-a", 1)]
    assert not c.take_over_many([req])[0].won  # sent: nothing to take over


def test_take_over_refuses_a_running_lease_and_a_sent_run(make: Make, job: str) -> None:
    a, b = make("host-a"), make("host-b")
    req = request_for(job, a.now_ms())
    claim = a.claim([req])[0]
    assert (b.take_over_many([req])[0].won, b.take_over_many([req])[0].reason) == (False, "held")
    a.mark(claim, State.SENT, task_id="t")
    expired = request_for(job, req.slot_ms, lease_ms=0)
    assert not b.take_over_many([expired])[0].won
    outside = b.take_over_many([request_for(job, req.slot_ms - 10 * 60_000)])[0]
    assert outside.reason == "window"


def test_release_after_a_takeover_hands_the_slot_on(make: Make, job: str) -> None:
    a, b, c = make("host-a"), make("host-b"), make("host-c")
    req = request_for(job, a.now_ms() - 1_000, lease_ms=0)
    a.claim([req])
    time.sleep(0.005)
    second = b.take_over_many([request_for(job, req.slot_ms)])[0]  # 30 s lease
    b.release([second])
    third = c.take_over_many([request_for(job, req.slot_ms)])[0]
    assert (third.won, third.token) == (True, 3)


# -- keys compared exactly -------------------------------------------------------


def test_job_names_are_compared_exactly(make: Make) -> None:
    backend = make()
    slot = backend.now_ms()
    tail = uuid.uuid4().hex
    long_a, long_b = "x" * 300 + "a" + tail, "x" * 300 + "b" + tail
    names = [
        f"Report-{tail}",
        f"report-{tail}",
        f"report-{tail} ",
        "Ünïcode-" + tail,
        long_a,
        long_b,
    ]
    answers = backend.claim([request_for(name, slot) for name in names])
    assert all(a.won for a in answers)
    assert [r.slot_ms for r in backend.history(long_b)] == [slot]


# -- run_now -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite"], indirect=True)
def test_manual_run_skips_whole_seconds_and_taken_slots(
    make: Make, kind: str, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    second = (sql.dialects._process_now_ms() // 1000) * 1000
    monkeypatch.setattr(sql.dialects, "_process_now_ms", lambda: second)
    backend = make()
    assert backend.claim([request_for(job, second + 1)])[0].won
    first = backend.claim_manual(job, "k1", second + 60_000)
    assert (first.won, first.slot_ms) == (True, second + 2)
    again = backend.claim_manual(job, "k1", second + 60_000)
    assert (again.won, again.slot_ms) == (False, second + 2)
    [manual] = [r for r in backend.history(job) if r.manual_key]
    assert (manual.slot_ms, manual.manual_key, manual.state) == (second + 2, "k1", State.CLAIMED)


# -- registry ----------------------------------------------------------------------


def test_registry_lists_live_instances_oldest_first(make: Make) -> None:
    backend = make()
    now = backend.now_ms()
    young = InstanceInfo("young", "h1", 1, "1.0", started_ms=now, jobs={"a": "x"})
    old = InstanceInfo("old", "h2", 2, "1.0", started_ms=now - 1000)
    gone = InstanceInfo("gone", "h3", 3, "1.0", started_ms=now - 2000)
    backend.register(young, 60_000)
    backend.register(old, 60_000)
    backend.register(gone, -1)  # expired at once
    listed = backend.instances()
    assert [i.instance for i in listed] == ["old", "young"]
    assert listed[1].jobs == {} and listed[1].heartbeat_ms >= now  # heartbeats carry none
    assert backend.definitions("young") == {"a": "x"}
    backend.unregister("old")
    assert [i.instance for i in backend.instances()] == ["young"]


# -- lifecycle, errors and timeouts -------------------------------------------------


def test_user_engine_is_never_disposed(url: str, kind: str, prefix: str, job: str) -> None:
    engine = engine_for(url)
    if kind == "mysql":
        sa.event.listen(engine, "do_connect", _strip_found_rows)
    backend = backend_from_url(None, client=engine, instance="a", options={"prefix": prefix})
    backend.open()
    assert backend.claim([request_for(job, backend.now_ms())])[0].won
    pool = engine.pool
    backend.close()
    backend.close()
    assert engine.pool is pool and pool.checkedin() >= 1  # type: ignore[attr-defined]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    engine.dispose()


def test_closed_backend_reopens_on_use(make: Make, job: str) -> None:
    backend = make()
    backend.close()
    backend.close()
    assert backend.claim([request_for(job, backend.now_ms())])[0].won


def test_blocked_claim_gives_up_after_statement_timeout(make: Make, job: str) -> None:
    holder = make("holder")
    backend = make("waiter", statement_timeout=1)
    req = request_for(job, backend.now_ms())
    engine = holder._engine
    assert engine is not None
    with engine.connect() as conn:
        tx = conn.begin()  # SQLite: BEGIN IMMEDIATE takes the write lock
        holder._insert_if_absent(conn, holder._tables.runs, holder._claim_row(req, 0, 1))
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as caught:
            backend.claim([req])
        waited = time.monotonic() - started
        tx.rollback()
    assert 0.5 < waited < 4
    assert isinstance(caught.value.__cause__, sa.exc.DBAPIError)
    assert backend.claim([req])[0].won  # the same engine works on


_SESSION_ID = {"postgresql": "SELECT pg_backend_pid()", "mysql": "SELECT CONNECTION_ID()"}


def _session_id(backend: SQLBackend) -> int:
    assert backend._engine is not None
    with backend._engine.connect() as conn:
        return int(conn.exec_driver_sql(_SESSION_ID[backend.kind]).scalar_one())


def _claim_in_child(backend: SQLBackend, job: str, results: Any) -> None:
    answer = backend.claim([request_for(job, backend.now_ms())])[0]
    results.put((answer.won, _session_id(backend)))
    backend.close()


@pytest.mark.parametrize("kind", ["postgresql", "mysql"], indirect=True)
def test_a_forked_child_leaves_the_parents_connections_alone(
    make: Make, kind: str, job: str
) -> None:
    backend = make()
    parent_session = _session_id(backend)  # now pooled in the parent
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_claim_in_child, args=(backend, job, results))
    child.start()
    won, child_session = results.get(timeout=30)
    child.join(30)
    assert won and child_session != parent_session
    # The child's close() did not end the parent's session: same one, still pooled.
    assert _session_id(backend) == parent_session


def _silent_server() -> socket.socket:
    """A port that accepts TCP connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    return server


@pytest.mark.parametrize(
    ("scheme", "limit"),
    [
        ("postgresql://postgres@127.0.0.1:{port}/test", 4.5),
        ("mysql://root@127.0.0.1:{port}/test", 3),
    ],
)
def test_silent_server_times_out_within_connect_timeout(scheme: str, limit: float) -> None:
    server = _silent_server()
    url = scheme.format(port=server.getsockname()[1])
    backend = SQLBackend(url, instance="a", connect_timeout=1, statement_timeout=1)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable):
        backend.open()
    # PostgreSQL waits libpq's minimum, 2 s; PyMySQL waits connect_timeout for
    # TCP, then statement_timeout (its read timeout) for the server's greeting.
    assert time.monotonic() - started < limit
    backend.close()
    server.close()


class Proxy:
    """A TCP proxy to the database that the test can cut and restore."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self.sockets: list[socket.socket] = []
        self.listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.port, self.listener = listener.getsockname()[1], listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Stop listening and drop every connection, like a crashed server.
        (``shutdown`` first: a bare ``close`` neither wakes a thread blocked
        in ``accept`` nor sends the FIN while another thread selects.)"""
        assert self.listener is not None
        for sock in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                readable, _, _ = select.select([a, b], [], [], 1)
                for src in readable:
                    data = src.recv(65536)
                    if not data:
                        return
                    (b if src is a else a).sendall(data)
        except (OSError, ValueError):
            return
        finally:
            a.close()
            b.close()


@pytest.mark.parametrize("kind", ["postgresql", "mysql"], indirect=True)
def test_backend_recovers_when_the_database_comes_back(
    kind: str, url: str, prefix: str, job: str
) -> None:
    parsed = sa.engine.make_url(url)
    proxy = Proxy((parsed.host or "127.0.0.1", parsed.port or 0))
    via_proxy = parsed.set(port=proxy.port).render_as_string(hide_password=False)
    backend = SQLBackend(via_proxy, instance="a", prefix=prefix, connect_timeout=1)
    try:
        now = backend.now_ms()
        assert backend.claim([request_for(job, now)])[0].won
        proxy.cut()
        with pytest.raises(BackendUnavailable):
            backend.claim([request_for(job, now + 1)])
        proxy.restore()
        assert backend.claim([request_for(job, now + 2)])[0].won
        # Down and back between two calls: the pooled connection is stale,
        # and the ping before use replaces it, so the next call just works.
        proxy.cut()
        proxy.restore()
        assert backend.claim([request_for(job, now + 3)])[0].won
    finally:
        backend.close()
        proxy.cut()


# -- configuration (no service needed) ---------------------------------------------


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///x.db?mode=memory"])
def test_in_memory_sqlite_is_refused(url: str) -> None:
    with pytest.raises(ConfigurationError, match="in-memory"):
        SQLBackend(url, instance="a")
    with pytest.raises(ConfigurationError, match="in-memory"):
        backend_from_url(url, instance="a")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"prefix": "1bad"}, "prefix"),
        ({"prefix": "a-b"}, "prefix"),
        ({"connect_timeout": "soon"}, "connect_timeout"),
        ({"statement_timeout": 0}, "statement_timeout"),
    ],
)
def test_bad_options_name_the_setting(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        backend_from_url("sqlite:////tmp/x.db", instance="a", options=options)


@pytest.mark.parametrize(
    ("url", "kind", "shown"),
    [
        ("postgres://u:pw@h/db", "postgresql", "postgresql+psycopg://u:**@h/db"),
        ("postgresql://u@h/db", "postgresql", "postgresql+psycopg://u@h/db"),
        ("mysql://u:pw@h/db", "mysql", "mysql+pymysql://u:**@h/db"),
        ("mariadb://u@h/db", "mysql", "mysql+pymysql://u@h/db"),
        ("sqlite:////tmp/a.db", "sqlite", "sqlite:////tmp/a.db"),
        ("sqlite:///rel/a.db", "sqlite", "sqlite:///rel/a.db"),
    ],
)
def test_schemes_map_to_our_drivers(url: str, kind: str, shown: str) -> None:
    backend = backend_from_url(url, instance="a")
    assert isinstance(backend, SQLBackend) and backend.kind == kind
    assert backend.describe() == f"SQL ({kind}) {shown}"


@pytest.mark.parametrize("kind", ["postgresql"], indirect=True)
def test_options_and_driver_parameters_come_from_the_url(kind: str, prefix: str) -> None:
    name = f"anarchon-{prefix}"
    url = f"{POSTGRES_URL}?prefix={prefix}&connect_timeout=2.5&application_name={name}"
    backend = backend_from_url(url, instance="a")
    assert isinstance(backend, SQLBackend)
    assert (backend.prefix, backend.connect_timeout) == (prefix, 2.5)
    backend.open()
    try:
        assert backend.claim([request_for("j", backend.now_ms())])[0].won
        with engine_for(POSTGRES_URL).connect() as conn:
            query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = :n"
            assert conn.execute(sa.text(query), {"n": name}).scalar() == 1
    finally:
        backend.close()


def test_a_client_that_is_not_an_engine_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="Engine"):
        SQLBackend(None, client=object(), instance="a")


@pytest.mark.services
@pytest.mark.parametrize(
    ("kind", "url", "reason"),
    [
        (
            "postgresql",
            "postgresql://nobody_{run}:s3cret@127.0.0.1:5432/test",
            r'role "nobody_[0-9a-f]+" does not exist',
        ),
        (
            "mysql",
            "mysql+pymysql://nobody_{run}:s3cret@127.0.0.1:3306/test",
            r"Access denied for user",
        ),
    ],
    ids=["postgresql", "mysql"],
)
def test_an_authentication_failure_is_a_configuration_error(
    kind: str, url: str, reason: str
) -> None:
    """Issue 12, item 6: a PostgreSQL role that does not exist was retried
    for ever as an outage. Refused credentials are a configuration error,
    raised by ``open()`` with the URL masked."""
    require_service(kind)
    backend = backend_from_url(url.format(run=uuid.uuid4().hex[:8]), instance="auth-test")
    try:
        with pytest.raises(ConfigurationError, match=reason) as err:
            backend.open()
    finally:
        backend.close()
    assert "refused the credentials" in str(err.value)
    assert "s3cret" not in str(err.value) and "nobody_" in str(err.value)
