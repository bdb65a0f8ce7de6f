"""The worker integration (``celery_anarchon/worker.py``) with real ``celery
worker`` processes (prefork pool) on a Redis broker, against Redis, SQLite
and PostgreSQL claim backends.

The test process plays the scheduler: it claims a slot, marks it sent and
publishes it with :func:`~celery_anarchon.message.send_slot` (twice, for
a duplicate), then reads the backend's history and what the tasks wrote.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import Ignore
from kombu import Connection

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend, Claim, ClaimRequest, RunRecord, State
from celery_anarchon.exceptions import ConfigurationError
from celery_anarchon.message import send_slot, task_id_for
from celery_anarchon.model import Entry
from celery_anarchon.settings import Settings
from celery_anarchon.worker import (
    ERROR_MAX_CHARS,
    claim_of,
    error_text,
    expires_for,
    install,
    integration_of,
    message_expiry_ms,
)

from .beats import BeatCluster
from .conftest import POSTGRES_URL, REDIS_URL, RUN_ID, require_service

REPO = Path(__file__).resolve().parents[1]
BROKER = "redis://127.0.0.1:6379/1"
LEASE_TTL = 2.0  # seconds; heartbeats every 2/3 s
FINISHED = {State.SUCCEEDED, State.FAILED, State.LOST}


# -- a real worker -------------------------------------------------------------


@dataclass
class Worker:
    """A ``celery worker`` process on ``tests.beat_app`` (``pool``, default
    prefork, with ``concurrency`` processes or threads)."""

    backend_url: str
    folder: Path
    pool: str = "prefork"
    concurrency: int = 2
    queue: str = field(default_factory=lambda: f"wtest-{uuid.uuid4().hex[:8]}")
    prefix: dict[str, Any] = field(default_factory=dict)
    visibility_timeout: float = 3600
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def log(self) -> Path:
        return self.folder / f"worker-{self.queue}.log"

    @property
    def unacked_key(self) -> str:
        """The broker's hash of unacked messages: one per test worker, so a
        short ``visibility_timeout`` here never redelivers anyone else's."""
        return f"unacked-{self.queue}"

    def conf(self) -> dict[str, Any]:
        return {
            "anarchon_backend_options": self.prefix,
            "anarchon_lease_ttl": LEASE_TTL,
            "worker_prefetch_multiplier": 1,
            "broker_transport_options": {
                "visibility_timeout": self.visibility_timeout,
                "unacked_restore_interval": 1,
                "unacked_restore_throttle": 1,
                "unacked_key": self.unacked_key,
                "unacked_index_key": f"{self.unacked_key}-index",
                "unacked_mutex_key": f"{self.unacked_key}-mutex",
            },
        }

    def start(self) -> None:
        self.starts += 1
        env = {
            **os.environ,
            "ITEST_BROKER": BROKER,
            "ITEST_BACKEND": self.backend_url,
            "ITEST_QUEUE": self.queue,
            "ITEST_CONF": json.dumps(self.conf()),
            "PYTHONPATH": str(REPO),
        }
        log = open(self.log, "ab")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "celery", "-A", "tests.beat_app", "worker"),
                *("-P", self.pool, "-c", str(self.concurrency), "-l", "INFO", "-Q", self.queue),
                *("-n", f"{self.queue}-{self.starts}@%h"),
                *("--without-heartbeat", "--without-gossip", "--without-mingle"),
            ],
            cwd=self.folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # A loaded machine starts a worker slowly (imports, pool forks).
        self.wait_for_log("ready.", count=self.starts, timeout=60)

    def wait_for_log(self, text: str, count: int = 1, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            content = self.log.read_text(errors="replace") if self.log.exists() else ""
            if content.count(text) >= count:
                return content
            assert self.proc is not None and self.proc.poll() is None, content[-3000:]
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in the worker log:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """kill -9 the worker and its pool processes."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def backend_for_test(name: str, tmp: Path) -> tuple[str, dict[str, Any]]:
    if name == "redis":
        return REDIS_URL, {"prefix": f"anarchon-test:{RUN_ID}:w:"}
    if name == "postgresql":
        return POSTGRES_URL, {"prefix": f"t{RUN_ID}_w_"}
    return f"sqlite:///{tmp / 'claims.db'}", {}


@dataclass
class Harness:
    """A worker, the backend it uses, and a way to publish slots to it."""

    worker: Worker
    backend: Backend
    app: Celery
    folder: Path

    def claim(
        self, job: str, *, lease_ms: int = 30_000, sent: bool = True
    ) -> tuple[ClaimRequest, Claim]:
        """Claim a slot of ``job`` at the backend's now and mark it sent
        (unless ``sent`` is False: an owner that froze before recording it)."""
        slot = self.backend.now_ms()
        request = ClaimRequest(job, slot, 60_000, 10_000, slot + 120_000, lease_ms=lease_ms)
        claim = self.backend.claim([request])[0]
        assert claim.won
        if sent:
            assert self.backend.mark(claim, State.SENT, task_id=self.task_id(job, slot))
        return request, claim

    def send(self, claim: Claim, task: str, *args: Any, **options: Any) -> None:
        """Publish ``claim``'s slot as the scheduler does."""
        entry = Entry(
            name=claim.job, task=task, args=args, options=options, app=self.app, schedule=60.0
        )
        send_slot(
            self.app,
            entry,
            job=claim.job,
            slot_ms=claim.slot_ms,
            token=claim.token,
            task_id=self.task_id(claim.job, claim.slot_ms),
        )

    def task_id(self, job: str, slot_ms: int) -> str:
        """The task id beat derives for the slot on this backend."""
        return task_id_for(job, slot_ms, namespace=self.backend.namespace)

    def record(self, job: str, slot_ms: int) -> RunRecord:
        return next(r for r in self.backend.history(job) if r.slot_ms == slot_ms)

    def wait_state(self, claim: Claim, states: set[State], timeout: float = 15) -> RunRecord:
        deadline = time.monotonic() + timeout
        while True:
            record = self.record(claim.job, claim.slot_ms)
            if record.state in states:
                return record
            if time.monotonic() > deadline:
                raise AssertionError(f"{record} never reached {states}")
            time.sleep(0.05)

    def path(self) -> str:
        return str(self.folder / f"runs-{uuid.uuid4().hex[:8]}.txt")


def lines(path: str) -> list[list[str]]:
    return (
        [line.split() for line in Path(path).read_text().splitlines()]
        if Path(path).exists()
        else []
    )


@pytest.fixture(scope="module", params=["redis", "sqlite", "postgresql"])
def harness(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Harness]:
    require_service("redis")
    require_service(request.param)
    request.getfixturevalue("_redis_cleanup")
    if request.param == "postgresql":
        request.getfixturevalue("_sql_cleanup")
    folder = tmp_path_factory.mktemp(f"worker-{request.param}")
    url, options = backend_for_test(request.param, folder)
    worker = Worker(url, folder, prefix=options)
    backend = backend_from_url(url, instance="test-scheduler", options=options)
    backend.open()
    app = Celery("wtest-publisher", broker=BROKER)
    app.conf.task_default_queue = worker.queue
    worker.start()
    try:
        yield Harness(worker, backend, app, folder)
    finally:
        worker.stop()
        backend.close()
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(worker.queue)


def new_job() -> str:
    return f"wjob-{uuid.uuid4().hex[:8]}"


# -- with a real worker --------------------------------------------------------


def test_a_run_is_recorded_running_then_succeeded(harness: Harness) -> None:
    _, claim = harness.claim(job := new_job())
    path = harness.path()
    # Runs for several heartbeat periods (lease_ttl / 3 = 0.67 s): with a
    # 1 s body, a test reading the lease after the second heartbeat (0.67 s
    # in: slow on a loaded machine) waited for a third that never came.
    harness.send(claim, "itest.sleep", 3.0, path)
    running = harness.wait_state(claim, {State.RUNNING})
    assert running.started_at_ms is not None
    # The gate's first heartbeat replaces the claim's lease (30 s) with one
    # of lease_ttl (2 s); read the lease after that one.
    deadline = time.monotonic() + 5
    while (lease_then := harness.record(job, claim.slot_ms).lease_until_ms or 0) > (
        running.started_at_ms + 10_000
    ):
        assert time.monotonic() < deadline, harness.record(job, claim.slot_ms)
        time.sleep(0.02)
    time.sleep(LEASE_TTL * 0.4)
    # A heartbeat moved the lease on while the task ran (lease_ttl / 3).
    assert harness.record(job, claim.slot_ms).lease_until_ms > (lease_then or 0)
    done = harness.wait_state(claim, FINISHED)
    assert done.state is State.SUCCEEDED
    assert done.finished_at_ms is not None and done.error is None
    assert len(lines(path)) == 1


def test_pool_processes_use_backend_clients_of_their_own(harness: Harness) -> None:
    """The worker's main process built its client at start-up (before the
    pool forked); each pool process runs on one it built itself."""
    harness.worker.wait_for_log("worker integration ready")
    main_pid = str(harness.worker.proc.pid if harness.worker.proc else "")
    path = harness.path()
    claims = [harness.claim(new_job())[1] for _ in range(4)]
    for claim in claims:
        harness.send(claim, "itest.record", path)
    for claim in claims:
        assert harness.wait_state(claim, FINISHED).state is State.SUCCEEDED
    runs = lines(path)
    assert len(runs) == 4
    for _, pid, backend_pid in runs:
        assert pid == backend_pid and pid != main_pid


def test_a_failing_task_is_recorded_failed_with_its_error(harness: Harness) -> None:
    _, claim = harness.claim(new_job())
    harness.send(claim, "itest.fail", "boom " * 500)
    done = harness.wait_state(claim, FINISHED)
    assert done.state is State.FAILED
    assert done.error is not None and done.error.startswith("ValueError: boom boom")
    assert len(done.error) == ERROR_MAX_CHARS


def test_a_slot_published_twice_runs_once(harness: Harness) -> None:
    _, claim = harness.claim(new_job())
    path = harness.path()
    harness.send(claim, "itest.record", path)
    harness.send(claim, "itest.record", path)
    harness.worker.wait_for_log(f"discarded a delivery of {claim.job}")
    assert harness.wait_state(claim, FINISHED).state is State.SUCCEEDED
    time.sleep(0.3)
    assert len(lines(path)) == 1
    [record] = [r for r in harness.backend.history(claim.job)]
    assert record.state is State.SUCCEEDED and record.token == claim.token
    # The discarded message was acked, not left for redelivery.
    assert not unacked(harness, claim)


def test_a_second_delivery_of_a_running_acks_late_task_is_discarded(harness: Harness) -> None:
    """acks_late: a redelivery restarts a run only when its lease expired;
    while the first worker heartbeats, a second delivery is a duplicate."""
    _, claim = harness.claim(new_job())
    path = harness.path()
    harness.send(claim, "itest.sleep_once", 1.5, path)
    harness.wait_state(claim, {State.RUNNING})
    harness.send(claim, "itest.sleep_once", 1.5, path)
    harness.worker.wait_for_log(f"discarded a delivery of {claim.job}")
    assert harness.wait_state(claim, FINISHED).state is State.SUCCEEDED
    assert len(lines(path)) == 1


def test_a_superseded_token_is_discarded(harness: Harness) -> None:
    """A backup runner took the slot over (token 2) after the first owner
    published it under token 1: token 1's delivery is discarded, token 2's
    runs, whichever comes first."""
    request, first = harness.claim(new_job(), lease_ms=1, sent=False)
    time.sleep(0.05)
    backup = harness.backend.take_over_many([request])[0]  # type: ignore[attr-defined]
    assert backup.won and backup.token == first.token + 1
    path = harness.path()
    harness.send(first, "itest.record", path, "first")
    harness.worker.wait_for_log(f"token superseded by {backup.token}")
    harness.send(backup, "itest.record", path, "backup")
    assert harness.wait_state(backup, FINISHED).state is State.SUCCEEDED
    assert [run[0] for run in lines(path)] == ["backup"]
    states = [(r.state, r.token) for r in harness.backend.history(first.job)]
    assert states == [(State.SUCCEEDED, backup.token), (State.SUPERSEDED, first.token)]


def test_a_retry_is_the_same_run_again(harness: Harness) -> None:
    _, claim = harness.claim(new_job())
    path = harness.path()
    harness.send(claim, "itest.retry_once", path)
    done = harness.wait_state(claim, FINISHED)
    assert done.state is State.SUCCEEDED
    assert [run[0] for run in lines(path)] == ["attempt-0", "attempt-1"]


def test_an_expired_message_is_not_run_and_is_recorded_lost(harness: Harness) -> None:
    """``anarchon_expires = 'next_slot'``: a run's message that reaches a
    worker after the job's next slot is revoked by Celery, never run, and
    recorded ``lost`` with the reason (``task_revoked``, in the worker's
    main process). A fresh one runs."""
    _, stale = harness.claim(new_job())
    _, fresh = harness.claim(new_job())
    path = harness.path()
    expired = expires_for("next_slot", stale.slot_ms - 60_000, stale.slot_ms - 1_000)
    harness.send(stale, "itest.record", path, "stale", expires=expired)
    later = expires_for("next_slot", fresh.slot_ms, fresh.slot_ms + 60_000)
    harness.send(fresh, "itest.record", path, "fresh", expires=later)
    assert harness.wait_state(fresh, FINISHED).state is State.SUCCEEDED
    harness.worker.wait_for_log(
        f"revoked task: itest.record[{harness.task_id(stale.job, stale.slot_ms)}]"
    )
    lost = harness.wait_state(stale, FINISHED)
    assert lost.state is State.LOST
    assert lost.error is not None
    assert lost.error.startswith("expired before a worker took it (expires ")
    assert lost.started_at_ms is None and lost.finished_at_ms is not None
    assert [run[0] for run in lines(path)] == ["fresh"]


def revoke(harness: Harness, task_id: str, **options: Any) -> None:
    """``app.control.revoke`` sent to the harness's worker only, waiting for
    its reply (so the worker knows the id before anything is published)."""
    name = f"{harness.worker.queue}-{harness.worker.starts}@{socket.gethostname()}"
    replies = harness.app.control.revoke(
        task_id, destination=[name], reply=True, timeout=10, **options
    )
    assert replies, f"no reply from {name} to the revoke"


def test_a_revoked_message_is_not_run_and_is_recorded_lost(harness: Harness) -> None:
    """A plain revoke (by task id) before the message arrives: Celery
    discards it on arrival; the run is recorded ``lost`` with the reason."""
    _, claim = harness.claim(new_job())
    path = harness.path()
    revoke(harness, harness.task_id(claim.job, claim.slot_ms))
    harness.send(claim, "itest.record", path)
    lost = harness.wait_state(claim, FINISHED)
    assert lost.state is State.LOST
    assert lost.error == "revoked before a worker ran it"
    assert lost.started_at_ms is None
    assert lines(path) == []


def test_a_revoked_duplicate_leaves_the_running_original_alone(harness: Harness) -> None:
    """The original runs; the slot's task id is revoked (no terminate: the
    original goes on) and a second publish of the slot arrives: it is
    discarded by Celery, and the record stays the original's."""
    _, claim = harness.claim(new_job())
    path = harness.path()
    # The original must outlast a revoke round trip (worker control via the
    # broker), a publish and its discard: under load these took up to 0.8 s
    # after RUNNING was seen, of the 2 s the original used to sleep.
    harness.send(claim, "itest.sleep", 5.0, path)
    harness.wait_state(claim, {State.RUNNING})
    revoke(harness, harness.task_id(claim.job, claim.slot_ms))
    harness.send(claim, "itest.sleep", 5.0, path)
    harness.worker.wait_for_log(f"a delivery of {claim.job} @ ")
    assert harness.record(claim.job, claim.slot_ms).state is State.RUNNING
    done = harness.wait_state(claim, FINISHED)
    assert done.state is State.SUCCEEDED
    assert len(lines(path)) == 1


def test_a_run_terminated_by_revoke_is_recorded_failed(harness: Harness) -> None:
    """``revoke(terminate=True)`` kills the running body (prefork): the run
    is recorded ``failed`` with the reason, not left ``running``."""
    _, claim = harness.claim(new_job())
    path = harness.path()
    harness.send(claim, "itest.sleep", 30.0, path)
    harness.wait_state(claim, {State.RUNNING})
    revoke(harness, harness.task_id(claim.job, claim.slot_ms), terminate=True)
    done = harness.wait_state(claim, FINISHED)
    assert done.state is State.FAILED
    assert done.error is not None
    assert done.error.startswith("Terminated: revoked with terminate=True")


def test_tasks_without_anarchon_headers_are_untouched(harness: Harness) -> None:
    path = harness.path()
    harness.app.send_task("itest.record", (path, "plain"))
    harness.app.send_task("itest.record", (path, "plain"))
    deadline = time.monotonic() + 10
    while len(lines(path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [run[0] for run in lines(path)] == ["plain", "plain"]


def unacked(harness: Harness, claim: Claim) -> list[str]:
    """Messages of ``claim``'s task id the Redis broker holds unacked."""
    client = redis.Redis.from_url(BROKER)
    task_id = harness.task_id(claim.job, claim.slot_ms)
    try:
        held = client.hvals(harness.worker.unacked_key)
        return [raw.decode() for raw in held if task_id.encode() in raw]
    finally:
        client.close()


@pytest.fixture
def lone_worker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """A Redis-backed worker of the test's own (it gets killed), whose
    broker redelivers unacked messages after 3 s."""
    yield from _lone_worker(request, tmp_path, "redis")


@pytest.fixture
def lone_sqlite_worker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """As :func:`lone_worker`, on a SQLite claim backend."""
    yield from _lone_worker(request, tmp_path, "sqlite")


def _lone_worker(
    request: pytest.FixtureRequest, tmp_path: Path, backend_name: str
) -> Iterator[Harness]:
    require_service("redis")
    request.getfixturevalue("_redis_cleanup")
    url, options = backend_for_test(backend_name, tmp_path)
    worker = Worker(url, tmp_path, prefix=options, visibility_timeout=3)
    backend = backend_from_url(url, instance="test-scheduler", options=options)
    backend.open()
    app = Celery("wtest-publisher", broker=BROKER)
    app.conf.task_default_queue = worker.queue
    try:
        worker.start()
        yield Harness(worker, backend, app, tmp_path)
    finally:
        worker.stop()
        backend.close()
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(worker.queue)
            conn.default_channel.client.delete(worker.unacked_key, f"{worker.unacked_key}-index")


def wait_for_lines(path: str, count: int, timeout: float = 15) -> list[list[str]]:
    deadline = time.monotonic() + timeout
    while len(lines(path)) < count:
        assert time.monotonic() < deadline, f"{path} has {lines(path)}"
        time.sleep(0.05)
    return lines(path)


def test_an_acks_late_run_whose_worker_was_killed_is_restarted(lone_worker: Harness) -> None:
    """kill -9 of the worker mid-task: the broker redelivers the message
    (Redis: after ``visibility_timeout``, 3 s here), the lease (2 s) has
    expired meanwhile, so the new worker restarts the run: the same slot."""
    harness, worker = lone_worker, lone_worker.worker
    _, claim = harness.claim(new_job())
    path = harness.path()
    harness.send(claim, "itest.sleep_once", 60, path)
    wait_for_lines(path, 1)
    first = harness.record(claim.job, claim.slot_ms)
    assert first.state is State.RUNNING
    worker.kill()
    worker.start()
    worker.wait_for_log(f"restarted {claim.job}", timeout=30)
    done = harness.wait_state(claim, FINISHED, timeout=20)
    assert done.state is State.SUCCEEDED
    assert (done.started_at_ms or 0) > (first.started_at_ms or 0)
    assert len(lines(path)) == 2


def test_a_pool_process_killed_mid_task_is_recorded_failed(lone_worker: Harness) -> None:
    """The worker's main process sees its pool process die (kill -9) and
    records the run failed with WorkerLostError (no acks_late: the message
    was acked before it ran, so Celery does not run it again)."""
    harness = lone_worker
    _, claim = harness.claim(new_job())
    path = harness.path()
    harness.send(claim, "itest.sleep", 30, path)
    [[_, pid, _]] = wait_for_lines(path, 1)
    os.kill(int(pid), signal.SIGKILL)
    done = harness.wait_state(claim, FINISHED)
    assert done.state is State.FAILED
    assert done.error is not None and done.error.startswith("WorkerLostError")


def test_overlap_skip_is_not_blocked_by_a_run_whose_message_expired(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A real beat with ``overlap='skip'`` and ``expires`` 1 s, and no
    worker: each run stays ``sent`` in the broker, but once its message
    expired (plus ``max_skew``, 1 s here) it no longer blocks the next slot
    (every 3 s), so no slot is skipped. A worker started afterwards revokes
    every message (expired) and each run is recorded ``lost``; none runs."""
    require_service("redis")
    request.getfixturevalue("_redis_cleanup")
    url, options = backend_for_test("redis", tmp_path)
    path = str(tmp_path / "runs.txt")
    job = new_job()
    cluster = BeatCluster(
        url,
        tmp_path,
        conf={
            "anarchon_backend_options": options,
            "anarchon_jitter": 0.2,
            "anarchon_max_late": 1.5,
            "anarchon_max_skew": 1,
            "beat_schedule": {
                job: {
                    "task": "itest.record",
                    "schedule": 3.0,
                    "args": [path, "run"],
                    "anarchon": {"overlap": "skip", "expires": 1},
                }
            },
        },
    )
    reader = backend_from_url(url, instance="test-reader", options=options)
    reader.open()
    try:
        cluster.start(1)
        assert cluster.wait_ticking(), cluster.logs()
        deadline = time.monotonic() + 30
        while len([r for r in reader.history(job) if r.state is State.SENT]) < 3:
            assert time.monotonic() < deadline, (reader.history(job), cluster.logs())
            time.sleep(0.2)
        cluster.stop()
        history = reader.history(job)
        assert [r for r in history if r.state is State.SKIPPED] == [], history
        sent = [r.slot_ms for r in history if r.state is State.SENT]
        assert len(sent) >= 3 and len(sent) == len(history), history
        # The newest message expires 1 s after its slot: start the worker only
        # once it has (CI once saw the worker take the last message in time).
        time.sleep(max(0.0, max(sent) / 1000 + 2.0 - time.time()))
        cluster.start_worker()
        deadline = time.monotonic() + 30
        while any(r.state is not State.LOST for r in reader.history(job)):
            assert time.monotonic() < deadline, (reader.history(job), cluster.logs())
            time.sleep(0.2)
        for record in reader.history(job):
            assert record.error is not None, record
            assert record.error.startswith("expired before a worker took it"), record
        assert sorted(r.slot_ms for r in reader.history(job)) == sorted(sent)
        assert lines(path) == []
    finally:
        cluster.stop()
        cluster.stop_workers()
        reader.close()
        with Connection(BROKER) as conn:
            conn.default_channel.queue_delete(cluster.queue)


def test_a_pool_process_forked_after_the_main_process_recorded_a_death_works(
    lone_sqlite_worker: Harness,
) -> None:
    """SQLite: the worker's main process records a pool process's death
    (kill -9) on the shared file, then forks a replacement; runs on the
    replacement are gated and recorded as usual (the main process closes
    its client after use, so nothing open is inherited; this passed here
    without that close too: it guards the fork path, not the close)."""
    harness = lone_sqlite_worker
    _, claim = harness.claim(new_job())
    path = harness.path()
    harness.send(claim, "itest.sleep", 30, path)
    [[_, killed, _]] = wait_for_lines(path, 1)
    os.kill(int(killed), signal.SIGKILL)
    assert harness.wait_state(claim, FINISHED).state is State.FAILED
    after = harness.path()
    claims = [harness.claim(new_job())[1] for _ in range(4)]
    for each in claims:
        harness.send(each, "itest.sleep", 0.5, after)
    for each in claims:
        assert harness.wait_state(each, FINISHED).state is State.SUCCEEDED
    pids = {pid for _, pid, _ in lines(after)}
    assert len(pids) == 2 and killed not in pids, pids  # the survivor and the replacement
    log = harness.worker.log.read_text(errors="replace")
    assert "unchecked" not in log and "could not record" not in log


# -- without a worker ----------------------------------------------------------


def test_expires_for() -> None:
    slot = 1_700_000_000_000
    at = datetime.fromtimestamp(slot / 1000, tz=timezone.utc)
    assert expires_for(None, slot, slot + 60_000) is None
    assert expires_for(30, slot, slot + 60_000) == at + timedelta(seconds=30)
    assert expires_for(timedelta(minutes=1), slot, None) == at + timedelta(minutes=1)
    assert expires_for("next_slot", slot, slot + 60_000) == at + timedelta(minutes=1)
    assert expires_for("next_slot", slot, None) is None
    with pytest.raises(ConfigurationError, match="next_slot"):
        expires_for("tomorrow", slot, None)


def test_message_expiry_ms() -> None:
    """The entry's own ``expires`` wins (seconds from the send, or an aware
    datetime); else ``anarchon_expires``; unknowable values give None."""
    sent = 1_700_000_000_000
    at = datetime.fromtimestamp(sent / 1000 + 5, tz=timezone.utc)
    assert message_expiry_ms(None, None, sent) is None
    assert message_expiry_ms(None, at, sent) == sent + 5_000
    assert message_expiry_ms(30, at, sent) == sent + 30_000
    assert message_expiry_ms(1.5, None, sent) == sent + 1_500
    assert message_expiry_ms(1.5, None, None) is None
    assert message_expiry_ms(at + timedelta(seconds=1), None, sent) == sent + 6_000
    assert message_expiry_ms(datetime(2030, 1, 1), at, sent) is None  # naive: the worker's zone
    assert message_expiry_ms(True, at, sent) is None


def test_expires_setting_and_per_job_override() -> None:
    app = Celery("expires", set_as_current=False)
    app.conf.anarchon_expires = "next_slot"
    settings = Settings.from_app(app)
    assert settings.defaults.expires == "next_slot"
    assert settings.job_options("j", {"expires": 90}).expires == 90.0
    assert settings.job_options("j", {"expires": None}).expires is None
    slot = 1_700_000_000_000
    options = settings.job_options("j", {"expires": 90})
    assert expires_for(options, slot, None) == datetime.fromtimestamp(
        slot / 1000 + 90, tz=timezone.utc
    )
    for bad in ("soon", 0, True, [1]):
        with pytest.raises(
            ConfigurationError, match=r"beat_schedule\['j'\]\['anarchon'\]: expires"
        ):
            settings.job_options("j", {"expires": bad})
    app.conf.anarchon_expires = -5
    with pytest.raises(ConfigurationError, match="anarchon_expires"):
        Settings.from_app(app)


def test_claim_of_reads_headers_from_the_request() -> None:
    class Request:
        id = "t"
        headers = {"anarchon_job": "j", "anarchon_slot": "1000", "anarchon_token": 3}

    assert claim_of(Request()) == Claim("j", 1000, won=True, token=3)
    Request.headers = {"anarchon_job": "j"}
    assert claim_of(Request()) is None
    Request.headers = {"anarchon_job": "j", "anarchon_slot": "x", "anarchon_token": 1}
    assert claim_of(Request()) is None


def test_error_text_is_type_and_message_truncated() -> None:
    assert error_text(KeyError("k")) == "KeyError: 'k'"
    long = error_text(ValueError("x" * 5000))
    assert len(long) == ERROR_MAX_CHARS and long.endswith("\u2026")


@pytest.mark.parametrize("strict", [False, True])
def test_backend_unavailable_at_the_gate(strict: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Default: the task runs, unchecked, with a WARNING; strict: discarded."""
    app = Celery(f"down-{strict}", set_as_current=False)
    app.conf.anarchon_backend = "redis://127.0.0.1:1/0?socket_timeout=0.5"
    app.conf.anarchon_worker_strict = strict

    @app.task(name=f"down.task-{strict}")
    def task() -> None: ...

    install(app)
    app.finalize()
    gated = app.tasks[f"down.task-{strict}"]
    headers = {"anarchon_job": "j", "anarchon_slot": 1000, "anarchon_token": 1}
    gated.push_request(id="t", headers=headers, retries=0, is_eager=False)
    try:
        if strict:
            with pytest.raises(Ignore):
                gated.before_start("t", (), {})
            assert "anarchon_worker_strict is set" in caplog.text
        else:
            gated.before_start("t", (), {})
            assert "unchecked" in caplog.text
    finally:
        integration = integration_of(app)
        assert integration is not None
        integration._finish(gated.request)
        gated.pop_request()


def test_install_gates_every_task_class_once_and_wraps_its_own_before_start(
    tmp_path: Path,
) -> None:
    app = Celery("gate", set_as_current=False)
    app.conf.anarchon_backend = f"sqlite:///{tmp_path / 'claims.db'}"
    seen: list[str] = []

    class Base(app.Task):  # type: ignore[name-defined,misc]
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            seen.append(task_id)

    @app.task(name="gate.custom", base=Base)
    def custom() -> None: ...

    @app.task(name="gate.plain")
    def plain() -> None: ...

    assert install(app) is install(app) is integration_of(app)
    app.finalize()
    integration = integration_of(app)
    assert integration is not None
    claimer = integration.backend()
    slot = claimer.now_ms()
    claim = claimer.claim([ClaimRequest("j", slot, 60_000, 10_000, slot + 120_000)])[0]
    headers = {"anarchon_job": "j", "anarchon_slot": slot, "anarchon_token": claim.token}
    for task in (app.tasks["gate.custom"], app.tasks["gate.plain"]):
        assert type(task).__dict__["before_start"]._anarchon_gate
    task = app.tasks["gate.custom"]
    task.push_request(id="t1", headers=headers, retries=0, is_eager=False)
    original = task.request
    try:
        task.before_start("t1", (), {})
        assert seen == ["t1"]
        assert claimer.history("j")[0].state is State.RUNNING
    finally:
        task.pop_request()
    # A second delivery of the slot, with the same task id: discarded, and it
    # owns no run, so finishing it cannot finish the original.
    task.push_request(id="t1", headers=headers, retries=0, is_eager=False)
    try:
        with pytest.raises(Ignore):
            task.before_start("t1", (), {})
        assert seen == ["t1"]
        assert integration._finish(task.request) is None
    finally:
        task.pop_request()
    run = integration._finish(original)
    assert run is not None and run.claim == claim and run.task_id == "t1"
    assert integration._finish(original) is None  # finished once
    # A retry of the running run passes (running -> running, same token) ...
    task.push_request(id="t1", headers=headers, retries=1, is_eager=False)
    try:
        task.before_start("t1", (), {})
        assert seen == ["t1", "t1"]
        assert integration._finish(task.request) is not None
    finally:
        task.pop_request()
    # ... but not a redelivered retry while the run's lease is live.
    redelivered = {"redelivered": True}
    task.push_request(
        id="t1", headers=headers, retries=1, is_eager=False, delivery_info=redelivered
    )
    try:
        with pytest.raises(Ignore):
            task.before_start("t1", (), {})
        assert integration._finish(task.request) is None
    finally:
        task.pop_request()
    claimer.close()
