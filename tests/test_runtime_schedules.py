"""Stored jobs changed at runtime while three real ``celery beat`` processes
run, on every lease backend; each message is counted for its slot from the
broker and checked against the definitions that held (docs/runtime-schedules.md).

A definition holds from 1 s after its commit (``APPLY_DELAY_MS``); in that
second, a slot of the definition it replaces may be sent or not, never
twice. Everywhere else each slot of the definition in force is sent exactly
once and nothing else is sent.
"""

from __future__ import annotations

import re
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_anarchon.schedules import Schedules
from celery_anarchon.stored import APPLY_DELAY_MS

from .beats import BeatCluster, count_sent
from .conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, require_service

#: Only a long-period code job: no short job keeps beat awake, so the
#: stored jobs' own poll must.
LONG_ONLY = {"hourly": {"task": "itest.noop", "schedule": 3600.0}}
CONF = {"beat_schedule": LONG_ONLY, "beat_max_loop_interval": 300, "anarchon_max_late": 20}
#: Every lease backend.
LEASE_NAMES = ["sqlite", "postgresql", "mysql", "redis"]

#: The last slots before the beats stop are not judged (claim delay + send).
TAIL_MS = 3500


def backend_for(name: str, tmp_path: Path) -> str:
    run = uuid.uuid4().hex[:8]
    return {
        "sqlite": f"sqlite:///{tmp_path / 'claims.db'}",
        "postgresql": f"{POSTGRES_URL}?prefix=rt{run}_",
        "mysql": f"{MYSQL_URL}?prefix=rt{run}_",
        "redis": f"{REDIS_URL}?prefix=anarchon-rt:{run}:",
    }[name]


@dataclass
class Phase:
    """A definition of the job from its commit on: every ``period_ms``
    (None: not running, paused or removed)."""

    committed_ms: int
    period_ms: int | None

    @property
    def effective_ms(self) -> int:
        return self.committed_ms + APPLY_DELAY_MS


def judge(sent: Counter[tuple[str, int]], job: str, phases: list[Phase], end_ms: int) -> list[str]:
    """What went wrong with ``job``'s sends against ``phases`` (oldest
    first), judged up to ``end_ms``: empty when nothing did."""
    problems = [f"{job} @ {t} sent {n} times" for (j, t), n in sent.items() if j == job and n > 1]
    firm: set[int] = set()
    either: set[int] = set()
    for i, phase in enumerate(phases):
        if phase.period_ms is None:
            continue
        nxt = phases[i + 1].committed_ms if i + 1 < len(phases) else end_ms + 10**9
        until = phases[i + 1].effective_ms if i + 1 < len(phases) else nxt
        period = phase.period_ms
        t = -(-phase.effective_ms // period) * period
        while t < until and t <= end_ms:
            (firm if t < nxt and t <= end_ms - TAIL_MS else either).add(t)
            t += period
    got = {t for (j, t) in sent if j == job}
    problems += [f"{job} @ {t} missing" for t in sorted(firm - got)]
    problems += [f"{job} @ {t} sent but never due" for t in sorted(got - firm - either)]
    return problems


def start_cluster(url: str, tmp_path: Path, **conf: Any) -> BeatCluster:
    cluster = BeatCluster(url, tmp_path, conf={**CONF, **conf})
    cluster.start(3)
    assert cluster.wait_ticking(timeout=60), cluster.logs()
    return cluster


def client_app(url: str, queue: str) -> Celery:
    app = Celery("rt-client", set_as_current=False)
    app.conf.update(anarchon_backend=url, beat_schedule=LONG_ONLY, broker_url="memory://")
    app.conf.task_default_queue = queue
    return app


def applied_versions(cluster: BeatCluster) -> list[int]:
    """The newest stored-jobs version each running beat says it applied."""
    newest = []
    for proc in cluster.running():
        found = re.findall(
            rb"applied stored-jobs version (\d+)", cluster.log_path(proc).read_bytes()
        )
        newest.append(max((int(v) for v in found), default=0))
    return newest


@pytest.mark.parametrize("name", LEASE_NAMES)
def test_add_update_pause_resume_remove_while_three_beats_run(name: str, tmp_path: Path) -> None:
    require_service("redis")  # the Celery broker of these tests
    require_service(name)
    url = backend_for(name, tmp_path)
    cluster = start_cluster(url, tmp_path)
    phases: list[Phase] = []
    try:
        with Schedules(client_app(url, cluster.queue)) as schedules:
            options = {"queue": cluster.queue}
            added = schedules.add("dyn", "itest.noop", 1.0, options=options)
            phases.append(Phase(added.committed_ms, 1000))
            time.sleep(4)
            updated = schedules.update("dyn", schedule=2.0)
            phases.append(Phase(updated.committed_ms, 2000))
            time.sleep(5)
            pause = schedules.pause("dyn", note="freeze")
            phases.append(Phase(pause.paused_ms, None))
            time.sleep(4)
            resumed = schedules.resume("dyn")
            phases.append(Phase(resumed.resumed_ms or 0, 2000))
            time.sleep(4.5)
            # Two operators at once: both answer, the last committed wins.
            answers: list[Any] = []
            threads = [
                threading.Thread(
                    target=lambda p=p: answers.append(schedules_for(url).update("dyn", schedule=p))
                )
                for p in (1.0, 3.0)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(answers) == 2
            last = max(answers, key=lambda a: a.version)
            assert schedules.get("dyn").definition.schedule == last.definition.schedule  # type: ignore[union-attr]
            first = min(answers, key=lambda a: a.version)
            phases.append(Phase(first.committed_ms, int(first.definition.schedule["every"] * 1000)))
            phases.append(Phase(last.committed_ms, int(last.definition.schedule["every"] * 1000)))
            time.sleep(5)
            version = schedules.remove("dyn")
            removed_ms = schedules.backend_now_ms()
            phases.append(Phase(removed_ms, None))
            time.sleep(3)
        end_ms = int(time.time() * 1000)
        assert all(v >= version for v in applied_versions(cluster)), cluster.logs()
        cluster.stop()
        for proc in cluster.procs:
            assert proc.returncode == 0, cluster.logs()
        sent = count_sent(cluster.read_sent())
    finally:
        cluster.stop()
    problems = judge(sent, "dyn", phases, end_ms)
    assert problems == [], (problems, sorted(t for j, t in sent if j == "dyn"), phases)
    assert sum(n for (j, _), n in sent.items() if j == "dyn") >= 8


def schedules_for(url: str) -> Schedules:
    """A Schedules client of its own (another operator's)."""
    return Schedules(client_app(url, "unused"))


@pytest.mark.parametrize("name", LEASE_NAMES)
def test_an_update_during_a_burst_holds_from_its_second(name: str, tmp_path: Path) -> None:
    """2,000 code jobs due in the same second every 10 s while the stored
    job is updated in the middle of a burst: every slot is still sent once."""
    require_service("redis")
    require_service(name)
    url = backend_for(name, tmp_path)
    burst = {f"b{i}": {"task": "itest.noop", "schedule": 10.0} for i in range(2000)}
    cluster = start_cluster(url, tmp_path, beat_schedule={**LONG_ONLY, **burst})
    phases: list[Phase] = []
    try:
        with Schedules(client_app(url, cluster.queue)) as schedules:
            added = schedules.add("dyn", "itest.noop", 1.0, options={"queue": cluster.queue})
            phases.append(Phase(added.committed_ms, 1000))
            now = time.time()
            next_burst = (int(now // 10) + 1) * 10
            time.sleep(max(next_burst - time.time(), 0) + 0.05)  # the burst is being sent
            updated = schedules.update("dyn", schedule=2.0)
            phases.append(Phase(updated.committed_ms, 2000))
            time.sleep(12)
        end_ms = int(time.time() * 1000)
        cluster.stop()
        sent = count_sent(cluster.read_sent())
    finally:
        cluster.stop()
    assert judge(sent, "dyn", phases, end_ms) == []
    duplicates = {k: n for k, n in sent.items() if n > 1}
    assert duplicates == {}
    burst_slot = next_burst * 1000
    assert sum(1 for (j, t) in sent if t == burst_slot and j.startswith("b")) == 2000


@pytest.mark.parametrize("name", LEASE_NAMES)
def test_kill_9_of_an_instance_mid_change(name: str, tmp_path: Path) -> None:
    require_service("redis")
    require_service(name)
    url = backend_for(name, tmp_path)
    # The killed beat may die holding a slot it claimed and had not sent
    # yet; a lease of 3 s (max_late 20 s) lets a survivor take it over
    # inside the run, where the default 30 s would expire past max_late.
    cluster = start_cluster(url, tmp_path, anarchon_lease_ttl=3)
    phases: list[Phase] = []
    try:
        with Schedules(client_app(url, cluster.queue)) as schedules:
            added = schedules.add("dyn", "itest.noop", 1.0, options={"queue": cluster.queue})
            phases.append(Phase(added.committed_ms, 1000))
            time.sleep(3)
            updated = schedules.update("dyn", schedule=2.0)
            cluster.procs[0].send_signal(signal.SIGKILL)  # while the change propagates
            phases.append(Phase(updated.committed_ms, 2000))
            time.sleep(6)
            survivors = applied_versions(cluster)
        end_ms = int(time.time() * 1000)
        cluster.stop()
        sent = count_sent(cluster.read_sent())
    finally:
        cluster.stop()
    assert len(survivors) == 2 and all(v >= updated.version for v in survivors)
    assert judge(sent, "dyn", phases, end_ms) == []


@pytest.fixture(params=["redis", "postgresql"])
def own_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A backend server of the test's own, which it may crash and restart:
    ``(url, server)``."""
    if request.param == "redis":
        server = request.getfixturevalue("own_redis")
        yield f"redis://127.0.0.1:{server.port}/0", server
        return
    from .faults.servers import PostgresServer

    if not PostgresServer.available():
        pytest.skip("no PostgreSQL binaries to run a server of the test's own")
    with PostgresServer(tmp_path) as pg:
        yield f"postgresql://postgres@127.0.0.1:{pg.port}/test", pg


def test_a_backend_outage_during_a_change(tmp_path: Path, own_server: tuple[str, Any]) -> None:
    """The backend stops right after a change commits and comes back 3 s
    later: every beat stays up, applies the change once it answers, and
    sends no slot twice."""
    require_service("redis")
    url, server = own_server
    cluster = start_cluster(url, tmp_path)
    try:
        with Schedules(client_app(url, cluster.queue)) as schedules:
            added = schedules.add("dyn", "itest.noop", 1.0, options={"queue": cluster.queue})
            time.sleep(3)
            updated = schedules.update("dyn", schedule=2.0)
            server.crash()
            time.sleep(3)
            server.start()
            back_ms = int(time.time() * 1000)
            time.sleep(12)
        end_ms = int(time.time() * 1000)
        versions = applied_versions(cluster)
        alive = len(cluster.running())
        cluster.stop()
        sent = count_sent(cluster.read_sent())
    finally:
        cluster.stop()
    assert alive == 3, cluster.logs()
    assert all(v >= updated.version for v in versions), cluster.logs()
    assert {k: n for k, n in sent.items() if n > 1} == {}
    # Once the backend answers again (and its reconnect backoff passed), the
    # new definition's slots are all sent.
    after = [t for t in range(back_ms + 5000, end_ms - TAIL_MS, 1) if t % 2000 == 0]
    assert after and all(("dyn", t) in sent for t in after), sorted(sent)
    assert added.version < updated.version


@pytest.mark.parametrize("name", LEASE_NAMES)
def test_a_run_limit_is_exact_with_three_beats(name: str, tmp_path: Path) -> None:
    """A stored job every 0.5 s with max_runs=5 and a code entry every
    0.5 s with max_runs=4, racing on three beats: exactly 5 and 4 sends."""
    require_service("redis")
    require_service(name)
    url = backend_for(name, tmp_path)
    limited = {"code-limited": {"task": "itest.noop", "schedule": 0.5, "anarchon": {"max_runs": 4}}}
    cluster = start_cluster(url, tmp_path, beat_schedule={**LONG_ONLY, **limited})
    try:
        with Schedules(client_app(url, cluster.queue)) as schedules:
            schedules.add("stored-limited", "itest.noop", 0.5, max_runs=5)
            time.sleep(6)
            stored_history = schedules.backend.history("stored-limited")
        cluster.stop()
        sent = count_sent(cluster.read_sent())
    finally:
        cluster.stop()
    per_job = Counter(job for job, _ in sent.elements())
    assert per_job["stored-limited"] == 5, sorted(sent)
    assert per_job["code-limited"] == 4, sorted(sent)
    finished = [r for r in stored_history if (r.error or "").startswith("finished")]
    assert len(finished) == 1 and "max_runs=5 reached" in (finished[0].error or "")
