"""Stored jobs through the command line, against real backends."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_anarchon.schedules import JobExists, Schedules

from .conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, require_service
from .test_cli import delete_redis_keys, drop_tables, make_app

#: Every Redis key these tests write starts with this (deleted at the end).
REDIS_PREFIX = f"anarchon-cli-stored:{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module", autouse=True)
def _clean_redis() -> Iterator[None]:
    yield
    delete_redis_keys(REDIS_URL, f"*{REDIS_PREFIX}*")


def backend_for(name: str, tmp_path: Path, run: str) -> str:
    """A backend URL of kind ``name`` with a namespace of its own."""
    return {
        "sqlite": f"sqlite:///{tmp_path / 'claims.db'}",
        "postgresql": f"{POSTGRES_URL}?prefix=st{run}_",
        "mysql": f"{MYSQL_URL}?prefix=st{run}_",
        "redis": f"{REDIS_URL}?prefix={REDIS_PREFIX}{run}:",
    }[name]


@pytest.fixture
def stored_app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Celery]:
    """An app (``tests.test_cli.make_app``: three code entries) on a
    backend of its own, of the kind parametrised indirectly (Redis by
    default)."""
    name = getattr(request, "param", "redis")
    require_service("redis")  # the broker
    require_service(name)
    run = uuid.uuid4().hex[:8]
    url = backend_for(name, tmp_path, run)
    yield make_app(anarchon_backend=url, task_default_queue=f"cli-stored-{run}")
    if name in {"postgresql", "mysql"}:
        drop_tables(url, f"st{run}_")


# -- the Schedules API under the commands ------------------------------------------


@pytest.mark.services
def test_a_refused_add_leaves_the_existing_jobs_pause_alone(stored_app: Celery) -> None:
    """``Schedules.add`` of a taken name wrote the new job's pause state
    before the job itself was refused, pausing (or resuming) the job
    already there."""
    with Schedules(stored_app) as schedules:
        schedules.add("held", "proj.held", 5.0, paused=True, note="keep")
        schedules.add("free", "proj.free", 5.0)
        for name, paused in (("held", False), ("free", True)):
            with pytest.raises(JobExists, match=f"stored job '{name}' exists"):
                schedules.add(name, "proj.other", 9.0, paused=paused)
        assert schedules.get("held").paused and not schedules.get("free").paused
        assert schedules.get("held").pause.note == "keep"  # type: ignore[union-attr]
