"""What the importers' tests share: the old schedulers' stores, written with
the real packages' own APIs.

* redbeat: a Redis key prefix of the test's own (deleted afterwards) and an
  "old app" configured for it, on which ``RedBeatSchedulerEntry(...).save()``
  writes entries as celery-redbeat does.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from ..conftest import REDIS_URL, require_service


@pytest.fixture
def redbeat_prefix() -> Iterator[str]:
    """A redbeat key prefix of this test's own; its keys are deleted after."""
    require_service("redis")
    import redis

    prefix = f"redbeat-test:{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        client.delete(key)
    client.close()


def redbeat_app(prefix: str, **conf: Any) -> Celery:
    """The app celery-redbeat ran with: its Redis and key prefix."""
    app = Celery(f"old-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        redbeat_redis_url=REDIS_URL,
        redbeat_key_prefix=prefix,
        timezone="Europe/Berlin",
        **conf,
    )
    return app
