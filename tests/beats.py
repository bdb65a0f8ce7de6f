"""Run real ``celery beat`` processes and read back what they sent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from celery_anarchon.slots import slots_for
from kombu import Connection

REPO = Path(__file__).resolve().parents[1]
BROKER = "redis://127.0.0.1:6379/1"


@dataclass
class BeatCluster:
    """N real ``celery beat`` processes on ``tests.beat_app``.

    Attributes:
        backend: ``anarchon_backend`` URL (None: the default rules apply).
        folder: where each beat runs and logs.
        conf: extra ``app.conf`` settings (JSON-able).
        queue: the queue the tasks go to (unique per cluster).
    """

    backend: str | None
    folder: Path
    conf: dict[str, Any] = field(default_factory=dict)
    broker: str = BROKER
    queue: str = field(default_factory=lambda: f"itest-{uuid.uuid4().hex[:8]}")
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "ITEST_BROKER": self.broker,
            "ITEST_BACKEND": self.backend or "",
            "ITEST_QUEUE": self.queue,
            "ITEST_CONF": json.dumps(self.conf),
            "PYTHONPATH": str(REPO),
            **self.extra_env,
        }
        return env

    def start(self, count: int = 1, *args: str) -> list[subprocess.Popen[bytes]]:
        """Start ``count`` more beats; returns them."""
        started = []
        for _ in range(count):
            index = len(self.procs) + 1
            log = open(self.folder / f"beat-{index}.log", "wb")  # noqa: SIM115
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "tests.beat_app",
                    "beat",
                    "-S",
                    "celery_anarchon.Scheduler",
                    "-l",
                    "DEBUG",
                    "-s",
                    str(self.folder / "celerybeat-schedule"),
                    *args,
                ],
                cwd=self.folder,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            self.procs.append(proc)
            started.append(proc)
        return started

    def stop(
        self,
        procs: Iterable[subprocess.Popen[bytes]] | None = None,
        sig: int = signal.SIGTERM,
        timeout: float = 20.0,
    ) -> None:
        """Signal the beats (all by default) and wait for them to exit."""
        targets = list(self.procs if procs is None else procs)
        for proc in targets:
            if proc.poll() is None:
                proc.send_signal(sig)
        deadline = time.monotonic() + timeout
        for proc in targets:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-6000:]}"
            for p in sorted(self.folder.glob("beat-*.log"))
        )

    def read_sent(self, timeout: float = 3.0) -> list[dict[str, Any]]:
        """Drain the cluster's queue: the headers of every message sent."""
        return read_queue(self.broker, self.queue, timeout)


def read_queue(broker: str, queue: str, timeout: float = 3.0) -> list[dict[str, Any]]:
    """Take every message off ``queue``; returns their headers."""
    found: list[dict[str, Any]] = []
    with Connection(broker) as conn:
        simple = conn.SimpleQueue(queue)
        try:
            while True:
                try:
                    message = simple.get(timeout=timeout)
                except simple.Empty:
                    break
                found.append(dict(message.headers))
                message.ack()
        finally:
            simple.close()
    return found


def expected_slots(schedules: dict[str, Any], start_s: float, end_s: float) -> dict[str, list[int]]:
    """Every slot of ``schedules`` in ``[start_s, end_s]``, epoch ms."""
    expected: dict[str, list[int]] = {}
    for job, schedule in schedules.items():
        slots = slots_for(schedule, job=job, tz=ZoneInfo("UTC"))
        found = []
        slot = slots.next_after(int(start_s * 1000) - 1)
        while slot is not None and slot <= end_s * 1000:
            found.append(slot)
            slot = slots.next_after(slot)
        expected[job] = found
    return expected


def count_sent(headers: Sequence[dict[str, Any]]) -> Counter[tuple[str, int]]:
    """``(job, slot) -> how many messages`` from message headers."""
    return Counter((h["anarchon_job"], int(h["anarchon_slot"])) for h in headers)
