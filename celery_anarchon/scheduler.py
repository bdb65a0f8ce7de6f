"""Where ``celery_anarchon.scheduler.Scheduler`` is still found: the beat
scheduler lives in :mod:`celery_anarchon.beat.scheduler` (see
docs/architecture.md). ``celery beat -S celery_anarchon.scheduler.Scheduler``
and the imports of released versions keep working through this module."""

from .beat.scheduler import Scheduler
from .message import send_slot, task_id_for
from .model import Entry, Job, build_jobs

__all__ = ["Entry", "Job", "Scheduler", "build_jobs", "send_slot", "task_id_for"]
