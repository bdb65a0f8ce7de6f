"""The harness's own servers and the restart scenario's wait.

Regression tests for the campaign's "backend restart" on RabbitMQ, which
once restarted the machine's shared node: the harness now boots a node of
its own (:class:`tests.faults.servers.RabbitServer`), and the scenario waits
for the beats to see the backend again before it stops them (the node takes
seconds to boot, longer than the row had left, and the row then judged
beats that never saw it back: 17 misses, none on the record).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import amqp
import pytest

from ..conftest import require_service
from .harness import port_open
from .scenarios import BACK_LOG, OUTAGE_LOG, wait_back
from .servers import RabbitServer
from .xdist_groups import BENCH_GROUP, GROUP, group_of

pytestmark = [pytest.mark.faults, pytest.mark.xdist_group("faults")]

SHARED_NODE_PORT = 5672


def shared_node_uptime_s() -> float | None:
    """Uptime of the machine's shared RabbitMQ node, seconds (None when
    ``rabbitmqctl`` cannot tell)."""
    try:
        out = subprocess.run(
            ["rabbitmqctl", "-q", "status", "--formatter", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))},
        )
        return float(json.loads(out.stdout)["uptime"])
    except Exception:
        return None


def publish_persistent(port: int, vhost: str, queue: str) -> None:
    """Publish one persistent message to durable ``queue`` and wait for the
    broker's confirm (``confirm_publish``: basic_publish waits for the ack)."""
    conn = amqp.Connection(
        f"127.0.0.1:{port}", virtual_host=vhost, connect_timeout=5, confirm_publish=True
    )
    conn.connect()
    try:
        channel = conn.channel()
        channel.queue_declare(queue, durable=True, auto_delete=False)
        channel.basic_publish(
            amqp.Message(b"kept", delivery_mode=2), routing_key=queue, confirm_timeout=30
        )
    finally:
        conn.close()


def count_messages(port: int, vhost: str, queue: str, wait_s: float = 20.0) -> int:
    """The messages in ``queue``. A node that was just started accepts
    connections before it has recovered its vhosts' durable queues, so a
    NOT_FOUND is asked again for up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        conn = amqp.Connection(f"127.0.0.1:{port}", virtual_host=vhost, connect_timeout=5)
        conn.connect()
        try:
            _, count, _ = conn.channel().queue_declare(queue, durable=True, passive=True)
            return int(count)
        except amqp.exceptions.NotFound:
            if time.monotonic() >= deadline:
                raise
        finally:
            conn.close()
        time.sleep(0.5)


@pytest.mark.services
@pytest.mark.skipif(not RabbitServer.available(), reason="RabbitMQ's start scripts are missing")
def test_rabbit_server_is_a_node_of_its_own() -> None:
    """The harness's node: its own name and port, survives a crash with its
    data (a confirmed persistent message on a durable queue), is gone with
    its folder afterwards, and the shared node was not restarted."""
    require_service("rabbitmq")
    before = shared_node_uptime_s()
    with RabbitServer("anarchon-faults-servertest") as server:
        assert server.port != SHARED_NODE_PORT
        assert not server.node.startswith("rabbit@")
        assert server.env()["RABBITMQ_NODENAME"] == server.node
        root = server.root
        publish_persistent(server.port, server.vhost, "survives")
        server.crash()
        assert not port_open(server.port)
        assert port_open(SHARED_NODE_PORT)  # the shared node did not go with it
        server.start()
        assert count_messages(server.port, server.vhost, "survives") == 1
        pid = server.proc.pid if server.proc else None
    assert not root.exists()
    assert not port_open(server.port)
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    after = shared_node_uptime_s()
    if before is not None and after is not None:
        assert after >= before  # not restarted meanwhile


def _fake_run(tmp_path: Path, texts: list[bytes]) -> Any:
    procs = [SimpleNamespace(name=f"beat-{i}") for i in range(len(texts))]
    for proc, text in zip(procs, texts, strict=True):
        (tmp_path / f"{proc.name}.log").write_bytes(text)
    cluster = SimpleNamespace(
        running=lambda: procs, log_path=lambda proc: tmp_path / f"{proc.name}.log"
    )
    return SimpleNamespace(cluster=cluster)


def test_wait_back_waits_for_every_beat_that_lost_the_backend(tmp_path: Path) -> None:
    away = b"x " + OUTAGE_LOG + b"refused)\n"
    back = BACK_LOG + b" 15.1s\n"
    run = _fake_run(tmp_path, [away + back, away, b"never lost it\n"])
    assert wait_back(run, timeout=0.3) is False
    (tmp_path / "beat-1.log").write_bytes(away + back)
    assert wait_back(run, timeout=0.3) is True
    # A second outage needs a second "back".
    (tmp_path / "beat-0.log").write_bytes(away + back + away)
    assert wait_back(run, timeout=0.3) is False


def test_campaign_tests_share_one_xdist_unit() -> None:
    """Every test of the campaign's files is scheduled as one unit; other
    tests (the lease fault tests included) each on their own."""
    row = "tests/faults/test_campaign.py::test_short_profile[kill-9 loop-sqlite]"
    assert group_of(row) == GROUP
    assert group_of("tests/faults/test_campaign.py::test_bad_input[a@b-redis]") == GROUP
    assert group_of("tests/faults/test_servers.py::test_wait_back") == GROUP
    delayed_row = "tests/faults/test_delayed_faults.py::test_kill_9_mid_release[redis]"
    assert group_of(delayed_row) == GROUP
    other = "tests/beat/test_lease_faults.py::test_kill9_between_claim_and_send[redis]"
    assert group_of(other) == other
    assert group_of("tests/test_bench_smoke.py::test_burst_smoke") == BENCH_GROUP != GROUP
    assert group_of("tests/test_x.py::test_y@pool") == "pool"
