"""A cluster-wide run limit is part of the claim itself: under concurrent
claimers on every lease backend, exactly ``max_runs`` claims win."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace

import pytest

from celery_anarchon.backends.base import ClaimRequest, LeaseBackend, State

from ..conftest import RUN_ID, BackendFactory, require_service


@pytest.fixture(params=["sqlite", "postgresql", "mysql", "redis"])
def backend_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_service(name)
    request.getfixturevalue("_redis_cleanup" if name == "redis" else "_sql_cleanup")
    return name


def request_for(job: str, slot_ms: int, max_runs: int | None) -> ClaimRequest:
    return ClaimRequest(job, slot_ms, 60_000, 10_000, slot_ms + 600_000, max_runs=max_runs)


def test_exactly_max_runs_claims_win_under_racing_instances(
    make_backend: BackendFactory, backend_name: str
) -> None:
    tag = uuid.uuid4().hex[:6]
    prefix = f"anarchon-test:{RUN_ID}:{tag}:" if backend_name == "redis" else f"t{RUN_ID}_{tag}_"
    instances = [make_backend(f"i{n}", prefix=prefix) for n in range(4)]
    now_ms = int(time.time() * 1000)
    slots = [now_ms - 10_000 + i * 100 for i in range(30)]
    answers: list[tuple[int, str]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(instances))

    def race(backend: LeaseBackend) -> None:
        barrier.wait()
        for slot in slots:  # every instance tries every slot, one call each
            [claim] = backend.claim([request_for("limited", slot, 5)])
            with lock:
                answers.append((slot, "won" if claim.won else claim.reason))

    threads = [threading.Thread(target=race, args=(b,)) for b in instances]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [slot for slot, answer in answers if answer == "won"]
    assert len(won) == 5 and len(set(won)) == 5
    assert {answer for _, answer in answers} <= {"won", "taken", "finished"}
    assert any(answer == "finished" for _, answer in answers)
    assert instances[0].won_counts(["limited", "other"]) == {"limited": 5, "other": 0}


def test_a_taken_slot_does_not_count_and_a_limit_raised_revives(
    make_backend: BackendFactory, backend_name: str
) -> None:
    tag = uuid.uuid4().hex[:6]
    prefix = f"anarchon-test:{RUN_ID}:{tag}:" if backend_name == "redis" else f"t{RUN_ID}_{tag}_"
    a, b = make_backend("a", prefix=prefix), make_backend("b", prefix=prefix)
    now_ms = int(time.time() * 1000)
    assert a.claim([request_for("j", now_ms, 2)])[0].won
    assert b.claim([request_for("j", now_ms, 2)])[0].reason == "taken"
    assert a.won_counts(["j"]) == {"j": 1}
    assert b.claim([request_for("j", now_ms + 1, 2)])[0].won
    assert a.claim([request_for("j", now_ms + 2, 2)])[0].reason == "finished"
    assert a.claim([request_for("j", now_ms + 2, 3)])[0].won  # the limit raised
    # A batch mixing limited and unlimited jobs answers each on its own terms.
    mixed = a.claim([request_for("j", now_ms + 3, 3), request_for("free", now_ms + 3, None)])
    assert [(c.won, c.reason) for c in mixed] == [(False, "finished"), (True, "")]


def test_the_last_run_lost_to_a_live_owner_is_taken_and_a_released_run_is_given_back(
    make_backend: BackendFactory, backend_name: str
) -> None:
    """The limit's last slot, held by another instance, answers "taken" (so
    the loser watches it for a take-over), and a released claim does not
    use up the limit."""
    tag = uuid.uuid4().hex[:6]
    prefix = f"anarchon-test:{RUN_ID}:{tag}:" if backend_name == "redis" else f"t{RUN_ID}_{tag}_"
    a, b = make_backend("a", prefix=prefix), make_backend("b", prefix=prefix)
    now_ms = int(time.time() * 1000)
    [held] = a.claim([request_for("one", now_ms, 1)])
    assert held.won
    assert b.claim([request_for("one", now_ms, 1)])[0].reason == "taken"
    assert b.claim([request_for("one", now_ms + 1, 1)])[0].reason == "finished"
    a.release([held])
    [again] = b.claim([request_for("one", now_ms, 1)])
    assert again.won, again
    assert a.won_counts(["one"]) == {"one": 1}


def test_a_take_over_keeps_the_run_and_a_lost_run_is_not_given_back(
    make_backend: BackendFactory, backend_name: str
) -> None:
    """The documented count: a backup's take-over of a counted claim counts
    nothing more; recording a won claim ``lost`` gives nothing back."""
    tag = uuid.uuid4().hex[:6]
    prefix = f"anarchon-test:{RUN_ID}:{tag}:" if backend_name == "redis" else f"t{RUN_ID}_{tag}_"
    a, b = make_backend("a", prefix=prefix), make_backend("b", prefix=prefix)
    now_ms = int(time.time() * 1000)
    short = replace(request_for("k", now_ms, 2), lease_ms=1)
    [held] = a.claim([short])
    assert held.won
    time.sleep(0.05)  # the lease ran out: its owner counts as dead
    [taken] = b.take_over_many([short])
    assert taken.won and taken.token == 2
    assert a.won_counts(["k"]) == {"k": 1}
    [second] = b.claim([request_for("k", now_ms + 1, 2)])
    assert second.won
    assert b.mark(second, State.LOST, error="send failed")
    assert a.won_counts(["k"]) == {"k": 2}
    assert a.claim([request_for("k", now_ms + 2, 2)])[0].reason == "finished"
