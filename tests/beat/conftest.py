"""Fixtures of the beat-side tests: backends to run on, apps' schedules,
broker stand-ins."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from ..conftest import backend_url, require_service
from .support import BROKER_DB, LEASE_BACKENDS, CountingRefuser


@pytest.fixture
def t0() -> float:
    """A whole second 10 s past the real now (a loaded machine may take
    seconds to set a test up, and the backend refuses slots older than its
    own now minus max_late).

    The SQLite backend judges the claim window by the process clock, so the
    test clock starts at the real time and moves forward by hand from there
    (``anarchon_max_skew`` is widened to let it run ahead).
    """
    return float(int(time.time()) + 10)


@pytest.fixture
def every_second() -> dict[str, Any]:
    return {"tick": {"task": "proj.tick", "schedule": 1.0, "args": (1, 2)}}


@pytest.fixture
def broker_queue() -> Iterator[str]:
    """A queue on the Redis broker, declared (so publishes are routed to it)
    and removed with its binding tables afterwards."""
    require_service("redis")
    name = f"send-path-{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:6379/{BROKER_DB}"
    with Connection(url) as conn:
        Queue(name, Exchange(name, type="direct"), routing_key=name).bind(
            conn.default_channel
        ).declare()
    yield name
    client = redis.Redis(db=BROKER_DB)
    client.delete(name, f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}")
    client.close()


@pytest.fixture
def refuser() -> Iterator[CountingRefuser]:
    server = CountingRefuser()
    yield server
    server.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'claims.db'}"


@pytest.fixture(params=LEASE_BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name: str = request.param
    require_service(name)
    if name == "redis":
        request.getfixturevalue("_redis_cleanup")
    elif name == "postgresql":
        request.getfixturevalue("_sql_cleanup")
    return backend_url(name, tmp_path)


@pytest.fixture(params=["sqlite", "postgresql", "mysql", "redis"])
def lease_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:

    name: str = request.param
    require_service(name)
    if name == "redis":
        request.getfixturevalue("_redis_cleanup")
    elif name in {"postgresql", "mysql"}:
        request.getfixturevalue("_sql_cleanup")
    return backend_url(name, tmp_path)
