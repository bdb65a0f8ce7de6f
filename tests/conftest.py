"""Shared fixtures: real services on 127.0.0.1, one backend factory.

A backend whose service is down is a skip when run by hand and a failure
under CI (``CI=true``), so a green CI run really exercised every backend.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend

if TYPE_CHECKING:
    from .faults.servers import RedisServer

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

#: service name -> (host, port) it needs.
SERVICES = {
    "postgresql": ("127.0.0.1", 5432),
    "mysql": ("127.0.0.1", 3306),
    "redis": ("127.0.0.1", 6379),
    "rabbitmq": ("127.0.0.1", 5672),
}

POSTGRES_URL = os.environ.get("ANARCHON_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("ANARCHON_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("ANARCHON_TEST_REDIS", "redis://127.0.0.1:6379/0")
#: Run-unique prefix so parallel or repeated runs (and pytest-xdist
#: workers, each its own process) never share state.
RUN_ID = uuid.uuid4().hex[:8]

RABBIT_VHOST = f"anarchon-contract-{RUN_ID}"
RABBIT_URL = f"amqp://guest:guest@127.0.0.1:5672/{RABBIT_VHOST}"

ALL_BACKENDS = ["sqlite", "postgresql", "mysql", "redis", "rabbitmq"]


def service_up(name: str) -> bool:
    """True when the service's TCP port accepts a connection."""
    if name not in SERVICES:
        return True
    try:
        with socket.create_connection(SERVICES[name], timeout=1):
            return True
    except OSError:
        return False


def require_service(name: str) -> None:
    """Skip (by hand) or fail (under CI) when ``name`` is not running."""
    if service_up(name):
        return
    message = f"{name} is not running on {SERVICES[name][0]}:{SERVICES[name][1]}"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def rabbit_vhost() -> Iterator[str]:
    """A RabbitMQ vhost of the test run's own, deleted afterwards."""
    require_service("rabbitmq")
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        if IN_CI:
            pytest.fail("rabbitmqctl is not installed")
        pytest.skip("rabbitmqctl is not installed")
    subprocess.run([ctl, "add_vhost", RABBIT_VHOST], capture_output=True, check=False)
    subprocess.run(
        [ctl, "set_permissions", "-p", RABBIT_VHOST, "guest", ".*", ".*", ".*"],
        capture_output=True,
        check=True,
    )
    yield RABBIT_VHOST
    subprocess.run([ctl, "delete_vhost", RABBIT_VHOST], capture_output=True, check=False)


def backend_url(name: str, tmp_path: Path) -> str:
    """The URL of a backend of kind ``name`` for tests."""
    return {
        "sqlite": f"sqlite:///{tmp_path / 'claims.db'}",
        "postgresql": POSTGRES_URL,
        "mysql": MYSQL_URL,
        "redis": REDIS_URL,
        "rabbitmq": RABBIT_URL,
    }[name]


def backend_options(name: str) -> dict[str, Any]:
    """Options giving each backend kind a run-unique namespace."""
    if name in {"sqlite", "postgresql", "mysql"}:
        return {"prefix": f"t{RUN_ID}_"}
    if name == "redis":
        return {"prefix": f"anarchon-test:{RUN_ID}:"}
    return {"prefix": f"test.{RUN_ID}.", "slot_ttl": 120}


@pytest.fixture(scope="session")
def _sql_cleanup() -> Iterator[None]:
    yield
    import sqlalchemy as sa

    for url in (POSTGRES_URL, MYSQL_URL):
        try:
            engine = sa.create_engine(
                url.replace("postgresql://", "postgresql+psycopg://", 1),
                connect_args={"connect_timeout": 2},
            )
            with engine.begin() as conn:
                for table in sa.inspect(conn).get_table_names():
                    if table.startswith(f"t{RUN_ID}_"):
                        conn.execute(sa.text(f"DROP TABLE {table}"))
            engine.dispose()
        except Exception:  # a database that was never up has nothing to clean
            pass


@pytest.fixture(scope="session")
def _redis_cleanup() -> Iterator[None]:
    yield
    try:
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
        for key in client.scan_iter(match=f"{{anarchon-test:{RUN_ID}:*", count=1000):
            client.delete(key)
        client.close()
    except Exception:
        pass


BackendFactory = Callable[..., Backend]


@pytest.fixture(params=ALL_BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_service(name)
    if name == "rabbitmq":
        request.getfixturevalue("rabbit_vhost")
    elif name == "redis":
        request.getfixturevalue("_redis_cleanup")
    elif name in {"postgresql", "mysql"}:
        request.getfixturevalue("_sql_cleanup")
    return name


@pytest.fixture
def make_backend(backend_name: str, tmp_path: Path) -> Iterator[BackendFactory]:
    """Build opened backends of the parametrised kind; all closed at the end.

    Call it once per simulated instance: ``make_backend("host-a")``.
    """
    made: list[Backend] = []

    def make(instance: str | None = None, **options: Any) -> Backend:
        backend = backend_from_url(
            backend_url(backend_name, tmp_path),
            instance=instance or f"test-{uuid.uuid4().hex[:6]}",
            options={**backend_options(backend_name), **options},
        )
        backend.open()
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def backend(make_backend: BackendFactory) -> Backend:
    """One opened backend of the parametrised kind."""
    return make_backend("instance-a")


@pytest.fixture
def job() -> str:
    """A job name no other test uses."""
    return f"job-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A ``redis-server`` of the test's own (it may crash and restart it)."""
    from .faults.servers import RedisServer  # the harness imports this module

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.crash()


# -- the full fault profile ---------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--faults-full",
        action="store_true",
        help="also run the fault rows marked faults_full (left out of the default run)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``--faults-full``, deselect the rows marked ``faults_full``:
    fault rows whose code path a default row covers on another store
    (docs/reliability.md lists which run where)."""
    if config.getoption("--faults-full"):
        return
    kept = [item for item in items if item.get_closest_marker("faults_full") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(
            items=[item for item in items if item.get_closest_marker("faults_full") is not None]
        )
        items[:] = kept
