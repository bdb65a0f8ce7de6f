"""``Backend.history_many`` (the operator page's batched history read), on
every backend through the contract's parametrised fixture."""

from __future__ import annotations

import time

import pytest

from celery_anarchon.backends.base import Backend, State

from .test_contract import request_for, slots_from

pytestmark = pytest.mark.services


def _fill(backend: Backend, job: str, slots: list[int]) -> None:
    claims = backend.claim([request_for(backend, job, s) for s in slots])
    backend.mark_many([c for c in claims if c.won], State.SENT)


def test_history_many_answers_what_history_answers_per_job(backend: Backend, job: str) -> None:
    slots = slots_from(backend, 5)
    _fill(backend, job, slots)
    _fill(backend, f"{job}-b", slots[:2])
    names = [job, f"{job}-b", f"{job}-none"]
    found = backend.history_many(names)
    assert list(found) == names
    for name in names:
        assert found[name] == backend.history(name)
    assert [r.slot_ms for r in found[job]] == slots[::-1]
    assert found[f"{job}-none"] == []
    assert backend.history_many([]) == {}


def test_history_many_keeps_the_newest_limit_per_job(backend: Backend, job: str) -> None:
    slots = slots_from(backend, 5)
    _fill(backend, job, slots)
    _fill(backend, f"{job}-b", slots[:3])
    found = backend.history_many([job, f"{job}-b"], limit=2)
    assert [r.slot_ms for r in found[job]] == [slots[4], slots[3]]
    assert [r.slot_ms for r in found[f"{job}-b"]] == [slots[2], slots[1]]
    assert all(r.state is State.SENT and r.job == job for r in found[job])
    assert backend.history_many([job], limit=0) == {job: []}


def test_history_many_reads_only_slots_since(backend: Backend, job: str) -> None:
    slots = slots_from(backend, 6)
    _fill(backend, job, slots)
    found = backend.history_many([job], since_ms=slots[3])
    assert [r.slot_ms for r in found[job]] == [slots[5], slots[4], slots[3]]
    limited = backend.history_many([job], limit=2, since_ms=slots[1])
    assert [r.slot_ms for r in limited[job]] == [slots[5], slots[4]]


def test_history_many_reads_many_jobs_faster_than_one_by_one(backend: Backend, job: str) -> None:
    names = [f"{job}-{i}" for i in range(30)]
    for name in names[:20]:
        _fill(backend, name, slots_from(backend, 2))
    started = time.perf_counter()
    one_by_one = {name: backend.history(name) for name in names}
    alone_s = time.perf_counter() - started
    started = time.perf_counter()
    together = backend.history_many(names)
    together_s = time.perf_counter() - started
    assert together == one_by_one
    assert sum(len(records) for records in together.values()) == 40
    # RabbitMQ waits a quiet time to end each read: once, not once per job.
    assert together_s < max(alone_s / 3, 0.5), (together_s, alone_s)
