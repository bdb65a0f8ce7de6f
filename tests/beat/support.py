"""What the beat-side tests share: a clock moved by hand, an app builder,
and the seam that slows sends down (fault injection)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery

from celery_anarchon.beat.agenda import Slot
from celery_anarchon.beat.publisher import Publisher

#: The ``ITEST_CONF`` key the test apps (tests.beat_app, tests.faults.app)
#: read for :func:`delay_sends`: seconds slept before each send.
SEND_DELAY = "itest_send_delay"


class Clock:
    """A clock the test moves by hand (seconds since the epoch)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_app(url: str, schedule: dict[str, Any], **conf: Any) -> Celery:
    """An app of its own (unique name and queue, in-memory broker) whose
    claims go to ``url``, running ``schedule``, with no jitter; ``conf`` on
    top."""
    app = Celery(f"beat-{uuid.uuid4().hex[:6]}", set_as_current=False)
    settings: dict[str, Any] = {
        "broker_url": "memory://",
        "task_default_queue": f"q-{uuid.uuid4().hex[:8]}",
        "anarchon_backend": url,
        "anarchon_jitter": 0,
        "beat_schedule": schedule,
        "timezone": "UTC",
    }
    app.conf.update({**settings, **conf})
    return app


def install_send_delay(seconds: float) -> None:
    """Sleep ``seconds`` between winning each claim and sending it, in this
    process, from now on (0: no delay): widens the window in which a test
    kills, stops or shuts down the owner."""

    def sleep(slot: Slot) -> None:
        time.sleep(seconds)

    Publisher.before_send = sleep if seconds else None


@contextmanager
def delay_sends(seconds: float) -> Iterator[None]:
    """:func:`install_send_delay` for the ``with`` block only."""
    install_send_delay(seconds)
    try:
        yield
    finally:
        install_send_delay(0)
