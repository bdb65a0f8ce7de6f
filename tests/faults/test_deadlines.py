"""Hung backends and delayed requests (issue 12, items 2 and 3), on the
real services through the test's own proxy (:class:`tests.faults.servers.Proxy`).

* A backend that accepts connections and never answers (the proxy's
  blackhole) used to hang a PostgreSQL call for good: libpq waits on a
  socket whose data the proxy acknowledges, so neither
  ``statement_timeout`` (the server never sees the query) nor
  ``tcp_user_timeout`` ever fires. Every call now raises
  BackendUnavailable in bounded time.
* A claim held up in the network past the moment its client gave up used
  to be run when it arrived (Redis ran a queued script 29 s late), leaving
  a live claim owned by an instance that had given up on it. Every claim
  and take-over now carries a deadline in the backend's time, which the
  backend enforces by its own clock: a late request claims nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import ClaimRequest, LeaseBackend
from celery_anarchon.exceptions import BackendUnavailable

from ..conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, require_service
from .harness import drop_backend_data
from .servers import Proxy

pytestmark = [pytest.mark.services, pytest.mark.faults]

KINDS = ["postgresql", "mysql", "redis"]
PORTS = {"postgresql": 5432, "mysql": 3306, "redis": 6379}
#: The client-side bound the tests give each backend, seconds.
TIMEOUT_S = 1.0


def _url(kind: str, run: str, port: int | None = None) -> str:
    base = {"postgresql": POSTGRES_URL, "mysql": MYSQL_URL, "redis": REDIS_URL}[kind]
    if port is not None:
        base = base.replace(f"127.0.0.1:{PORTS[kind]}", f"127.0.0.1:{port}", 1)
    if kind == "redis":
        return f"{base}?prefix=anarchon-faults:{run}:&socket_timeout={TIMEOUT_S}"
    return f"{base}?prefix=f{run}_&connect_timeout={TIMEOUT_S}&statement_timeout={TIMEOUT_S}"


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[str, Proxy, LeaseBackend, LeaseBackend]]:
    """``(kind, proxy, backend through the proxy, backend direct)``, open."""
    kind = request.param
    require_service(kind)
    run = uuid.uuid4().hex[:8]
    with Proxy(PORTS[kind]) as proxy:
        direct = backend_from_url(_url(kind, run), instance="direct")
        proxied = backend_from_url(_url(kind, run, proxy.port), instance="proxied")
        assert isinstance(direct, LeaseBackend) and isinstance(proxied, LeaseBackend)
        try:
            direct.open()
            proxied.open()
            yield kind, proxy, proxied, direct
        finally:
            proxy.restore()
            proxy.request_delay = 0.0
            proxied.close()
            direct.close()
            drop_backend_data(kind, _url(kind, run), run)


def _request(slot_ms: int, **kw: int) -> ClaimRequest:
    return ClaimRequest("j", slot_ms, 60_000, 10_000, slot_ms + 3_600_000, lease_ms=30_000, **kw)


def _bounded(call: object, limit_s: float) -> float:
    """Run ``call``; it must raise BackendUnavailable within ``limit_s``
    seconds. How long it took, seconds."""
    started = time.monotonic()
    with pytest.raises(BackendUnavailable):
        call()  # type: ignore[operator]
    took = time.monotonic() - started
    assert took < limit_s, f"took {took:.1f} s"
    return took


def test_every_call_to_a_hung_backend_is_bounded(
    pair: tuple[str, Proxy, LeaseBackend, LeaseBackend],
) -> None:
    """Blackholed after open: claim, history, the clock and a fresh
    connect each give up within a few seconds, and the backend answers
    again once the proxy passes traffic."""
    kind, proxy, proxied, _ = pair
    slot = (proxied.now_ms() // 1000) * 1000
    proxy.blackhole()
    limit = TIMEOUT_S + 3
    _bounded(lambda: proxied.claim([_request(slot)]), limit)
    _bounded(lambda: proxied.history("j"), limit)
    _bounded(proxied.now_ms, limit)
    proxied.close()
    _bounded(proxied.open, limit + TIMEOUT_S)
    proxy.restore()
    deadline = time.monotonic() + 10
    while True:
        try:
            proxied.open()
            assert proxied.claim([_request(slot)])[0].won
            break
        except BackendUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_claim_delayed_past_its_deadline_claims_nothing(
    pair: tuple[str, Proxy, LeaseBackend, LeaseBackend],
) -> None:
    """The claim reaches the backend 3 s late, after its client gave up
    (within its bound): it must not leave a claim behind, and the slot is
    then claimed properly."""
    kind, proxy, proxied, direct = pair
    slot = (direct.now_ms() // 1000) * 1000
    proxied.now_ms()  # a pooled connection, ready
    proxy.request_delay = 3.0
    _bounded(lambda: proxied.claim([_request(slot)]), 3.0)
    _bounded(lambda: proxied.take_over_many([_request(slot + 1000)]), 3.0)
    time.sleep(4.5)  # both delayed requests have reached the backend now
    assert direct.history("j") == []
    won = direct.claim([_request(slot), _request(slot + 1000)])
    assert [c.won for c in won] == [True, True]


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_past_its_deadline_is_answered_deadline(kind: str) -> None:
    """The backend judges the deadline by its own clock: a claim or a
    take-over whose deadline (backend time) has passed claims nothing and
    says so (``"deadline"``); one within it claims."""
    require_service(kind)
    run = uuid.uuid4().hex[:8]
    backend = backend_from_url(_url(kind, run), instance="dl")
    assert isinstance(backend, LeaseBackend)
    try:
        backend.open()
        now = backend.now_ms()
        slot = (now // 1000) * 1000
        late = backend.claim(
            [_request(slot, deadline_ms=now - 1), _request(slot + 1, deadline_ms=now - 1)]
        )
        assert [(c.won, c.reason) for c in late] == [(False, "deadline")] * 2
        [taken_late] = backend.take_over_many([_request(slot + 2, deadline_ms=now - 1)])
        assert (taken_late.won, taken_late.reason) == (False, "deadline")
        assert backend.history("j") == []
        ok = backend.claim([_request(slot, deadline_ms=now + 60_000)])
        assert ok[0].won
    finally:
        backend.close()
        drop_backend_data(kind, _url(kind, run), run)
