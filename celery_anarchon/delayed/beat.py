"""Starting a beat instance's releaser (docs/delayed-tasks.md)."""

from __future__ import annotations

import logging
from typing import Any

from ..exceptions import ConfigurationError
from ..metrics import Metrics
from ..settings import Settings

__all__ = ["start_releaser"]

logger = logging.getLogger(__name__)


def start_releaser(app: Any, settings: Settings, instance: str, metrics: Metrics) -> Any:
    """Start the releaser thread of the beat instance ``instance``, on a
    client of its own of the backend that keeps parked tasks
    (``anarchon_delayed_backend``, else the claim backend); None where that
    backend keeps no delayed tasks or ``anarchon_delayed_release`` is off.

    Claims on RabbitMQ without ``anarchon_delayed_backend`` start no
    releaser: beat runs on, and logs once at INFO that delayed tasks are off,
    why, and what to set.

    Raises:
        ConfigurationError: a bad ``anarchon_delayed_*`` setting; an
            ``anarchon_delayed_backend`` that is not a URL a backend serves,
            or names a backend that keeps no delayed tasks (both named).
    """
    from . import delayed_backend, delayed_off, store_in
    from .releaser import Releaser
    from .settings import DelayedSettings

    delayed = DelayedSettings.from_app(app)
    off = delayed_off(settings, delayed)
    if off is not None:
        logger.info("anarchon: %s", off)
        return None
    backend = delayed_backend(settings, delayed, instance=instance)  # a bad URL stops beat
    if not delayed.release:
        logger.info("anarchon: not releasing parked tasks (anarchon_delayed_release is off)")
        return None
    try:
        store = store_in(backend, delayed)
    except ConfigurationError:
        if delayed.backend is not None:
            raise  # chosen by the setting: a mistake to report, not a choice
        logger.info(
            "anarchon: delayed tasks are off: %s keeps no delayed tasks; no releaser",
            backend.describe(),
        )
        return None
    releaser = Releaser(app, store, delayed, instance, metrics, namespace=backend.namespace)
    releaser.start()
    return releaser
