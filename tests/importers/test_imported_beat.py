"""Jobs imported from celery-redbeat and django-celery-beat, run by two real
``celery beat`` processes: every slot of each is sent once, a disabled
entry sends nothing."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from celery import Celery
from redbeat import RedBeatSchedulerEntry

from celery_anarchon.importers import import_django_celery_beat, import_redbeat

from ..beats import BeatCluster, count_sent
from ..conftest import REDIS_URL, require_service
from .conftest import DjangoDatabases, add_task, clear_rows, redbeat_app

pytestmark = [pytest.mark.services, pytest.mark.integration]

#: Only a long-period code job, as the beats' own beat_schedule.
LONG_ONLY = {"hourly": {"task": "itest.noop", "schedule": 3600.0}}


def delete_keys(pattern: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=pattern, count=1000):
        client.delete(key)
    client.close()


def test_two_beats_send_each_slot_of_the_imported_jobs_once(
    tmp_path: Path, redbeat_prefix: str, django_databases: DjangoDatabases
) -> None:
    require_service("redis")
    from django_celery_beat.models import IntervalSchedule

    prefix = f"anarchon-import:{uuid.uuid4().hex[:8]}:"
    url = f"{REDIS_URL}?prefix={prefix}"
    cluster = BeatCluster(url, tmp_path, conf={"beat_schedule": LONG_ONLY, "anarchon_jitter": 0})
    queue = {"queue": cluster.queue}
    old = redbeat_app(redbeat_prefix)
    RedBeatSchedulerEntry("rb-tick", "itest.noop", 1.0, options=queue, app=old).save()
    RedBeatSchedulerEntry("rb-off", "itest.noop", 1.0, options=queue, enabled=False, app=old).save()
    clear_rows()
    every_2s = IntervalSchedule.objects.create(every=2, period="seconds")
    add_task("default", "dj-tick", "itest.noop", interval=every_2s, queue=cluster.queue)

    app = Celery("import-client", set_as_current=False)
    app.conf.update(
        anarchon_backend=url,
        beat_schedule=LONG_ONLY,
        broker_url="memory://",
        redbeat_redis_url=REDIS_URL,
        redbeat_key_prefix=redbeat_prefix,
    )
    assert import_redbeat(app).ok
    assert import_django_celery_beat(app).ok

    cluster.start(2)
    try:
        assert cluster.wait_ticking(timeout=40), cluster.logs()
        started_ms = int(time.time() * 1000)
        time.sleep(6)
        cluster.stop()
        assert all(p.returncode == 0 for p in cluster.procs), cluster.logs()
        sent = count_sent(cluster.read_sent())
    finally:
        cluster.stop()
        delete_keys(f"*{prefix}*")
    assert {k: n for k, n in sent.items() if n > 1} == {}
    assert not [k for k in sent if k[0] == "rb-off"]
    for job, period_ms, at_least in (("rb-tick", 1000, 4), ("dj-tick", 2000, 2)):
        slots = sorted(t for j, t in sent if j == job)
        assert len(slots) >= at_least, (job, slots, cluster.logs())
        # Consecutive slots of its grid from the first one sent: none left out.
        assert slots == list(range(slots[0], slots[-1] + 1, period_ms)), (job, slots)
        assert slots[-1] >= started_ms
    # dj-tick never ran: on the epoch's grid. rb-tick: on its last run's second.
    assert all(t % 2000 == 0 for j, t in sent if j == "dj-tick")
    assert all(t % 1000 == 0 for j, t in sent if j == "rb-tick")
