"""The Celery app of the transparent parking tests: every task is a
``ParkingTask`` (``task_cls`` in its string form), with a Redis result
backend so results can be read back.

Real ``celery beat`` and ``celery worker`` processes run it through
:class:`tests.beats.BeatCluster` (``app="tests.parking_app"``), configured by
the same environment variables as ``tests.beat_app``: ``ITEST_BROKER``,
``ITEST_BACKEND``, ``ITEST_QUEUE`` and ``ITEST_CONF``; a test makes its own
app in-process with :func:`make_app`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

from celery_anarchon.worker import install

#: Where results go (a Redis database of their own).
RESULT_BACKEND = "redis://127.0.0.1:6379/2"


def make_app(broker: str, backend: str | None, queue: str, **conf: Any) -> Celery:
    """An app whose tasks are all ``ParkingTask``, with the worker
    integration installed and the ``ptest.*`` tasks registered."""
    app = Celery("ptest", task_cls="celery_anarchon.delayed.parking:ParkingTask")
    app.conf.update(
        broker_url=broker,
        result_backend=RESULT_BACKEND,
        anarchon_backend=backend,
        task_default_queue=queue,
        beat_max_loop_interval=1,
        beat_schedule={},
        timezone="UTC",
        broker_connection_retry_on_startup=True,
        **conf,
    )
    _register(app)
    install(app)
    return app


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def _stamp(task: Any, path: str, tag: str) -> None:
    """``tag <task id> <retries> <released|sent> <epoch ms> <parking id|->``
    in ``path``: ``released`` when the message carries the releaser's
    header, the parking id its ``anarchon_parking`` header."""
    request = task.request
    released = "released" if request.get("anarchon_delayed") else "sent"
    parking = request.get("anarchon_parking") or "-"
    _append(
        path,
        f"{tag} {request.id} {request.retries} {released} {int(time.time() * 1000)} {parking}",
    )


def _register(app: Celery) -> None:
    @app.task(name="ptest.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="ptest.stamp", bind=True, shared=False)
    def stamp(self: Any, path: str, tag: str) -> str:
        _stamp(self, path, tag)
        return tag

    @app.task(name="ptest.retry_later", bind=True, shared=False, max_retries=3)
    def retry_later(self: Any, path: str, countdown: float) -> str:
        """Stamp each attempt; the first retries after ``countdown`` s."""
        _stamp(self, path, f"attempt-{self.request.retries}")
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        return f"done after {self.request.retries} retry"

    @app.task(name="ptest.record_result", shared=False)
    def record_result(result: Any, path: str) -> None:
        """A ``link`` callback: write the parent's result to ``path``."""
        _append(path, f"linked {result}")


app = make_app(
    os.environ.get("ITEST_BROKER", "redis://127.0.0.1:6379/1"),
    os.environ.get("ITEST_BACKEND") or None,
    os.environ.get("ITEST_QUEUE", "ptest"),
    **json.loads(os.environ.get("ITEST_CONF", "{}")),
)
