"""The Celery app that integration tests run real ``celery beat`` processes on.

Configured through environment variables so each test picks its backend,
broker and queue:

* ``ITEST_BROKER``: Celery broker URL (default Redis db 1);
* ``ITEST_BACKEND``: ``anarchon_backend`` URL;
* ``ITEST_QUEUE``: the queue every task is sent to (read back by the test);
* ``ITEST_CONF``: JSON merged into ``app.conf`` (``beat_schedule`` included).
"""

from __future__ import annotations

import json
import os

from celery import Celery

#: The jobs every integration test runs unless ITEST_CONF replaces them.
SCHEDULES = {
    "every-second": 1.0,
    "cron-every-2s": "* * * * * */2",
    "minutely": "* * * * *",
}

app = Celery("itest")
app.conf.update(
    broker_url=os.environ.get("ITEST_BROKER", "redis://127.0.0.1:6379/1"),
    anarchon_backend=os.environ.get("ITEST_BACKEND") or None,
    task_default_queue=os.environ.get("ITEST_QUEUE", "itest"),
    task_ignore_result=True,
    beat_max_loop_interval=1,
    timezone="UTC",
    broker_connection_retry_on_startup=True,
    beat_schedule={
        name: {"task": "itest.noop", "schedule": schedule} for name, schedule in SCHEDULES.items()
    },
)
app.conf.update(json.loads(os.environ.get("ITEST_CONF", "{}")))


@app.task(name="itest.noop")
def noop() -> None:
    """Does nothing; tests read the messages, not the results."""
