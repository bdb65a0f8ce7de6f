"""The backend contract (``celery_anarchon/backends/base.py``), run against
every backend through one parametrised fixture: SQLite, PostgreSQL, MySQL,
Redis and RabbitMQ (claim-only parts; lease-only tests skip there).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

import pytest

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import (
    AbsentRecord,
    Backend,
    Claim,
    ClaimRequest,
    InstanceInfo,
    LeaseBackend,
    State,
)
from celery_anarchon.exceptions import BackendUnavailable, ConfigurationError

from ..conftest import BackendFactory

pytestmark = pytest.mark.services

DAY_MS = 24 * 3600 * 1000


def request_for(backend: Backend, job: str, slot_ms: int | None = None, **kw: int) -> ClaimRequest:
    """A claim request for ``slot_ms`` (default: the backend's now)."""
    slot = backend.now_ms() if slot_ms is None else slot_ms
    fields = {
        "window_before_ms": 60_000,
        "window_after_ms": 10_000,
        "keep_until_ms": slot + 120_000,
        "lease_ms": 30_000,
    }
    fields.update(kw)
    return ClaimRequest(job=job, slot_ms=slot, **fields)


def slots_from(backend: Backend, count: int) -> list[int]:
    """``count`` distinct slots inside the claim window, oldest first."""
    base = backend.now_ms() - 50_000
    step = 50_000 // count
    return [base + i * step for i in range(count)]


def lease_only(backend: Backend) -> None:
    if not backend.supports_leases:
        pytest.skip(f"{type(backend).__name__} is claim-only")


# -- claims ----------------------------------------------------------------


def test_a_slot_is_won_once(make_backend: BackendFactory, job: str) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    req = request_for(a, job)
    first = a.claim([req])[0]
    second = b.claim([req])[0]
    again = a.claim([req])[0]
    assert first.won and first.token is not None
    assert (first.job, first.slot_ms) == (job, req.slot_ms)
    assert not second.won and second.reason == "taken" and second.token is None
    assert not again.won and again.reason == "taken"


def test_batch_answers_in_request_order(make_backend: BackendFactory, job: str) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    slots = slots_from(a, 6)
    a.claim([request_for(a, job, s) for s in slots[::2]])
    answers = b.claim([request_for(b, job, s) for s in slots])
    assert [c.slot_ms for c in answers] == slots
    assert [c.won for c in answers] == [False, True, False, True, False, True]


def test_concurrent_claims_have_one_winner_per_slot(make_backend: BackendFactory, job: str) -> None:
    backends = [make_backend(f"host-{i}") for i in range(6)]
    slots = slots_from(backends[0], 100)
    requests = [request_for(backends[0], job, s) for s in slots]
    won: list[list[Claim]] = [[] for _ in backends]
    barrier = threading.Barrier(len(backends))

    def race(i: int) -> None:
        barrier.wait()
        for start in range(0, len(requests), 25):
            won[i].extend(c for c in backends[i].claim(requests[start : start + 25]) if c.won)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(backends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = Counter(c.slot_ms for claims in won for c in claims)
    assert sorted(winners) == sorted(slots)
    assert set(winners.values()) == {1}


def test_claim_window_refuses_slots_by_backend_clock(backend: Backend, job: str) -> None:
    lease_only(backend)
    now = backend.now_ms()
    late = backend.claim([request_for(backend, job, now - 70_000)])[0]
    early = backend.claim([request_for(backend, job, now + 60_000)])[0]
    inside = backend.claim([request_for(backend, job, now - 5_000)])[0]
    assert (late.won, late.reason) == (False, "window")
    assert (early.won, early.reason) == (False, "window")
    assert inside.won


# -- states and fencing ----------------------------------------------------


def test_won_claim_is_recorded_as_claimed(backend: Backend, job: str) -> None:
    claim = backend.claim([request_for(backend, job)])[0]
    [record] = backend.history(job)
    assert (record.job, record.slot_ms, record.state) == (job, claim.slot_ms, State.CLAIMED)
    assert record.instance == "instance-a"
    assert record.claimed_at_ms is not None


def test_mark_sent_records_task_id_and_time(backend: Backend, job: str) -> None:
    claim = backend.claim([request_for(backend, job)])[0]
    assert backend.mark(claim, State.SENT, task_id="task-1")
    [record] = backend.history(job)
    assert record.state is State.SENT
    assert record.task_id == "task-1"
    assert record.sent_at_ms is not None


def test_mark_with_a_stale_token_is_refused(backend: Backend, job: str) -> None:
    lease_only(backend)
    claim = backend.claim([request_for(backend, job)])[0]
    assert isinstance(claim.token, int)
    stale = Claim(job=job, slot_ms=claim.slot_ms, won=True, token=claim.token + 1)
    assert not backend.mark(stale, State.SENT, task_id="stale")
    [record] = backend.history(job)
    assert record.state is State.CLAIMED and record.task_id is None


def test_worker_states_follow_the_run(backend: Backend, job: str) -> None:
    claim = backend.claim([request_for(backend, job)])[0]
    backend.mark(claim, State.SENT, task_id="t")
    backend.mark(claim, State.RUNNING)
    backend.mark(claim, State.FAILED, error="ZeroDivisionError: boom")
    [record] = backend.history(job)
    assert record.state is State.FAILED
    assert record.error == "ZeroDivisionError: boom"
    assert record.finished_at_ms is not None and record.started_at_ms is not None


def test_running_is_a_start_gate_passed_once(backend: Backend, job: str) -> None:
    lease_only(backend)
    claim = backend.claim([request_for(backend, job)])[0]
    backend.mark(claim, State.SENT, task_id="t")
    assert backend.mark(claim, State.RUNNING)
    assert not backend.mark(claim, State.RUNNING)  # a duplicate delivery
    assert backend.mark(claim, State.SUCCEEDED)
    assert not backend.mark(claim, State.RUNNING)
    assert [r.state for r in backend.history(job)] == [State.SUCCEEDED]


def test_missed_slot_is_recorded_once_and_closes_the_slot(
    make_backend: BackendFactory, job: str
) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    slot = a.now_ms() - 1_000
    assert a.record_many_if_absent(
        [AbsentRecord(job, slot, State.MISSED, keep_until_ms=slot + 120_000)]
    )[0]
    assert not b.record_many_if_absent(
        [AbsentRecord(job, slot, State.MISSED, keep_until_ms=slot + 120_000)]
    )[0]
    assert not b.claim([request_for(b, job, slot)])[0].won
    assert [r.state for r in a.history(job)] == [State.MISSED]


def test_a_claimed_slot_is_not_recorded_missed(make_backend: BackendFactory, job: str) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    claim = a.claim([request_for(a, job)])[0]
    assert not b.record_many_if_absent(
        [AbsentRecord(job, claim.slot_ms, State.MISSED, keep_until_ms=0)]
    )[0]
    assert [r.state for r in a.history(job)] == [State.CLAIMED]


def test_many_records_in_one_call_answer_each_slot(make_backend: BackendFactory, job: str) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    slots = slots_from(a, 4)
    claimed = a.claim([request_for(a, job, slots[1])])[0]
    assert claimed.won
    other = f"{job}-other"
    records = [
        AbsentRecord(job, slots[0], State.MISSED, "later than max_late", 10, DAY_MS, slots[0]),
        AbsentRecord(job, slots[1], State.MISSED, "later than max_late", 10, DAY_MS, slots[1]),
        AbsentRecord(job, slots[2], State.SKIPPED, "previous run sent", 10, DAY_MS, slots[2]),
        AbsentRecord(other, slots[3], State.MISSED, None, 10, DAY_MS, slots[3]),
    ]
    # The claimed slot is not recorded; the others are, each with its state.
    assert b.record_many_if_absent(records) == [True, False, True, True]
    assert b.record_many_if_absent(records) == [False] * 4  # once only
    assert b.record_many_if_absent([]) == []
    history = {r.slot_ms: r for r in a.history(job)}
    assert {s: r.state for s, r in history.items()} == {
        slots[0]: State.MISSED,
        slots[1]: State.CLAIMED,
        slots[2]: State.SKIPPED,
    }
    assert history[slots[0]].error == "later than max_late"
    assert history[slots[0]].instance == "host-b"
    assert [(r.slot_ms, r.state) for r in a.history(other)] == [(slots[3], State.MISSED)]
    # A recorded slot is closed: nobody claims it any more.
    assert not a.claim([request_for(a, job, slots[0])])[0].won


def test_release_lets_another_instance_claim(make_backend: BackendFactory, job: str) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    lease_only(a)
    req = request_for(a, job)
    claim = a.claim([req])[0]
    a.release([claim])
    taken = b.claim([req])[0]
    assert taken.won
    assert [(r.state, r.instance) for r in b.history(job)] == [(State.CLAIMED, "host-b")]


def test_take_over_claims_a_released_slot(make_backend: BackendFactory, job: str) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    lease_only(a)
    req = request_for(a, job)
    claim = a.claim([req])[0]
    assert not b.claim([req])[0].won
    a.release([claim])  # hand-over on shutdown
    taken = b.take_over_many([req])[0]
    assert taken.won and isinstance(taken.token, int)
    # (A released claim is never used again by its holder, which is shutting
    # down; SQL may hand the same token 1 out again, Redis the next one.)
    assert b.mark(taken, State.SENT, task_id="new")
    assert [(r.state, r.instance) for r in b.history(job)][0] == (State.SENT, "host-b")


def test_take_over_leaves_a_live_lease_alone(make_backend: BackendFactory, job: str) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    lease_only(a)
    req = request_for(a, job)
    assert a.claim([req])[0].won
    assert not b.take_over_many([req])[0].won


def test_release_leaves_a_sent_slot_alone(make_backend: BackendFactory, job: str) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    lease_only(a)
    req = request_for(a, job)
    claim = a.claim([req])[0]
    a.mark(claim, State.SENT, task_id="t")
    a.release([claim])
    assert not b.claim([req])[0].won


# -- history ---------------------------------------------------------------


def test_history_is_newest_first_and_limited(backend: Backend, job: str) -> None:
    slots = slots_from(backend, 5)
    for slot in slots:
        backend.claim([request_for(backend, job, slot)])
    records = backend.history(job)
    assert [r.slot_ms for r in records] == sorted(slots, reverse=True)
    assert [r.slot_ms for r in backend.history(job, limit=2)] == sorted(slots, reverse=True)[:2]
    assert backend.history(f"{job}-other") == []


def test_history_is_trimmed_to_history_size(backend: Backend, job: str) -> None:
    lease_only(backend)
    now = backend.now_ms()
    # Old slots (window widened so they may be claimed) whose records no late
    # instance needs any more: only history_size of them stay.
    for i in range(30):
        slot = now - DAY_MS + i * 1000
        claim = backend.claim(
            [
                request_for(
                    backend,
                    job,
                    slot,
                    window_before_ms=2 * DAY_MS,
                    keep_until_ms=slot + 1,
                )
            ]
        )[0]
        assert claim.won
        backend.mark(claim, State.SENT, task_id=f"t{i}")
    req = ClaimRequest(
        job=job,
        slot_ms=now,
        window_before_ms=60_000,
        window_after_ms=10_000,
        keep_until_ms=now + 120_000,
        history_size=5,
    )
    backend.claim([req])
    records = backend.history(job)
    assert len(records) <= 5
    assert records[0].slot_ms == now


def test_last_run_is_the_newest_sent_run(backend: Backend, job: str) -> None:
    assert backend.last_run(job) is None
    old, new = slots_from(backend, 2)
    sent = backend.claim([request_for(backend, job, old)])[0]
    backend.mark(sent, State.SENT, task_id="sent-one")
    backend.claim([request_for(backend, job, new)])  # claimed, never sent
    last = backend.last_run(job)
    assert last is not None and last.slot_ms == old and last.task_id == "sent-one"


def test_last_slots_reads_each_jobs_newest_scheduled_slot(backend: Backend, job: str) -> None:
    old, new = slots_from(backend, 2)
    backend.claim([request_for(backend, job, old), request_for(backend, job, new)])
    backend.claim([request_for(backend, f"{job}-b", old)])
    backend.claim_manual(job, "k", new + 120_000)  # a newer manual run does not count
    names = [job, f"{job}-b", f"{job}-none"]
    assert backend.last_slots(names) == {job: new, f"{job}-b": old}
    assert backend.last_slots([]) == {}


# -- instance registry -------------------------------------------------------


def test_registry_keeps_definitions_apart_from_heartbeats(backend: Backend, job: str) -> None:
    lease_only(backend)
    name = f"{job}-instance"
    info = InstanceInfo(
        name, "h", 1, "1.0", backend.now_ms(), fingerprint="f1", jobs={"a": "x", "b": "y"}
    )
    beat = replace(info, jobs={})
    assert backend.register(info, 60_000)
    assert backend.register(beat, 60_000)  # stored before: kept
    [listed] = [i for i in backend.instances() if i.instance == name]
    assert (listed.fingerprint, listed.jobs) == ("f1", {})
    assert backend.definitions(name) == {"a": "x", "b": "y"}
    # another schedule: its heartbeat is told to send the definitions
    assert not backend.register(replace(beat, fingerprint="f2"), 60_000)
    assert backend.register(replace(info, fingerprint="f2", jobs={"a": "z"}), 60_000)
    assert backend.definitions(name) == {"a": "z"}
    backend.unregister(name)
    assert backend.definitions(name) == {}
    # an entry that expired loses its definitions with it
    assert backend.register(info, 1)
    time.sleep(0.05)
    assert not backend.register(beat, 60_000)
    backend.unregister(name)


# -- run_now ---------------------------------------------------------------


def test_manual_claim_wins_once_per_key(make_backend: BackendFactory, job: str) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    keep = a.now_ms() + 60_000
    first = a.claim_manual(job, "deploy-42", keep)
    second = b.claim_manual(job, "deploy-42", keep)
    other = b.claim_manual(job, "deploy-43", keep)
    assert first.won and not second.won and other.won
    keys = sorted(r.manual_key or "" for r in a.history(job))
    assert keys == ["deploy-42", "deploy-43"]


def test_manual_claim_race_has_one_winner(make_backend: BackendFactory, job: str) -> None:
    backends = [make_backend(f"host-{i}") for i in range(6)]
    keep = backends[0].now_ms() + 60_000
    results: list[bool] = []
    barrier = threading.Barrier(len(backends))

    def race(b: Backend) -> None:
        barrier.wait()
        results.append(b.claim_manual(job, "same-key", keep).won)

    threads = [threading.Thread(target=race, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [False] * 5 + [True]


# -- lifecycle and failure -------------------------------------------------

UNREACHABLE = {
    "sqlite": "sqlite:////nonexistent-anarchon-dir/x/claims.db",
    "postgresql": "postgresql://postgres@127.0.0.1:1/test",
    "mysql": "mysql+pymysql://root@127.0.0.1:1/test",
    "redis": "redis://127.0.0.1:1/0",
    "rabbitmq": "amqp://guest:guest@127.0.0.1:1//",
}


def test_unreachable_backend_raises_backend_unavailable(backend_name: str) -> None:
    away = backend_from_url(UNREACHABLE[backend_name], instance="x")
    started = time.monotonic()
    expected: tuple[type[Exception], ...] = (BackendUnavailable,)
    if backend_name == "sqlite":
        expected = (BackendUnavailable, ConfigurationError)
    with pytest.raises(expected):
        away.open()
        away.claim([ClaimRequest("job", 0, 1, 1, 1)])
    assert time.monotonic() - started < 15
    away.close()


def test_constructing_does_not_connect(backend_name: str) -> None:
    backend_from_url(UNREACHABLE[backend_name], instance="x")  # no error: lazy


def test_close_twice_is_safe(make_backend: BackendFactory) -> None:
    b = make_backend("host-a")
    b.close()
    b.close()


def test_describe_masks_credentials(backend_name: str, tmp_path: object) -> None:
    url = {
        "postgresql": "postgresql://user:s3cret@127.0.0.1:1/test",
        "mysql": "mysql+pymysql://user:s3cret@127.0.0.1:1/test",
        "redis": "redis://:s3cret@127.0.0.1:1/0",
        "rabbitmq": "amqp://user:s3cret@127.0.0.1:1//",
        "sqlite": "sqlite:////tmp/x.db",
    }[backend_name]
    assert "s3cret" not in backend_from_url(url, instance="x").describe()


def test_kind_names_the_store(backend_name: str) -> None:
    """``kind`` is what ``check`` and the clock rule read: the store's name."""
    assert backend_from_url(UNREACHABLE[backend_name], instance="x").kind == backend_name


# -- batched calls (the scheduler's chunks) --------------------------------


def test_mark_many_records_each_claim_in_order(backend: Backend, job: str) -> None:
    slots = slots_from(backend, 4)
    claims = backend.claim([request_for(backend, f"{job}-{i % 2}", s) for i, s in enumerate(slots)])
    assert all(c.won for c in claims)
    task_ids = [f"task-{i}" for i in range(len(claims))]
    assert backend.mark_many(claims, State.SENT, task_ids=task_ids) == [True] * 4
    for i, claim in enumerate(claims):
        [record] = [r for r in backend.history(claim.job) if r.slot_ms == claim.slot_ms]
        assert (record.state, record.task_id) == (State.SENT, f"task-{i}")
        assert record.sent_at_ms is not None
    # sent again (a retry after a lost answer): written again, answered True
    assert backend.mark_many(claims, State.SENT, task_ids=task_ids) == [True] * 4
    assert backend.mark_many([], State.SENT) == []


def test_mark_many_fences_each_claim_by_its_token(backend: Backend, job: str) -> None:
    lease_only(backend)
    slots = slots_from(backend, 3)
    claims = backend.claim([request_for(backend, job, s) for s in slots])
    assert isinstance(claims[1].token, int)
    stale = Claim(job=job, slot_ms=claims[1].slot_ms, won=True, token=claims[1].token + 1)
    lost = Claim(job=job, slot_ms=claims[2].slot_ms, won=False)
    answers = backend.mark_many([claims[0], stale, lost], State.SENT, task_ids=["a", "b", "c"])
    assert answers == [True, False, False]
    states = {r.slot_ms: (r.state, r.task_id) for r in backend.history(job)}
    assert states[slots[0]] == (State.SENT, "a")
    assert states[slots[1]] == (State.CLAIMED, None)
    assert states[slots[2]] == (State.CLAIMED, None)


def test_mark_many_refuses_task_ids_of_another_length(backend: Backend, job: str) -> None:
    claim = backend.claim([request_for(backend, job)])[0]
    with pytest.raises(ValueError):
        backend.mark_many([claim], State.SENT, task_ids=["a", "b"])


def test_take_over_many_answers_each_slot(make_backend: BackendFactory, job: str) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    slots = slots_from(a, 3)
    requests = [request_for(a, job, s) for s in slots]
    sent, live, released = a.claim(requests)
    if not a.supports_leases:  # claim-only: no take-over at all
        assert not isinstance(b, LeaseBackend) and not hasattr(b, "take_over_many")
        assert not b.claim(requests)[0].won  # the slots stay a's
        return
    a.mark(sent, State.SENT, task_id="t")
    a.release([released])
    answers = b.take_over_many(requests)
    assert [c.slot_ms for c in answers] == slots
    assert [(c.won, c.reason) for c in answers[:2]] == [(False, "taken"), (False, "held")]
    assert answers[2].won and isinstance(answers[2].token, int)
    assert b.mark(answers[2], State.SENT, task_id="backup")
    assert a.mark(live, State.SENT, task_id="owner")
    assert b.take_over_many([]) == []


def test_take_over_many_takes_expired_leases_only(make_backend: BackendFactory, job: str) -> None:
    a, b = make_backend("host-a"), make_backend("host-b")
    lease_only(a)
    slots = slots_from(a, 2)
    short = [request_for(a, job, s, lease_ms=1) for s in slots]
    first, second = a.claim(short)
    a.mark(second, State.SENT, task_id="t")
    time.sleep(0.05)
    answers = b.take_over_many(short)
    assert [c.won for c in answers] == [True, False]
    assert isinstance(first.token, int) and answers[0].token == first.token + 1
    assert not a.mark(first, State.SENT, task_id="late")  # superseded: fenced
    states = [(r.slot_ms, r.state) for r in b.history(job)]
    assert (slots[0], State.SUPERSEDED) in states and (slots[0], State.CLAIMED) in states


def test_take_over_answers_held_while_a_backups_lease_runs(
    make_backend: BackendFactory, job: str
) -> None:
    """A backup that took a slot over and died before its send leaves a
    ``claimed`` record with a new lease: another backup is told ``"held"``
    (check again at that lease's end), then takes it over once it ended."""
    a, b, c = make_backend("host-a"), make_backend("host-b"), make_backend("host-c")
    lease_only(a)
    slot = slots_from(a, 1)[0]
    short = request_for(a, job, slot, lease_ms=1)
    first = a.claim([short])[0]
    assert first.won
    time.sleep(0.05)
    # The backup's lease must outlast the two checks below: on a loaded
    # machine they took up to 0.17 s (of a 300 ms lease, before). Then it is
    # waited out by the backend's clock.
    backup = b.take_over_many([request_for(b, job, slot, lease_ms=2000)])[0]
    lease_ends_ms = b.now_ms() + 2000  # at the latest
    assert backup.won and backup.token == 2
    assert [
        (x.won, x.reason) for x in (c.take_over_many([short])[0], *c.take_over_many([short]))
    ] == [
        (False, "held"),
        (False, "held"),
    ]
    while c.now_ms() <= lease_ends_ms:  # the backup's lease ends: it died before its send
        time.sleep(0.05)
    third = c.take_over_many([short])[0]
    assert third.won and third.token == 3
    assert c.mark(third, State.SENT, task_id="third")
    assert [(x.won, x.reason) for x in c.take_over_many([short])] == [(False, "taken")]
    assert not b.mark(backup, State.SENT, task_id="late")  # fenced out


def test_holding_reads_token_state_and_lease(make_backend: BackendFactory, job: str) -> None:
    a = make_backend("host-a")
    slots = slots_from(a, 4)
    held, sent, short, other = a.claim(
        [
            request_for(a, job, slots[0]),
            request_for(a, job, slots[1]),
            request_for(a, job, slots[2], lease_ms=1),
            request_for(a, job, slots[3]),
        ]
    )
    lost = Claim(job=job, slot_ms=slots[3], won=False)
    if not a.supports_leases:  # claim-only: no lease to read
        assert not isinstance(a, LeaseBackend) and not hasattr(a, "holding")
        assert (held.won, lost.won) == (True, False)
        return
    assert isinstance(other.token, int)
    stale = Claim(job=job, slot_ms=slots[3], won=True, token=other.token + 1)
    a.mark(sent, State.SENT, task_id="t")
    time.sleep(0.05)
    assert a.holding([held, sent, short, stale, lost]) == [True, False, False, False, False]
    # a margin beyond the 30 s lease: not held long enough
    assert a.holding([held], margin_ms=60_000) == [False]
    assert a.holding([]) == []
