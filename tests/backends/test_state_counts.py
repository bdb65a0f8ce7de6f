"""``Backend.state_counts`` and ``Backend.jobs_with_state`` (the operator
page's totals and state filters), on every backend through the contract's
parametrised fixture: each answers what the default implementation (over
``history_many``) answers on the same data, and that answer is checked."""

from __future__ import annotations

import time

import pytest

from celery_anarchon.backends.base import AbsentRecord, Backend, State

from ..conftest import BackendFactory
from .test_contract import request_for, slots_from

pytestmark = pytest.mark.services


def _seed(make_backend: BackendFactory, job: str) -> tuple[Backend, list[str], list[int]]:
    """Jobs ``job-a``, ``job-b``, ``job-c`` (no records) and ``job-other``
    (records, never asked about), over 8 slots; returns the backend, the
    jobs asked about and the slots, oldest first."""
    a, b = make_backend("host-a"), make_backend("host-b")
    slots = slots_from(a, 8)
    one, two, other = f"{job}-a", f"{job}-b", f"{job}-other"
    claims = a.claim(
        [request_for(a, one, s, lease_ms=1) for s in slots[:6]]
        + [request_for(a, two, s) for s in slots[:3]]
        + [request_for(a, other, s) for s in slots[5:7]]
    )
    first, sent, lost, failed, running, held = claims[:6]
    b_sent, b_old, b_lost = claims[6:9]
    a.mark_many([sent, lost, failed, running, b_sent, b_old, b_lost, *claims[9:]], State.SENT)
    a.mark_many([lost, b_lost], State.LOST)
    a.mark(running, State.RUNNING)
    a.mark(failed, State.RUNNING)
    a.mark(failed, State.FAILED)
    a.record_many_if_absent(
        [
            AbsentRecord(one, slots[6], State.MISSED, keep_until_ms=slots[6] + 120_000),
            AbsentRecord(one, slots[7], State.SKIPPED, keep_until_ms=slots[7] + 120_000),
            AbsentRecord(two, slots[7], State.MISSED, keep_until_ms=slots[7] + 120_000),
            AbsentRecord(other, slots[7], State.MISSED, keep_until_ms=slots[7] + 120_000),
        ]
    )
    if a.supports_leases:
        time.sleep(0.05)  # the 1 ms leases of job-a's claims end
        taken = b.take_over_many([request_for(b, one, slots[0], lease_ms=1)])[0]
        assert taken.won  # slots[0]: superseded, and claimed again by b
    a.claim_manual(two, "deploy", a.now_ms() + 120_000)
    return a, [one, two, f"{job}-c"], slots


def test_state_counts_counts_each_state_by_slot_since(
    make_backend: BackendFactory, job: str
) -> None:
    backend, jobs, slots = _seed(make_backend, job)
    for since in (0, slots[1], slots[3], slots[7], slots[7] + 1, backend.now_ms() + 60_000):
        expected = Backend.state_counts(backend, jobs, since)
        assert backend.state_counts(jobs, since) == expected, since
    everything = backend.state_counts(jobs, 0)
    superseded = 1 if backend.supports_leases else 0
    assert everything == {
        state: count
        for state, count in {
            # job-a's first slot (b's claim after a take-over), its held slot, run_now
            State.CLAIMED: 3,
            State.SUPERSEDED: superseded,
            State.SENT: 3,
            State.LOST: 2,
            State.FAILED: 1,
            State.RUNNING: 1,
            State.MISSED: 2,
            State.SKIPPED: 1,
        }.items()
        if count
    }
    # A slot at since counts, an older one does not; by slot, not by write.
    assert backend.state_counts(jobs, slots[6]) == {
        State.MISSED: 2,
        State.SKIPPED: 1,
        State.CLAIMED: 1,
    }
    assert backend.state_counts([], 0) == {}
    assert backend.state_counts([f"{job}-c"], 0) == {}


def test_jobs_with_state_answers_the_jobs_with_a_record_since(
    make_backend: BackendFactory, job: str
) -> None:
    backend, jobs, slots = _seed(make_backend, job)
    one, two, _ = jobs
    cases = [
        {State.MISSED},
        {State.LOST},
        {State.FAILED, State.SKIPPED},
        {State.MISSED, State.LOST, State.FAILED},
        {State.SUPERSEDED},
        set(),
    ]
    for states in cases:
        for since in (0, slots[3], slots[7], slots[7] + 1):
            expected = Backend.jobs_with_state(backend, jobs, states, since)
            assert backend.jobs_with_state(jobs, states, since) == expected, (states, since)
    assert backend.jobs_with_state(jobs, {State.MISSED}, 0) == {one, two}
    assert backend.jobs_with_state(jobs, {State.LOST}, slots[2]) == {one, two}
    assert backend.jobs_with_state(jobs, {State.LOST}, slots[3]) == set()
    assert backend.jobs_with_state(jobs, {State.FAILED}, slots[3]) == {one}
    assert backend.jobs_with_state(jobs, {State.FAILED}, slots[4]) == set()
    assert backend.jobs_with_state([two], {State.SKIPPED}, 0) == set()
    assert backend.jobs_with_state([], {State.MISSED}, 0) == set()


def test_a_long_job_name_is_answered_by_its_name(backend: Backend, job: str) -> None:
    long = f"{job}-" + "x" * 300  # stored under a hashed key on SQL
    slot = slots_from(backend, 1)[0]
    backend.record_many_if_absent(
        [AbsentRecord(long, slot, State.MISSED, keep_until_ms=slot + 120_000)]
    )
    assert backend.jobs_with_state([long, job], {State.MISSED}, slot) == {long}
    assert backend.state_counts([long, job], slot) == {State.MISSED: 1}
