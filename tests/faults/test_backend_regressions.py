"""Regression tests for backend defects the fault campaign found.

* A history record that is not ours (a foreign row with an unknown state, a
  value that is not our JSON) made ``history()`` raise ``ValueError`` or
  ``JSONDecodeError``; the scheduler reads history at start-up, so every
  beat exited ("bad input: foreign row in our table"). Such records are now
  left out with a warning, and their slot stays taken.
* A table of our name made by another program passed ``open()`` and failed
  every query after it; ``open()`` now refuses it with a ConfigurationError
  naming the table and the ``prefix`` option.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend, ClaimRequest, State
from celery_anarchon.exceptions import ConfigurationError

from ..conftest import POSTGRES_URL, REDIS_URL, require_service

pytestmark = pytest.mark.services


def _open(url: str) -> Backend:
    backend = backend_from_url(url, instance=f"regression-{uuid.uuid4().hex[:6]}")
    backend.open()
    return backend


def _request(job: str, slot_ms: int) -> ClaimRequest:
    return ClaimRequest(job, slot_ms, 10**9, 10**9, slot_ms + 3_600_000)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_sql_history_leaves_out_a_row_of_unknown_state(kind: str, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:8]
    if kind == "postgresql":
        require_service("postgresql")
        url = f"{POSTGRES_URL}?prefix=reg{run}_"
        engine_url = POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1)
    else:
        url = f"sqlite:///{tmp_path / 'claims.db'}?prefix=reg{run}_"
        engine_url = f"sqlite:///{tmp_path / 'claims.db'}"
    backend = _open(url)
    engine = sa.create_engine(engine_url)
    now_ms = int(time.time()) * 1000
    try:
        good = backend.claim([_request("j", now_ms)])[0]
        assert good.won
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"INSERT INTO reg{run}_runs (job, slot_ms, token, state, owner, keep_until_ms)"
                    " VALUES ('j', :slot, 1, 'bogus', 'someone-else', :keep)"
                ),
                {"slot": now_ms + 1000, "keep": now_ms + 3_600_000},
            )
        history = backend.history("j")
        assert [(r.slot_ms, r.state) for r in history] == [(now_ms, State.CLAIMED)]
        # The foreign row's slot stays taken: never claimed over it.
        lost = backend.claim([_request("j", now_ms + 1000)])[0]
        assert not lost.won and lost.reason == "taken"
    finally:
        backend.close()
        if kind == "postgresql":
            with engine.begin() as conn:
                for table in ("runs", "manual", "instances", "meta"):
                    conn.execute(sa.text(f"DROP TABLE IF EXISTS reg{run}_{table}"))
        engine.dispose()


def test_redis_history_leaves_out_a_record_that_is_not_ours() -> None:
    require_service("redis")
    import redis

    prefix = f"anarchon-reg:{uuid.uuid4().hex[:8]}:"
    backend = _open(f"{REDIS_URL}?prefix={prefix}")
    client = redis.Redis.from_url(REDIS_URL)
    now_ms = int(time.time()) * 1000
    tag = "{" + prefix + "j}"
    try:
        assert backend.claim([_request("j", now_ms)])[0].won
        for i, value in enumerate(["not json", '{"slot_ms": 1, "state": "bogus"}', "[]"]):
            member = str(now_ms + 1000 * (i + 1))
            client.hset(f"{tag}:runs", member, value)
            client.zadd(f"{tag}:index", {member: now_ms + 1000 * (i + 1)})
        history = backend.history("j")
        assert [(r.slot_ms, r.state) for r in history] == [(now_ms, State.CLAIMED)]
    finally:
        backend.close()
        for key in client.scan_iter(match="{" + prefix + "*"):
            client.delete(key)
        client.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_sql_open_refuses_a_foreign_table_of_our_name(kind: str, tmp_path: Path) -> None:
    """A table of our name with other columns used to pass open() (``CREATE
    TABLE IF NOT EXISTS`` does nothing) and then fail every query: an
    outage retried forever ("bad input: foreign table with our name")."""
    run = uuid.uuid4().hex[:8]
    if kind == "postgresql":
        require_service("postgresql")
        url = f"{POSTGRES_URL}?prefix=reg{run}_"
        engine_url = POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1)
    else:
        url = f"sqlite:///{tmp_path / 'claims.db'}?prefix=reg{run}_"
        engine_url = f"sqlite:///{tmp_path / 'claims.db'}"
    engine = sa.create_engine(engine_url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE reg{run}_runs (id integer PRIMARY KEY, payload text)"))
    backend = backend_from_url(url, instance="regression")
    try:
        with pytest.raises(
            ConfigurationError, match=rf"reg{run}_runs lacks column\(s\) job.*prefix"
        ):
            backend.open()
    finally:
        backend.close()
        with engine.begin() as conn:
            for table in ("runs", "manual", "instances", "meta"):
                conn.execute(sa.text(f"DROP TABLE IF EXISTS reg{run}_{table}"))
        engine.dispose()


def test_redis_claim_of_a_job_with_a_foreign_key_is_lost_not_an_outage() -> None:
    """A key of one job holding another program's value (``WRONGTYPE``) made
    a claim batch of that job alone raise BackendUnavailable: the scheduler
    then stopped claiming every job during its backoff ("bad input: foreign
    key where our history is"). The request is now lost, "unknown"."""
    require_service("redis")
    import redis

    prefix = f"anarchon-reg:{uuid.uuid4().hex[:8]}:"
    backend = _open(f"{REDIS_URL}?prefix={prefix}")
    client = redis.Redis.from_url(REDIS_URL)
    now_ms = int(time.time()) * 1000
    try:
        client.set("{" + prefix + "bad}:runs", "not ours")
        [claim] = backend.claim([_request("bad", now_ms)])
        assert (claim.won, claim.reason) == (False, "unknown")
        good, bad = backend.claim([_request("good", now_ms), _request("bad", now_ms + 1)])
        assert good.won and not bad.won
    finally:
        backend.close()
        for key in client.scan_iter(match="{" + prefix + "*"):
            client.delete(key)
        client.close()
