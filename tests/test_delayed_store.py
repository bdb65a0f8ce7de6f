"""The delayed-task store contract, run against every store on real services:
parking and keys, cancel and reschedule against releases, taking what is
due by the store's clock, leases, take-overs and fencing, the worker's start
gate, and the push."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend
from celery_anarchon.delayed.model import IN_FLIGHT, PENDING, Parked, Taken, encode_payload
from celery_anarchon.delayed.store import DelayedStore
from celery_anarchon.exceptions import BackendUnavailable

from .conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, backend_options, require_service

if TYPE_CHECKING:
    from celery_anarchon.delayed.postgres import PostgresDelayedStore
    from celery_anarchon.delayed.sql import SQLStore

pytestmark = pytest.mark.services

StoreFactory = Callable[[], DelayedStore]

#: A lease long enough that no test outlives it by accident, ms.
LEASE_MS = 60_000


#: Every store the contract runs against.
STORES = ["redis", "postgresql", "mysql", "sqlite"]


def _store_class(name: str) -> Callable[[Any], DelayedStore]:
    """The store class of ``name``, built on a backend of that kind."""
    if name == "redis":
        module = pytest.importorskip("celery_anarchon.delayed.redis")
        redis_store: Callable[[Any], DelayedStore] = module.RedisDelayedStore
        return redis_store
    if name in ("mysql", "sqlite"):
        from celery_anarchon.delayed.sql import SQLDelayedStore

        return SQLDelayedStore
    from celery_anarchon.delayed.postgres import PostgresDelayedStore

    return PostgresDelayedStore


@pytest.fixture(params=STORES)
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    """Build stores of the parametrised kind in one namespace of this
    test's own (each on a backend of its own: another host's connection;
    on SQLite, another process's on this host)."""
    name: str = request.param
    require_service(name)
    store_class = _store_class(name)
    if name != "sqlite":
        request.getfixturevalue("_redis_cleanup" if name == "redis" else "_sql_cleanup")
    tag = uuid.uuid4().hex[:6]
    prefix = backend_options(name)["prefix"] + f"{tag}_"
    url = {
        "redis": REDIS_URL,
        "postgresql": POSTGRES_URL,
        "mysql": MYSQL_URL,
        "sqlite": f"sqlite:///{tmp_path / 'delayed.db'}",
    }[name]
    backends: list[Backend] = []
    stores: list[DelayedStore] = []

    def make() -> DelayedStore:
        backend = backend_from_url(
            url, instance=f"delayed-{uuid.uuid4().hex[:6]}", options={"prefix": prefix}
        )
        backends.append(backend)
        store = store_class(backend)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
    for backend in backends:
        backend.close()


@pytest.fixture
def store(make_store: StoreFactory) -> DelayedStore:
    return make_store()


def parked(store: DelayedStore, due_ms: int, key: str | None = None, n: int = 0) -> Parked:
    """A task ``tests.add(n, 1)`` due at ``due_ms`` (the store's epoch ms)."""
    payload = encode_payload(
        task="tests.add",
        args=(n, 1),
        kwargs={},
        options={"queue": "celery"},
        serializer="json",
        key=key,
        parked_ms=due_ms,
        due_ms=due_ms,
    )
    return Parked(id=store.new_id(key), key=key, task="tests.add", due_ms=due_ms, payload=payload)


def take_one(store: DelayedStore, lease_ms: int = LEASE_MS) -> Taken:
    [taken] = store.take_due(10, lease_ms, "releaser-a")
    return taken


def wait_for_store_clock(store: DelayedStore, past_ms: int, within_s: float = 5.0) -> None:
    """Sleep until the store's clock is past ``past_ms``."""
    deadline = time.monotonic() + within_s
    while store.now_ms() <= past_ms:
        assert time.monotonic() < deadline, "the store's clock did not move on"
        time.sleep(0.02)


# -- parking and reading ---------------------------------------------------------


def test_park_get_count_and_pending_by_due_time(store: DelayedStore) -> None:
    now = store.now_ms()
    assert store.count() == 0 and store.pending(10) == [] and store.next_due_ms() is None
    late, early, middle = (parked(store, now + d, n=d) for d in (30_000, 10_000, 20_000))
    ids = store.park([late, early, middle])
    assert ids == [late.id, early.id, middle.id]
    assert store.count() == 3
    assert store.next_due_ms() == now + 10_000
    assert [t.id for t in store.pending(10)] == [early.id, middle.id, late.id]
    assert [t.id for t in store.pending(2)] == [early.id, middle.id]
    assert [t.id for t in store.pending(10, before_ms=now + 20_000)] == [early.id]
    got = store.get(middle.id)
    assert got is not None
    assert (got.id, got.key, got.task, got.due_ms) == (middle.id, None, "tests.add", now + 20_000)
    assert (got.state, got.token, got.attempts, got.error) == (PENDING, 0, 0, None)
    assert got.payload == middle.payload
    assert got.decoded()["args"] == [20_000, 1]
    assert store.get("no-such-task") is None


def test_a_key_parks_once_while_pending_or_in_flight(store: DelayedStore) -> None:
    now = store.now_ms()
    first = parked(store, now - 1, key="order-1")
    assert store.park([first]) == [first.id]
    again = parked(store, now + 50_000, key="order-1")
    assert store.park([again]) == [first.id]
    got = store.get("order-1")
    assert got is not None and got.id == first.id and got.due_ms == now - 1  # unchanged
    taken = take_one(store)
    assert store.park([parked(store, now, key="order-1")]) == [first.id]  # in flight
    assert store.count() == 1
    assert store.finish([taken]) == [True]
    after = parked(store, now, key="order-1")
    assert store.park([after]) == [after.id]  # released: the key is free again


def test_one_batch_with_a_key_twice_parks_it_once(store: DelayedStore) -> None:
    now = store.now_ms()
    a, b, c = parked(store, now, key="k"), parked(store, now, key="k"), parked(store, now)
    assert store.park([a, b, c]) == [a.id, a.id, c.id]
    assert store.count() == 2


def test_an_id_parked_already_is_not_overwritten(store: DelayedStore) -> None:
    now = store.now_ms()
    first = parked(store, now + 10_000, n=1)
    store.park([first])
    same_id = Parked(first.id, None, "tests.other", now + 99_000, parked(store, now, n=2).payload)
    assert store.park([same_id]) == [first.id]
    got = store.get(first.id)
    assert got is not None and (got.task, got.due_ms) == ("tests.add", now + 10_000)
    assert got.payload == first.payload and store.count() == 1


def test_keys_are_compared_exactly_and_text_keeps_every_character(store: DelayedStore) -> None:
    """Keys that differ in case or a trailing space are different keys
    (MySQL's default collations would merge them), and a key and payload
    outside the Basic Multilingual Plane read back as parked."""
    now = store.now_ms()
    keys = ["Order-1", "order-1", "order-1 ", "clé-😀"]
    tasks = [parked(store, now + 10_000, key=key, n=n) for n, key in enumerate(keys)]
    assert store.park(tasks) == [t.id for t in tasks]
    assert store.count() == 4
    for task in tasks:
        got = store.get(task.key or "")
        assert got is not None and (got.id, got.key) == (task.id, task.key)
        assert got.payload == task.payload
    emoji = Parked(
        store.new_id(None), None, "tests.add", now, tasks[0].payload.replace("Order", "😀")
    )
    store.park([emoji])
    got = store.get(emoji.id)
    assert got is not None and got.payload == emoji.payload


def test_two_concurrent_parks_of_one_key_answer_the_same_id(make_store: StoreFactory) -> None:
    stores = [make_store(), make_store()]
    now = stores[0].now_ms()
    rounds = 25
    barrier = threading.Barrier(2)

    def park_all(store: DelayedStore) -> list[str]:
        ids = []
        for n in range(rounds):
            task = parked(store, now + 60_000, key=f"race-{n}")
            barrier.wait(timeout=10)
            [answer] = store.park([task])
            ids.append(answer)
        return ids

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(park_all, stores)
    assert first == second
    assert stores[0].count() == rounds
    assert {t.id for t in stores[0].pending(100)} == set(first)


# -- cancel and reschedule -------------------------------------------------------


def test_cancel_deletes_a_pending_task_by_key_or_id(store: DelayedStore) -> None:
    now = store.now_ms()
    by_id, by_key = parked(store, now + 10_000), parked(store, now + 10_000, key="cancel-me")
    store.park([by_id, by_key])
    assert store.cancel(by_id.id) is True
    assert store.cancel("cancel-me") is True
    assert store.get(by_id.id) is None and store.get("cancel-me") is None
    assert store.count() == 0
    assert store.cancel(by_id.id) is False  # gone already
    assert store.cancel("never-parked") is False


def test_cancel_and_reschedule_refuse_a_task_in_flight(store: DelayedStore) -> None:
    now = store.now_ms()
    task = parked(store, now - 1, key="busy")
    store.park([task])
    taken = take_one(store)
    assert store.cancel("busy") is False
    assert store.cancel(task.id) is False
    assert store.reschedule("busy", now + 90_000) is False
    got = store.get(task.id)
    assert got is not None and got.state == IN_FLIGHT and got.token == taken.token
    assert store.finish([taken]) == [True]  # the lease is intact


def test_reschedule_moves_a_pending_task(store: DelayedStore) -> None:
    now = store.now_ms()
    task = parked(store, now + 10_000, key="move-me")
    store.park([task])
    assert store.reschedule("move-me", now + 40_000) is True
    got = store.get(task.id)
    assert got is not None and (got.due_ms, got.state) == (now + 40_000, PENDING)
    assert store.reschedule(task.id, now - 1) is True
    assert [t.task.id for t in store.take_due(10, LEASE_MS, "releaser-a")] == [task.id]
    assert store.reschedule("never-parked", now) is False


# -- taking what is due ----------------------------------------------------------


def test_take_due_takes_only_what_is_due(store: DelayedStore) -> None:
    now = store.now_ms()
    due, later = parked(store, now - 1_000), parked(store, now + 60_000)
    store.park([later, due])
    [taken] = store.take_due(10, LEASE_MS, "releaser-a")
    assert taken.task.id == due.id and taken.task.due_ms == now - 1_000
    assert taken.task.state == IN_FLIGHT and taken.task.token == taken.token > 0
    assert taken.taken_over is False and taken.now_ms >= now
    assert store.take_due(10, LEASE_MS, "releaser-b") == []  # in flight, lease running
    got = store.get(due.id)
    assert got is not None and got.state == IN_FLIGHT
    assert got.due_ms >= taken.now_ms + LEASE_MS  # ready_ms is the lease's end
    assert [t.state for t in store.pending(10)] == [PENDING, IN_FLIGHT]


def test_take_due_takes_earliest_first_and_at_most_limit(store: DelayedStore) -> None:
    now = store.now_ms()
    tasks = [parked(store, now - 5_000 + 100 * n, n=n) for n in range(10)]
    store.park(list(reversed(tasks)))
    first = store.take_due(4, LEASE_MS, "releaser-a")
    assert [t.task.id for t in first] == [t.id for t in tasks[:4]]
    rest = store.take_due(100, LEASE_MS, "releaser-a")
    assert [t.task.id for t in rest] == [t.id for t in tasks[4:]]


def test_a_task_is_never_taken_before_its_due_time(store: DelayedStore) -> None:
    due_ms = store.now_ms() + 1_500
    task = parked(store, due_ms)
    store.park([task])
    assert store.take_due(10, LEASE_MS, "releaser-a") == []
    deadline = time.monotonic() + 10
    taken: list[Taken] = []
    while not taken:
        assert time.monotonic() < deadline, "a due task was not taken"
        taken = store.take_due(10, LEASE_MS, "releaser-a")
        if not taken:
            assert store.now_ms() - due_ms < 1_000  # not taken though long due
            time.sleep(0.01)
    assert taken[0].task.id == task.id
    assert taken[0].now_ms >= due_ms


def test_concurrent_takers_never_take_one_task_twice(make_store: StoreFactory) -> None:
    takers = [make_store() for _ in range(4)]
    now = takers[0].now_ms()
    tasks = [parked(takers[0], now - 10_000 + n, n=n) for n in range(2_000)]
    assert takers[0].park(tasks) == [t.id for t in tasks]
    barrier = threading.Barrier(len(takers))

    def take_all(store: DelayedStore) -> list[str]:
        got: list[str] = []
        barrier.wait(timeout=10)
        while True:
            batch = store.take_due(50, LEASE_MS, f"releaser-{id(store)}")
            if not batch:
                return got
            got.extend(t.task.id for t in batch)

    with ThreadPoolExecutor(len(takers)) as pool:
        results = list(pool.map(take_all, takers))
    every = [task_id for result in results for task_id in result]
    assert len(every) == len(set(every)) == 2_000  # none taken twice
    assert set(every) == {t.id for t in tasks}  # none left behind
    if takers[0].kind != "sqlite":  # SQLite's writers take turns: one may take all
        assert sum(1 for result in results if result) >= 2  # they really ran together


@pytest.mark.parametrize("make_store", ["mysql"], indirect=True)
def test_concurrent_parks_and_releases_on_mysql_never_fail_on_a_deadlock(
    make_store: StoreFactory,
) -> None:
    """Two parkers (batches of 20, half keyed, the same keys on both) and two
    releasers (take, then finish or give back), each on a backend of its
    own, for a few seconds: InnoDB picks deadlock victims among such
    transactions, which the store runs again, so no call fails, and every
    task parked is finished exactly once."""
    parkers = [make_store() for _ in range(2)]
    releasers = [make_store() for _ in range(2)]
    parkers[0].count()  # the tables, before the clock starts
    stop = time.monotonic() + 4.0
    lock = threading.Lock()
    failures: list[str] = []
    parked_ids: set[str] = set()
    finished: Counter[str] = Counter()
    taken_now: set[str] = set()
    overlaps: list[str] = []

    def park(store: DelayedStore) -> None:
        n = 0
        while time.monotonic() < stop:
            now = store.now_ms()
            batch = [
                parked(store, now, key=f"invoice-{i}" if i % 2 else None, n=i)
                for i in range(n, n + 20)
            ]
            n += 20
            try:
                ids = store.park(batch)
            except BackendUnavailable as exc:
                with lock:
                    failures.append(f"park: {exc}")
                continue
            with lock:
                parked_ids.update(ids)

    def release(store: DelayedStore, name: str) -> None:
        takes = 0
        while time.monotonic() < stop:
            try:
                taken = store.take_due(10, LEASE_MS, name)
            except BackendUnavailable as exc:
                with lock:
                    failures.append(f"take_due: {exc}")
                continue
            if not taken:
                time.sleep(0.005)
                continue
            ids = {t.task.id for t in taken}
            with lock:
                overlaps.extend(ids & taken_now)
                taken_now.update(ids)
            takes += 1
            try:
                if takes % 4 == 0:
                    assert all(store.give_back(taken, store.now_ms(), "again", failed=False))
                else:
                    done = store.finish(taken)
                    assert all(done)
                    with lock:
                        finished.update(ids)
            except BackendUnavailable as exc:
                with lock:
                    failures.append(f"finish or give_back: {exc}")
            with lock:
                taken_now.difference_update(ids)

    threads = [threading.Thread(target=park, args=(store,)) for store in parkers] + [
        threading.Thread(target=release, args=(store, f"releaser-{i}"))
        for i, store in enumerate(releasers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert [f"{len(failures)} calls failed"] + failures[:3] == ["0 calls failed"]
    store = releasers[0]
    deadline = time.monotonic() + 10
    while store.count():  # what was parked last and not yet taken
        assert time.monotonic() < deadline, "parked tasks were left behind"
        taken = store.take_due(500, LEASE_MS, "drain")
        assert all(store.finish(taken))
        finished.update(t.task.id for t in taken)
    assert overlaps == []  # no task held by two leases at once
    assert len(parked_ids) > 100  # they really ran
    assert set(finished) == parked_ids  # none lost, none made up
    assert [task_id for task_id, times in finished.items() if times != 1] == []


# -- leases, take-over and fencing -----------------------------------------------


def test_an_expired_lease_is_taken_over_and_the_old_token_is_fenced(
    store: DelayedStore,
) -> None:
    task = parked(store, store.now_ms() - 1)
    store.park([task])
    first = take_one(store, lease_ms=300)
    assert store.take_due(10, 300, "releaser-b") == []  # the lease still runs
    wait_for_store_clock(store, first.now_ms + 300)
    [second] = store.take_due(10, LEASE_MS, "releaser-b")
    assert second.task.id == task.id
    assert second.taken_over is True
    assert second.token > first.token
    assert store.finish([first]) == [False]
    assert store.give_back([first], store.now_ms(), "late") == [False]
    got = store.get(task.id)
    assert got is not None and got.token == second.token and got.attempts == 0
    assert store.finish([second]) == [True]
    assert store.get(task.id) is None


def test_give_back_makes_a_task_pending_again_counted(store: DelayedStore) -> None:
    now = store.now_ms()
    task = parked(store, now - 1, key="flaky")
    store.park([task])
    first = take_one(store)
    retry_at = store.now_ms() + 200
    assert store.give_back([first], retry_at, "broker down") == [True]
    got = store.get("flaky")
    assert got is not None
    assert (got.id, got.state, got.due_ms, got.token) == (task.id, PENDING, retry_at, 0)
    assert (got.attempts, got.error) == (1, "broker down")
    assert store.give_back([first], retry_at, "again") == [False]  # no lease any more
    assert store.finish([first]) == [False]
    assert store.cancel("flaky") is True  # pending again: cancellable
    store.park([parked(store, now - 1, key="flaky2")])
    second = take_one(store)
    assert store.give_back([second], store.now_ms() - 1, "x" * 5_000) == [True]
    [third] = store.take_due(10, LEASE_MS, "releaser-b")
    assert third.task.id == second.task.id
    assert third.taken_over is False  # it was pending, not in flight
    assert third.token > second.token
    assert (third.task.attempts, third.task.error) == (1, "x" * 1_000)
    # Never tried (the batch stopped before it): pending again, not counted.
    assert store.give_back([third], store.now_ms() - 1, "ignored", failed=False) == [True]
    [fourth] = store.take_due(10, LEASE_MS, "releaser-b")
    assert (fourth.task.attempts, fourth.task.error) == (1, "x" * 1_000)


def test_finish_deletes_only_tasks_whose_lease_is_current(store: DelayedStore) -> None:
    now = store.now_ms()
    tasks = [parked(store, now - 10 + n, key=f"f{n}") for n in range(3)]
    store.park(tasks)
    taken = store.take_due(10, LEASE_MS, "releaser-a")
    assert len(taken) == 3
    stale = Taken(taken[1].task, taken[1].token - 1)
    assert store.finish([taken[0], stale, taken[2]]) == [True, False, True]
    assert store.count() == 1
    assert [t.id for t in store.pending(10)] == [tasks[1].id]
    assert store.finish([taken[1]]) == [True]
    assert store.count() == 0 and store.next_due_ms() is None
    assert store.finish([]) == [] and store.give_back([], now, "x") == []


# -- the worker's start gate -----------------------------------------------------


def test_mark_started_again_by_the_same_delivery_is_its_own(store: DelayedStore) -> None:
    """A gate whose first call wrote the mark but lost the answer asks
    again with the same owner: the mark is its own, not another's."""
    task_id = str(uuid.uuid4())
    assert store.mark_started(task_id, 60_000, "delivery-1") is True
    assert store.mark_started(task_id, 60_000, "delivery-1") is True  # the retry
    assert store.mark_started(task_id, 60_000, "delivery-2") is False  # a second delivery
    assert store.mark_started(task_id, 60_000) is False


def test_mark_started_once_per_task_id_for_keep_ms(store: DelayedStore) -> None:
    task_id = str(uuid.uuid4())
    assert store.mark_started(task_id, 60_000) is True
    assert store.mark_started(task_id, 60_000) is False
    assert store.mark_started(str(uuid.uuid4()), 60_000) is True
    short = str(uuid.uuid4())
    assert store.mark_started(short, 150) is True
    time.sleep(0.4)
    assert store.mark_started(short, 150) is True  # forgotten after keep_ms
    assert store.mark_started(short, 150) is False


# -- the push --------------------------------------------------------------------


def test_a_listener_wakes_on_a_park_from_another_connection(make_store: StoreFactory) -> None:
    waiting, parking = make_store(), make_store()
    listener = waiting.listener()
    try:
        started = time.monotonic()
        assert listener.wait(0.3) is False  # nothing announced: times out
        assert 0.25 <= time.monotonic() - started < 2.0
        now = parking.now_ms()
        # One key, so on Redis both tasks share a shard (its announcement
        # is judged against the shard's earliest).
        timer = threading.Timer(0.3, parking.park, ([parked(parking, now + 60_000, key="w")],))
        timer.start()
        started = time.monotonic()
        try:
            assert listener.wait(5.0) is True
        finally:
            timer.join()
        assert time.monotonic() - started < 1.3  # woken within a second of the park
        assert listener.wait(0.2) is False  # drained
        later = parked(parking, now + 120_000)
        later = replace(later, id=parking.new_id("w"))  # the first one's shard on Redis
        parking.park([later])  # not the earliest: no announcement
        assert listener.wait(0.5) is False
        assert parking.reschedule(parking.pending(1)[0].id, now + 1_000) is True  # earlier
        assert listener.wait(5.0) is True
    finally:
        listener.close()
        listener.close()  # twice is fine


# -- SQL stores, and PostgreSQL only -------------------------------------------------------------


@pytest.fixture
def postgres_store(request: pytest.FixtureRequest) -> Iterator[PostgresDelayedStore]:
    """A PostgreSQL store in a namespace of this test's own."""
    require_service("postgresql")
    request.getfixturevalue("_sql_cleanup")
    from celery_anarchon.backends.sql import SQLBackend
    from celery_anarchon.delayed.postgres import PostgresDelayedStore

    prefix = backend_options("postgresql")["prefix"] + f"{uuid.uuid4().hex[:6]}_"
    backend = backend_from_url(POSTGRES_URL, instance="delayed-pg", options={"prefix": prefix})
    assert isinstance(backend, SQLBackend)
    yield PostgresDelayedStore(backend)
    backend.close()


def test_a_killed_listen_connection_raises_and_the_next_wait_reconnects(
    postgres_store: PostgresDelayedStore,
) -> None:
    listener = postgres_store.listener()
    try:
        with postgres_store.backend._write("kill the LISTEN connection") as conn:
            killed = conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE query = :listen"
                ),
                {"listen": f'LISTEN "{postgres_store.channel}"'},
            ).scalar_one()
        assert killed == 1
        with pytest.raises(BackendUnavailable, match="LISTEN connection lost"):
            listener.wait(5.0)
        assert listener.wait(0.2) is False  # listening again
        postgres_store.park([parked(postgres_store, postgres_store.now_ms())])
        assert listener.wait(5.0) is True
    finally:
        listener.close()


@pytest.fixture(params=["postgresql", "mysql", "sqlite"])
def sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SQLStore]:
    """An SQL store of the parametrised kind in a namespace of this test's
    own."""
    name: str = request.param
    require_service(name)
    from celery_anarchon.backends.sql import SQLBackend
    from celery_anarchon.delayed import store_from_backend
    from celery_anarchon.delayed.sql import SQLStore

    if name != "sqlite":
        request.getfixturevalue("_sql_cleanup")
    url = {
        "postgresql": POSTGRES_URL,
        "mysql": MYSQL_URL,
        "sqlite": f"sqlite:///{tmp_path / 'delayed.db'}",
    }[name]
    prefix = backend_options(name)["prefix"] + f"{uuid.uuid4().hex[:6]}_"
    backend = backend_from_url(url, instance="delayed-sql", options={"prefix": prefix})
    assert isinstance(backend, SQLBackend)
    store = store_from_backend(backend)
    assert isinstance(store, SQLStore)
    yield store
    backend.close()


def test_the_store_adds_its_own_tables_and_leaves_the_backends_alone(
    sql_store: SQLStore,
) -> None:
    from celery_anarchon.backends.sql.naming import SCHEMA_VERSION

    backend = sql_store.backend
    backend.open()
    prefix = backend.prefix

    def ours() -> set[str]:
        with backend._read("list tables") as conn:
            return {t for t in sa.inspect(conn).get_table_names() if t.startswith(prefix)}

    before = ours()
    assert f"{prefix}delayed" not in before
    assert sql_store.count() == 0  # first use creates the tables
    added = {f"{prefix}delayed", f"{prefix}delayed_started"}
    if backend.kind != "postgresql":  # a sequence there, a counter row here
        added.add(f"{prefix}delayed_fence")
    assert ours() == before | added
    with backend._read("read the schema version") as conn:
        version = conn.execute(
            sa.text(f"SELECT value FROM {prefix}meta WHERE name = 'schema_version'")
        ).scalar_one()
    assert int(version) == SCHEMA_VERSION


def test_a_key_or_task_id_longer_than_the_index_takes_is_refused(sql_store: SQLStore) -> None:
    limit = sql_store.max_key_bytes
    if limit is None:  # SQLite: any length
        long_key = "k" * 10_000
        task = parked(sql_store, sql_store.now_ms(), key=long_key)
        assert sql_store.park([task]) == [task.id]
        return
    now = sql_store.now_ms()
    at_limit = "é" * (limit // 2)  # two bytes each
    task = parked(sql_store, now, key=at_limit)
    assert sql_store.park([task]) == [task.id]
    got = sql_store.get(at_limit)
    assert got is not None and got.id == task.id
    for over in (
        parked(sql_store, now, key=at_limit + "x"),
        replace(parked(sql_store, now), id="i" * (limit + 1)),
    ):
        with pytest.raises(ValueError, match=f"over {limit} bytes"):
            sql_store.park([over])
    assert sql_store.count() == 1


def test_a_lost_fence_row_starts_again_above_every_token(sql_store: SQLStore) -> None:
    """MySQL and SQLite count tokens in a row of their own: recreated (by
    the next store to start), it starts at the highest token present, so a
    lease still held is never handed out again."""
    if sql_store.backend.kind == "postgresql":
        pytest.skip("PostgreSQL's tokens come from a sequence")
    fence = sql_store._tables.fence
    assert fence is not None
    now = sql_store.now_ms()
    sql_store.park([parked(sql_store, now - 1, n=n) for n in range(3)])
    held = sql_store.take_due(1, LEASE_MS, "releaser-a")[0]
    with sql_store.backend._write("lose the fence row") as conn:
        conn.execute(sa.delete(fence))
    with pytest.raises(BackendUnavailable, match="fencing-token row"):
        sql_store.take_due(1, LEASE_MS, "releaser-a")
    from celery_anarchon.delayed import store_from_backend

    again = store_from_backend(sql_store.backend)
    [next_one] = again.take_due(1, LEASE_MS, "releaser-b")
    assert next_one.token > held.token
    assert sql_store.finish([held]) == [True]
