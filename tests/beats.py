"""Run real ``celery beat`` processes and read back what they sent."""

from __future__ import annotations

import json
import os
import signal
import socket
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

from kombu import Connection

from celery_anarchon.slots import slots_for

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
        extra_env: environment variables for every process.
        app: the ``-A`` module the processes run.
        specs: per-process ``(conf, env)`` overrides, by pid (see :meth:`start`).
    """

    backend: str | None
    folder: Path
    conf: dict[str, Any] = field(default_factory=dict)
    broker: str = BROKER
    queue: str = field(default_factory=lambda: f"itest-{uuid.uuid4().hex[:8]}")
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    app: str = "tests.beat_app"
    specs: dict[int, tuple[dict[str, Any], dict[str, str]]] = field(default_factory=dict)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(
        self, conf: dict[str, Any] | None = None, env: dict[str, str] | None = None
    ) -> dict[str, str]:
        """The environment of a process: the cluster's settings, with
        ``conf`` merged into ``ITEST_CONF`` and ``env`` over the rest."""
        merged = {
            **os.environ,
            "ITEST_BROKER": self.broker,
            "ITEST_BACKEND": self.backend or "",
            "ITEST_QUEUE": self.queue,
            "ITEST_CONF": json.dumps({**self.conf, **(conf or {})}),
            "PYTHONPATH": str(REPO),
            **self.extra_env,
            **(env or {}),
        }
        return merged

    def start(
        self,
        count: int = 1,
        *args: str,
        conf: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> list[subprocess.Popen[bytes]]:
        """Start ``count`` more beats; returns them.

        Args:
            count: how many.
            args: extra ``celery beat`` arguments.
            conf: ``app.conf`` settings for these beats only, over the
                cluster's ``conf`` (e.g. a fault-injection setting).
            env: environment variables for these beats only (e.g.
                libfaketime's ``LD_PRELOAD`` and ``FAKETIME``).
        """
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
                    self.app,
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
                env=self.env(conf, env),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()  # the child holds its own copy
            self.procs.append(proc)
            self.specs[proc.pid] = (dict(conf or {}), dict(env or {}))
            started.append(proc)
        return started

    def restart(self, proc: subprocess.Popen[bytes], *args: str) -> subprocess.Popen[bytes]:
        """Start a new beat with the same per-process overrides as ``proc``
        (which must have exited)."""
        conf, env = self.specs.get(proc.pid, ({}, {}))
        return self.start(1, *args, conf=conf, env=env)[0]

    def log_path(self, proc: subprocess.Popen[bytes]) -> Path:
        """The log file of beat ``proc``."""
        return self.folder / f"beat-{self.procs.index(proc) + 1}.log"

    def wait_ticking(
        self, procs: Iterable[subprocess.Popen[bytes]] | None = None, timeout: float = 30.0
    ) -> bool:
        """Wait until each beat (all by default) finished its first tick
        (its log says ``beat: Waking up``), or one exited, or ``timeout``
        seconds passed. Signals sent before that may hit a beat that has
        not installed its handlers yet. Returns True when all tick."""
        targets = list(self.procs if procs is None else procs)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in targets):
                return False
            if all(
                b"beat: Waking up" in self.log_path(p).read_bytes()
                for p in targets
                if self.log_path(p).exists()
            ) and all(self.log_path(p).exists() for p in targets):
                return True
            time.sleep(0.1)
        return False

    def running(self) -> list[subprocess.Popen[bytes]]:
        """The beats that have not exited."""
        return [p for p in self.procs if p.poll() is None]

    def start_worker(
        self,
        *args: str,
        concurrency: int = 2,
        conf: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a real ``celery worker`` (prefork) consuming the cluster's
        queue; stopped by :meth:`stop_workers`."""
        index = len(self.workers) + 1
        log = open(self.folder / f"worker-{index}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                self.app,
                "worker",
                "-Q",
                self.queue,
                "-c",
                str(concurrency),
                "-l",
                "INFO",
                "-n",
                f"w{index}-{self.queue}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                *args,
            ],
            cwd=self.folder,
            env=self.env(conf, env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.workers.append(proc)
        return proc

    def stop_workers(self, timeout: float = 20.0) -> None:
        """Stop every worker (warm shutdown, then kill after ``timeout``)."""
        self.stop(self.workers, timeout=timeout)

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

    def logs(self, tail: int = 6000) -> str:
        """The last ``tail`` characters of every beat's and worker's log."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
            for pattern in ("beat-*.log", "worker-*.log")
            for p in sorted(self.folder.glob(pattern))
        )

    def read_sent(self, timeout: float = 3.0) -> list[dict[str, Any]]:
        """Drain the cluster's queue: the headers of every message sent."""
        return read_queue(self.broker, self.queue, timeout)


def instance_prefix(proc: subprocess.Popen[bytes]) -> str:
    """The start of the instance id of the scheduler in beat process ``proc``
    (``host:pid:``; see :func:`celery_anarchon.beat.registry.new_instance_id`)."""
    return f"{socket.gethostname()}:{proc.pid}:"


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
