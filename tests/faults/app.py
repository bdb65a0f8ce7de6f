"""The Celery app of the fault tests: beats send on it, a worker runs it.

Configured through the environment, like :mod:`tests.beat_app`:

* ``ITEST_BROKER``: Celery broker URL (default Redis db 1);
* ``ITEST_BACKEND``: ``anarchon_backend`` URL;
* ``ITEST_QUEUE``: the queue tasks go to; every message is also routed to
  ``<queue>.audit`` (same direct exchange, same routing key), which nobody
  consumes, so the harness reads back every publish while a worker runs them;
* ``ITEST_CONF``: JSON merged into ``app.conf`` (``beat_schedule`` included);
* ``ITEST_EXEC_LOG``: file to which the task appends one JSON line per
  execution: ``[job, slot ms, pid, epoch s]``.

The worker integration is installed (:func:`celery_anarchon.worker.install`),
so a second delivery of one slot is discarded before the body runs.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from typing import Any

from celery import Celery
from kombu import Exchange, Queue

import celery_anarchon.worker
from tests.beat.support import SEND_DELAY, give_unserializable_args, install_send_delay

#: The jobs of every fault run unless ITEST_CONF replaces them.
SCHEDULES: dict[str, Any] = {
    "every-second": 1.0,
    "cron-every-2s": "* * * * * */2",
    "minutely": "* * * * *",
}

QUEUE = os.environ.get("ITEST_QUEUE", "faults")
EXCHANGE = Exchange(QUEUE, type="direct")

# ``kill -USR2 <pid>`` prints every thread's stack to the process's log: how
# the harness finds out where a hung beat or worker is.
faulthandler.register(signal.SIGUSR2, all_threads=True)

app = Celery("faults")
app.conf.update(
    broker_url=os.environ.get("ITEST_BROKER", "redis://127.0.0.1:6379/1"),
    anarchon_backend=os.environ.get("ITEST_BACKEND") or None,
    task_queues=[
        Queue(QUEUE, EXCHANGE, routing_key=QUEUE),
        Queue(f"{QUEUE}.audit", EXCHANGE, routing_key=QUEUE),
    ],
    task_default_queue=QUEUE,
    # Name the exchange explicitly: Celery publishes to the anonymous
    # exchange otherwise, which reaches one queue only.
    task_routes={"faults.*": {"exchange": QUEUE, "routing_key": QUEUE}},
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    beat_max_loop_interval=1,
    timezone="UTC",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    beat_schedule={
        name: {"task": "faults.run", "schedule": schedule} for name, schedule in SCHEDULES.items()
    },
)
_conf = json.loads(os.environ.get("ITEST_CONF", "{}"))
install_send_delay(float(_conf.pop(SEND_DELAY, 0)))  # fault injection, see tests.beat.support
give_unserializable_args(_conf)  # bad input, see tests.beat.support
app.conf.update(_conf)
celery_anarchon.worker.install(app)


@app.task(bind=True, name="faults.run")
def run(self: Any) -> None:
    """Append one line per execution to ``ITEST_EXEC_LOG`` (one ``write`` on
    an ``O_APPEND`` file: lines of concurrent processes never interleave)."""
    path = os.environ.get("ITEST_EXEC_LOG")
    if not path:
        return
    job = self.request.get("anarchon_job")
    slot = self.request.get("anarchon_slot")
    line = (json.dumps([job, slot, os.getpid(), round(time.time(), 3)]) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
