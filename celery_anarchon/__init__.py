"""celery-anarchon: Celery beat on every host, each periodic run sent once.

Start ``celery -A proj beat -S celery_anarchon.Scheduler`` on every host. Each
due run (a *slot*: one job at one scheduled time) is claimed by exactly one
instance in a shared backend before the task goes to the workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

__all__ = ["Scheduler", "Schedules", "cron", "__version__"]

if TYPE_CHECKING:
    from .beat.scheduler import Scheduler
    from .schedules import Schedules
    from .slots import cron


def __getattr__(name: str) -> Any:
    # Lazy, so ``import celery_anarchon`` stays cheap and Celery can load the
    # scheduler class by name without importing every backend.
    if name == "Scheduler":
        from .beat.scheduler import Scheduler

        return Scheduler
    if name == "Schedules":
        from .schedules import Schedules

        return Schedules
    if name == "cron":
        from .slots import cron

        return cron
    raise AttributeError(name)
