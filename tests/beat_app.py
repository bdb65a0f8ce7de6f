"""The Celery app that integration tests run real ``celery beat`` processes on.

Configured through environment variables so each test picks its backend,
broker and queue:

* ``ITEST_BROKER``: Celery broker URL (default Redis db 1);
* ``ITEST_BACKEND``: ``anarchon_backend`` URL;
* ``ITEST_QUEUE``: the queue every task is sent to (read back by the test);
* ``ITEST_CONF``: JSON merged into ``app.conf`` (``beat_schedule`` included).

The worker integration is installed (the one documented line), so workers
started on this app gate, record and heartbeat every run a beat sent; the
tasks below ``itest.noop`` are for those worker tests.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

from celery_anarchon.worker import install, integration_of
from tests.beat.support import SEND_DELAY, give_unserializable_args, install_send_delay

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
_conf = json.loads(os.environ.get("ITEST_CONF", "{}"))
install_send_delay(float(_conf.pop(SEND_DELAY, 0)))  # fault injection, see tests.beat.support
give_unserializable_args(_conf)  # bad input, see tests.beat.support
app.conf.update(_conf)
install(app)


@app.task(name="itest.noop")
def noop() -> None:
    """Does nothing; tests read the messages, not the results."""


def _append(path: str, tag: str) -> int:
    """Append ``tag pid backend_pid`` to ``path``; the number of lines before.

    ``backend_pid`` is the process that built this process's claim-backend
    client (the worker integration's), so a test sees whether pool processes
    use a client of their own."""
    integration = integration_of(app)
    backend_pid = integration.backend_pid if integration is not None else None
    with open(path, "a+") as f:
        f.seek(0)
        before = len(f.readlines())
        f.write(f"{tag} {os.getpid()} {backend_pid}\n")
    return before


@app.task(name="itest.record")
def record(path: str, tag: str = "run") -> None:
    """One line per execution in ``path`` (see :func:`_append`)."""
    _append(path, tag)


@app.task(name="itest.sleep")
def sleep(seconds: float, path: str | None = None) -> None:
    """Record the execution when ``path`` is given, then sleep ``seconds``."""
    if path:
        _append(path, "sleep")
    time.sleep(seconds)


@app.task(name="itest.sleep_once", acks_late=True)
def sleep_once(seconds: float, path: str) -> None:
    """``acks_late``: record the execution; the first one sleeps ``seconds``
    (a test kills the worker meanwhile), later ones return at once."""
    if _append(path, "sleep_once") == 0:
        time.sleep(seconds)


@app.task(name="itest.fail")
def fail(message: str) -> None:
    """Raise ``ValueError(message)``."""
    raise ValueError(message)


@app.task(name="itest.retry_once", bind=True)
def retry_once(self: Any, path: str) -> None:
    """Record the execution; the first attempt retries after 0.2 s."""
    _append(path, f"attempt-{self.request.retries}")
    if self.request.retries == 0:
        raise self.retry(countdown=0.2)


@app.task(name="itest.stamp")
def stamp(path: str, tag: str) -> None:
    """Append ``tag <task id> <epoch ms now>`` to ``path``: when a released
    parked task ran, for the delayed-task tests."""
    with open(path, "a") as f:
        f.write(f"{tag} {stamp.request.id} {int(time.time() * 1000)}\n")


#: The ``ITEST_CONF`` key for :func:`install_finish_delay`: seconds each
#: releaser of this process waits between publishing a batch of parked
#: tasks and deleting it from the store (fault injection, tests/faults).
FINISH_DELAY = "itest_delayed_finish_delay"


def install_finish_delay(seconds: float) -> None:
    """Make every releaser started in this process from now on sleep
    ``seconds`` between publishing a batch and deleting it (0: no delay),
    except a batch with a take-over in it (so a take-over finishes inside
    its lease and the test's fault stays the only one). Logs ``itest:
    published N parked task(s)`` before the sleep and ``itest: deleted K of
    N`` after the (fenced) delete: widens the window in which a test kills
    or freezes a releaser between publish and delete, and shows what its
    delete did after a take-over."""
    import logging

    from celery_anarchon.delayed.releaser import Releaser

    if not seconds:
        return
    logger = logging.getLogger(__name__)
    start = Releaser.start

    def start_slowly(self: Releaser) -> None:
        finish = self.store.finish

        def slow_finish(taken: Any) -> list[bool]:
            if not taken:
                return finish(taken)
            logger.warning("itest: published %d parked task(s)", len(taken))
            if not any(t.taken_over for t in taken):
                time.sleep(seconds)
            kept = finish(taken)
            logger.warning("itest: deleted %d of %d", sum(kept), len(taken))
            return kept

        self.store.finish = slow_finish  # type: ignore[method-assign]
        start(self)

    Releaser.start = start_slowly  # type: ignore[method-assign]


install_finish_delay(float(app.conf.get(FINISH_DELAY) or 0))


def _dump_stacks_on_sigusr2() -> None:
    """``kill -USR2 <pid>`` prints every thread's stack to the process's log
    (as tests.faults.app does): how a test shows where a releaser hangs."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)


_dump_stacks_on_sigusr2()
