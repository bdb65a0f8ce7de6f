"""Queue names of the RabbitMQ backend: gate, manual and history queues,
within RabbitMQ's 255 bytes and the stream directory limit."""

from __future__ import annotations

import hashlib
import re

from ...exceptions import ConfigurationError
from ..base import Backend

#: Longest queue name RabbitMQ accepts, in UTF-8 bytes.
MAX_QUEUE_NAME_BYTES = 255


#: Longest suffix after the job part: ``.slot.`` plus a 20-digit slot.
_MAX_SUFFIX_BYTES = len(".slot.") + 20


#: A stream keeps its data in a directory named ``<vhost>_<queue>_<timestamp>``
#: (a 19-20 digit timestamp), and a file name has at most 255 bytes on Linux
#: file systems: a history stream named longer than that never confirms a
#: record (seen on RabbitMQ 3.10: ``failed to get tail of member``).
_STREAM_DIR_EXTRA_BYTES = 22


_HISTORY_SUFFIX = ".history"


#: Fewest bytes the prefix and vhost must leave for the job part.
_MIN_JOB_PART_BYTES = 32


#: Characters a job name may use as it is in a queue name.
_PLAIN_JOB = re.compile(r"[A-Za-z0-9_-]+")


_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9_-]+")


#: Hex digits of SHA-256 appended to a mapped job name (and of a manual key).
_JOB_HASH_HEX = 12


_KEY_HASH_HEX = 16


class RabbitMQNaming(Backend):
    """Queue names under ``self.prefix``."""

    #: prepended to every queue name
    prefix: str
    #: UTF-8 bytes left for the job part of a queue name
    _job_room: int

    @staticmethod
    def _check_names(prefix: str, vhost: str) -> int:
        """Bytes left for the job part of queue names under ``prefix`` in
        ``vhost``: every gate name within 255 bytes, every history stream's
        directory name (vhost, name, timestamp) too.

        Raises:
            ConfigurationError: a reserved prefix, or fewer than 32 bytes left.
        """
        if prefix.startswith("amq."):
            raise ConfigurationError(
                f"anarchon_backend_options: prefix {prefix!r} starts with 'amq.', which "
                "RabbitMQ reserves for its own queues; choose another prefix (default 'cron.')."
            )
        fixed = len(prefix.encode("utf-8"))
        stream_extra = len(vhost.encode("utf-8")) + _STREAM_DIR_EXTRA_BYTES + len(_HISTORY_SUFFIX)
        room = MAX_QUEUE_NAME_BYTES - fixed - max(_MAX_SUFFIX_BYTES, stream_extra)
        if room < _MIN_JOB_PART_BYTES:
            raise ConfigurationError(
                f"anarchon_backend_options: prefix {prefix!r} is too long for vhost "
                f"{vhost!r}: queue names (and a stream's directory name, which holds the "
                f"vhost too) are limited to {MAX_QUEUE_NAME_BYTES} bytes and must leave "
                f"{_MIN_JOB_PART_BYTES} bytes for the job; shorten the prefix."
            )
        return room

    def job_part(self, job: str) -> str:
        """The job's part of its queue names.

        ``job`` itself when it uses only letters, digits, ``_`` and ``-`` and
        fits; else its unsafe runs replaced by ``_``, cut to fit, plus ``~``
        and 12 hex digits of ``sha256(job)`` (e.g. ``proj.tasks.add(1, 2)``
        -> ``proj_tasks_add_1_2_~<hash>``).
        """
        room = self._job_room
        if _PLAIN_JOB.fullmatch(job) and len(job) <= room:
            return job
        digest = hashlib.sha256(job.encode("utf-8")).hexdigest()[:_JOB_HASH_HEX]
        safe = _UNSAFE_RUN.sub("_", job)
        return f"{safe[: room - _JOB_HASH_HEX - 1]}~{digest}"

    def gate_queue(self, job: str, slot_ms: int) -> str:
        """The gate queue of one slot: ``<prefix><job>.slot.<slot_ms>``."""
        return f"{self.prefix}{self.job_part(job)}.slot.{int(slot_ms)}"

    def manual_queue(self, job: str, key: str) -> str:
        """The gate queue of a manual run: ``<prefix><job>.manual.<hash>``."""
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:_KEY_HASH_HEX]
        return f"{self.prefix}{self.job_part(job)}.manual.{digest}"

    def history_queue(self, job: str) -> str:
        """The job's history stream: ``<prefix><job>.history``."""
        return f"{self.prefix}{self.job_part(job)}{_HISTORY_SUFFIX}"
