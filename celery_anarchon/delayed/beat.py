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
    backend client of its own; None where the backend keeps no delayed
    tasks (SQLite, MySQL, RabbitMQ) or ``anarchon_delayed_release`` is off.

    Raises:
        ConfigurationError: a bad ``anarchon_delayed_*`` setting.
    """
    from ..backends import backend_from_settings
    from . import store_from_backend
    from .releaser import Releaser
    from .settings import DelayedSettings

    delayed = DelayedSettings.from_app(app)
    if not delayed.release:
        logger.info("anarchon: not releasing parked tasks (anarchon_delayed_release is off)")
        return None
    backend = backend_from_settings(settings, instance=instance)
    try:
        store = store_from_backend(backend)
    except ConfigurationError:
        logger.debug("anarchon: %s keeps no delayed tasks; no releaser", backend.describe())
        return None
    releaser = Releaser(app, store, delayed, instance, metrics, namespace=backend.namespace)
    releaser.start()
    return releaser
