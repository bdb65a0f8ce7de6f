"""RabbitMQ claim-only backend against the real broker on 127.0.0.1:5672.

Each test module run gets its own vhost (created and deleted here). Failures
the broker cannot be made to show on demand (a confirm lost in flight, a gate
deleted between declare and publish) are made by :class:`WireProxy`, a TCP
proxy on loopback that reads the AMQP frames going by and cuts, stalls or
hooks the link at an exact frame. Only our own proxied connection is cut;
no other connection of the shared broker is touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import amqp
import kombu
import pytest

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import AbsentRecord, Claim, ClaimRequest, State
from celery_anarchon.backends.rabbitmq import (
    MAX_QUEUE_NAME_BYTES,
    RabbitMQBackend,
    check_job,
    fold_history,
    history_arguments,
)
from celery_anarchon.exceptions import BackendUnavailable, ConfigurationError

from ..conftest import require_service

pytestmark = pytest.mark.services

VHOST = f"anarchon-rmq-{uuid.uuid4().hex[:8]}"
QUORUM_VHOST = f"{VHOST}-quorum"
BROKER = ("127.0.0.1", 5672)


def url_for(vhost: str, host: str = "127.0.0.1", port: int = 5672) -> str:
    return f"amqp://guest:guest@{host}:{port}/{vhost}"


def ctl(*args: str) -> str:
    """Run ``rabbitmqctl`` and return its output."""
    done = subprocess.run(
        [shutil.which("rabbitmqctl") or "rabbitmqctl", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout


def queues(vhost: str) -> dict[str, dict[str, Any]]:
    """The vhost's queues: name -> {durable, type, arguments (dict)}."""
    rows = json.loads(
        ctl(
            "list_queues",
            "-q",
            "-p",
            vhost,
            "name",
            "durable",
            "type",
            "arguments",
            "--formatter",
            "json",
        )  # fmt: skip
    )
    return {
        row["name"]: {
            "durable": row["durable"],
            "type": row["type"],
            "arguments": {name: value for name, _kind, value in row["arguments"]},
        }
        for row in rows
    }


@pytest.fixture(scope="module")
def vhost() -> Iterator[str]:
    require_service("rabbitmq")
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed")
    ctl("add_vhost", VHOST)
    ctl("set_permissions", "-p", VHOST, "guest", ".*", ".*", ".*")
    yield VHOST
    ctl("delete_vhost", VHOST)


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:6]}."


@pytest.fixture
def make(vhost: str, prefix: str) -> Iterator[Callable[..., RabbitMQBackend]]:
    """Build opened backends on the test vhost (closed at the end):
    ``make("host-a", slot_ttl=2, url=...)``."""
    made: list[RabbitMQBackend] = []

    def build(instance: str, url: str | None = None, **options: Any) -> RabbitMQBackend:
        backend = backend_from_url(
            url or url_for(vhost),
            instance=instance,
            options={"prefix": prefix, "slot_ttl": 60, **options},
        )
        assert isinstance(backend, RabbitMQBackend)
        backend.open()
        made.append(backend)
        return backend

    yield build
    for backend in made:
        backend.close()


@pytest.fixture
def admin(vhost: str) -> Iterator[amqp.Connection]:
    conn = amqp.Connection(f"{BROKER[0]}:{BROKER[1]}", virtual_host=vhost)
    conn.connect()
    yield conn
    conn.close()


def request(job: str, slot_ms: int, history_size: int = 100) -> ClaimRequest:
    return ClaimRequest(
        job=job,
        slot_ms=slot_ms,
        window_before_ms=60_000,
        window_after_ms=10_000,
        keep_until_ms=slot_ms + 120_000,
        history_size=history_size,
    )


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- a proxy that reads the wire ------------------------------------------------

BASIC, PUBLISH, RETURN, ACK, NACK = 60, 40, 50, 80, 120
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"


def frames(buffer: bytearray) -> Iterator[bytes]:
    """Complete AMQP frames taken off the front of ``buffer``."""
    while len(buffer) >= 7:
        size = struct.unpack(">I", buffer[3:7])[0]
        if len(buffer) < 8 + size:
            return
        frame = bytes(buffer[: 8 + size])
        del buffer[: 8 + size]
        yield frame


def method_of(frame: bytes) -> tuple[int, int] | None:
    """(class, method) of a method frame, else None."""
    if frame[0] != 1:
        return None
    class_id, method_id = struct.unpack(">HH", frame[7:11])
    return class_id, method_id


def publish_routing_key(frame: bytes) -> str:
    """The routing key of a basic.publish method frame."""
    at = 7 + 4 + 2  # header, class+method, reserved short
    at += 1 + frame[at]  # exchange shortstr
    return frame[at + 1 : at + 1 + frame[at]].decode()


def hang_up(*sockets: socket.socket) -> None:
    """Shut down and close ``sockets`` (shutdown also wakes a thread blocked
    reading one, and the peer sees the connection end at once)."""
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()


class WireProxy:
    """A TCP proxy on loopback in front of RabbitMQ that parses AMQP frames.

    * ``publishes``: routing keys of every basic.publish the clients sent;
    * ``returns``: basic.return frames the broker sent;
    * ``on_publish(routing_key)``: run before a publish is passed on;
    * ``confirm_fault``: ``"cut"`` closes both sides instead of passing on
      the next basic.ack/nack; ``"stall"`` stops passing anything from the
      broker from there on. Reset to None once used.
    """

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.publishes: list[str] = []
        self.returns = 0
        self.on_publish: Callable[[str], None] | None = None
        self.confirm_fault: str | None = None
        self.faulted = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(BROKER)
            self.sockets += [client, server]
            threading.Thread(target=self._upstream, args=(client, server), daemon=True).start()
            threading.Thread(target=self._downstream, args=(server, client), daemon=True).start()

    @staticmethod
    def _pump(
        src: socket.socket, dst: socket.socket, skip: int, look: Callable[[bytes], bool]
    ) -> None:
        """Pass frames from ``src`` to ``dst`` while ``look(frame)`` says so
        (the first ``skip`` bytes, a protocol header, pass as they are)."""
        buffer = bytearray()
        try:
            while chunk := src.recv(65536):
                buffer += chunk
                if skip and len(buffer) >= skip:
                    dst.sendall(bytes(buffer[:skip]))
                    del buffer[:skip]
                    skip = 0
                if skip:
                    continue
                for frame in frames(buffer):
                    if look(frame):
                        dst.sendall(frame)
        except OSError:
            pass
        finally:
            hang_up(src, dst)

    def _upstream(self, client: socket.socket, server: socket.socket) -> None:
        def look(frame: bytes) -> bool:
            if method_of(frame) == (BASIC, PUBLISH):
                key = publish_routing_key(frame)
                self.publishes.append(key)
                if self.on_publish is not None:
                    self.on_publish(key)
            return True

        self._pump(client, server, len(PROTOCOL_HEADER), look)

    def _downstream(self, server: socket.socket, client: socket.socket) -> None:
        stalled = False

        def look(frame: bytes) -> bool:
            nonlocal stalled
            method = method_of(frame)
            if method == (BASIC, RETURN):
                self.returns += 1
            if method in ((BASIC, ACK), (BASIC, NACK)) and self.confirm_fault:
                fault, self.confirm_fault = self.confirm_fault, None
                self.faulted.set()
                if fault == "cut":
                    hang_up(client, server)
                    return False
                stalled = True
            return not stalled

        self._pump(server, client, 0, look)

    def close(self) -> None:
        hang_up(self.listener, *self.sockets)


@pytest.fixture
def proxy() -> Iterator[WireProxy]:
    wire = WireProxy()
    yield wire
    wire.close()


# -- gate queues ------------------------------------------------------------------


def test_gate_is_classic_durable_with_its_arguments_and_expires(
    make: Callable[..., RabbitMQBackend], vhost: str
) -> None:
    # The arguments on a gate that outlives the listing (rabbitmqctl can take
    # seconds on a loaded machine); the expiry on a second, short-lived one.
    backend = make("host-a", slot_ttl=600)
    slot = now_ms()
    assert backend.claim([request("sync", slot)])[0].won
    gate = backend.gate_queue("sync", slot)
    assert gate == f"{backend.prefix}sync.slot.{slot}"
    short = make("host-b", slot_ttl=1)
    assert short.claim([request("brief", slot)])[0].won
    listed = queues(vhost)
    assert listed[gate]["durable"] is True
    assert listed[gate]["type"] == "classic"
    assert listed[gate]["arguments"] == {
        "x-queue-type": "classic",
        "x-max-length": 1,
        "x-overflow": "reject-publish",
        "x-expires": 600_000,
    }
    history = listed[backend.history_queue("sync")]
    assert history["type"] == "stream" and history["durable"] is True
    assert history["arguments"] == history_arguments(100, "sync")
    # Polled with rabbitmqctl: a passive declare would renew the gate's lease.
    gate = short.gate_queue("brief", slot)
    deadline = time.monotonic() + 15
    while gate in queues(vhost) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gate not in queues(vhost)


def test_gates_stay_classic_in_a_vhost_whose_default_type_is_quorum(prefix: str) -> None:
    require_service("rabbitmq")
    ctl("add_vhost", QUORUM_VHOST, "--default-queue-type", "quorum")
    try:
        ctl("set_permissions", "-p", QUORUM_VHOST, "guest", ".*", ".*", ".*")
        backend = RabbitMQBackend(url_for(QUORUM_VHOST), instance="a", prefix=prefix)
        backend.open()
        slot = now_ms()
        assert backend.claim([request("q", slot)])[0].won
        assert not backend.claim([request("q", slot)])[0].won
        backend.close()
        assert queues(QUORUM_VHOST)[backend.gate_queue("q", slot)]["type"] == "classic"
    finally:
        ctl("delete_vhost", QUORUM_VHOST)


def test_two_instances_racing_on_300_slots_win_each_once(
    make: Callable[..., RabbitMQBackend],
) -> None:
    a, b = make("host-a"), make("host-b")
    base = now_ms() - 300_000
    slots = [base + i * 1000 for i in range(300)]
    orders = {a: slots, b: random.sample(slots, len(slots))}
    answers: dict[RabbitMQBackend, list[Claim]] = {}
    barrier = threading.Barrier(2)

    def race(backend: RabbitMQBackend) -> None:
        barrier.wait()
        answers[backend] = backend.claim([request("race", s) for s in orders[backend]])

    threads = [threading.Thread(target=race, args=(x,)) for x in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    won = Counter(c.slot_ms for claims in answers.values() for c in claims if c.won)
    assert sorted(won) == slots
    assert set(won.values()) == {1}
    lost = [c for claims in answers.values() for c in claims if not c.won]
    assert len(lost) == 300 and {c.reason for c in lost} == {"taken"}
    assert all(answers[a][i].slot_ms == s for i, s in enumerate(orders[a]))


def test_a_nacked_claim_is_never_published_again(
    make: Callable[..., RabbitMQBackend], vhost: str, proxy: WireProxy
) -> None:
    a = make("host-a")
    b = make("host-b", url=url_for(vhost, port=proxy.port))
    slot = now_ms()
    assert a.claim([request("nack", slot)])[0].won
    lost = b.claim([request("nack", slot)])[0]
    assert (lost.won, lost.reason) == (False, "taken")
    time.sleep(0.2)  # anything re-published would pass the proxy by now
    assert proxy.publishes.count(b.gate_queue("nack", slot)) == 1


def test_a_returned_claim_reads_as_lost(
    make: Callable[..., RabbitMQBackend], vhost: str, proxy: WireProxy, admin: amqp.Connection
) -> None:
    b = make("host-b", url=url_for(vhost, port=proxy.port))
    slot = now_ms()
    gate = b.gate_queue("vanish", slot)

    def delete_gate(routing_key: str) -> None:
        if routing_key == gate:
            channel = admin.channel()
            channel.queue_delete(gate)
            channel.close()

    proxy.on_publish = delete_gate
    claim = b.claim([request("vanish", slot)])[0]
    assert proxy.returns == 1  # the broker really returned it (and acked it)
    assert (claim.won, claim.reason) == (False, "unknown")
    assert b.history("vanish") == []


def test_a_lost_confirm_counts_as_lost_and_is_recorded(
    make: Callable[..., RabbitMQBackend], vhost: str, proxy: WireProxy
) -> None:
    b = make("host-b", url=url_for(vhost, port=proxy.port))
    a = make("host-a")
    slot = now_ms()
    proxy.confirm_fault = "cut"  # the broker acks b's publish; b never hears it
    claim = b.claim([request("cut", slot)])[0]
    assert proxy.faulted.is_set()
    assert (claim.won, claim.reason) == (False, "unknown")
    again = a.claim([request("cut", slot)])[0]
    assert (again.won, again.reason) == (False, "taken")  # b's publish did fill the gate
    [record] = a.history("cut")
    assert (record.state, record.instance, record.slot_ms) == (State.LOST, "host-b", slot)
    assert record.error and "unknown" in record.error


def test_a_lost_nack_does_not_hide_the_winner(
    make: Callable[..., RabbitMQBackend], vhost: str, proxy: WireProxy
) -> None:
    a = make("host-a")
    b = make("host-b", url=url_for(vhost, port=proxy.port))
    slot = now_ms()
    won = a.claim([request("nacked", slot)])[0]
    a.mark(won, State.SENT, task_id="t-1")
    proxy.confirm_fault = "cut"
    assert b.claim([request("nacked", slot)])[0].reason == "unknown"
    [record] = b.history("nacked")
    assert (record.state, record.instance, record.task_id) == (State.SENT, "host-a", "t-1")


def test_no_confirm_within_confirm_timeout_reads_unknown(
    make: Callable[..., RabbitMQBackend], vhost: str, proxy: WireProxy
) -> None:
    b = make("host-b", url=url_for(vhost, port=proxy.port), confirm_timeout=0.5)
    a = make("host-a")
    slot = now_ms()
    proxy.confirm_fault = "stall"
    started = time.monotonic()
    claim = b.claim([request("stall", slot)])[0]
    assert (claim.won, claim.reason) == (False, "unknown")
    assert 0.5 <= time.monotonic() - started < 5
    assert not a.claim([request("stall", slot)])[0].won
    assert b.claim([request("stall", slot + 1)])[0].won  # b reconnected


def test_instances_with_other_slot_ttls_share_gates(
    make: Callable[..., RabbitMQBackend], vhost: str
) -> None:
    short, long = make("host-short", slot_ttl=20), make("host-long", slot_ttl=40)
    base = now_ms() - 100_000
    slots = [base + i * 1000 for i in range(60)]
    by_short, by_long, free = slots[0::3], slots[1::3], slots[2::3]
    assert all(c.won for c in short.claim([request("mixed", s) for s in by_short]))
    assert all(c.won for c in long.claim([request("mixed", s) for s in by_long]))
    answers: list[Claim] = []
    barrier = threading.Barrier(2)

    def race(backend: RabbitMQBackend) -> None:
        barrier.wait()
        answers.extend(backend.claim([request("mixed", s) for s in slots]))

    threads = [threading.Thread(target=race, args=(x,)) for x in (short, long)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == 120  # both answered every slot: no error escaped
    won = Counter(c.slot_ms for c in answers if c.won)
    assert sorted(won) == free and set(won.values()) == {1}
    listed = queues(vhost)

    def expires(slot: int) -> int:
        value: int = listed[short.gate_queue("mixed", slot)]["arguments"]["x-expires"]
        return value

    assert {expires(s) for s in by_short} == {20_000}
    assert {expires(s) for s in by_long} == {40_000}
    assert {expires(s) for s in free} <= {20_000, 40_000}


def test_job_names_are_mapped_to_safe_distinct_queue_names(
    make: Callable[..., RabbitMQBackend], vhost: str
) -> None:
    backend = make("host-a")
    names = [
        "proj.tasks.add(1, 2)",
        "proj_tasks_add_1_2_",
        "proj.tasks.add(1,2)",
        "ジョブ",
        "x" * 300,
    ]
    slot = now_ms()
    claims = backend.claim([request(name, slot) for name in names])
    assert all(c.won for c in claims)
    gates = [backend.gate_queue(name, slot) for name in names]
    assert len(set(gates)) == len(names)
    assert gates[1] == f"{backend.prefix}proj_tasks_add_1_2_.slot.{slot}"
    for gate in gates + [backend.history_queue(n) for n in names]:
        assert len(gate.encode()) <= MAX_QUEUE_NAME_BYTES
        assert gate.isascii()
    listed = queues(vhost)
    assert set(gates) <= set(listed)
    backend.mark(claims[0], State.SENT, task_id="t-add")
    [record] = backend.history(names[0])
    assert (record.job, record.state, record.task_id) == (names[0], State.SENT, "t-add")
    # Every history stream takes records, the longest name's too (a stream
    # whose directory name passes 255 bytes would never confirm one).
    for name in names[1:]:
        assert [(r.job, r.state) for r in backend.history(name)] == [(name, State.CLAIMED)]


def test_new_streams_are_declared_over_several_channels_and_take_every_record(
    make: Callable[..., RabbitMQBackend],
) -> None:
    # The streams of a batch's new jobs are declared over several channels;
    # the records then go out on the history channel, each to its job's.
    a, b = make("host-a"), make("host-b")
    slot = now_ms() - 5_000
    jobs = [f"ahead-{i}" for i in range(6)]
    assert all(c.won for c in a.claim([request(j, slot) for j in jobs]))
    assert not any(c.won for c in b.claim([request(j, slot) for j in jobs]))
    # b: a new slot of the same jobs (streams known to a, new to b's
    # connection) and one new job.
    later = slot + 1000
    answers = b.claim([request(j, later) for j in [*jobs, "ahead-new"]])
    assert all(c.won for c in answers)
    b.mark_many(answers, State.SENT, task_ids=[f"t-{c.job}" for c in answers])
    for job in jobs:
        runs = a.history(job)
        assert [(r.slot_ms, r.instance, r.state) for r in runs] == [
            (later, "host-b", State.SENT),
            (slot, "host-a", State.CLAIMED),
        ]
    assert [r.state for r in a.history("ahead-new")] == [State.SENT]


def test_a_stream_declared_on_one_of_several_channels_with_other_arguments_is_used(
    make: Callable[..., RabbitMQBackend],
) -> None:
    # The stream exists with another history_size: its declare fails (406)
    # on one of the stream channels and is made again passively there.
    a, b = make("host-a"), make("host-b")
    slot = now_ms() - 5_000
    assert a.claim([request("sized", slot, history_size=10)])[0].won
    answers = b.claim([request("sized", slot + 1000, history_size=50), request("other", slot)])
    assert all(c.won for c in answers)
    assert [(r.slot_ms, r.instance) for r in a.history("sized")] == [
        (slot + 1000, "host-b"),
        (slot, "host-a"),
    ]


def test_history_stream_is_trimmed_by_size(make: Callable[..., RabbitMQBackend]) -> None:
    backend = make("host-a")
    base = now_ms() - 10_000_000
    first = backend.claim([request("trim", base, history_size=3)])[0]
    assert first.won
    for i in range(1, 400):
        run = Claim("trim", base + i * 1000, won=True, token=f"tok-{i}")
        backend.mark(run, State.SENT, task_id=f"t-{i}")
    runs = backend.history("trim")
    # A 3-run budget of 4 records each keeps between 3*4 and 3*4*4/3 + a
    # segment of records: far fewer than the 400 appended.
    assert 3 <= len(runs) <= 40
    assert runs[0].slot_ms == base + 399_000
    assert [r.slot_ms for r in runs] == sorted((r.slot_ms for r in runs), reverse=True)


def test_missed_slot_closes_the_gate_and_shows_in_history(
    make: Callable[..., RabbitMQBackend],
) -> None:
    a, b = make("host-a"), make("host-b")
    slot = now_ms() - 70_000
    assert a.record_many_if_absent(
        [AbsentRecord("m", slot, State.MISSED, error="nobody in time", history_size=5)]
    )[0]
    assert not b.record_many_if_absent([AbsentRecord("m", slot, State.MISSED)])[0]
    assert b.claim([request("m", slot)])[0].reason == "taken"
    [record] = b.history("m")
    assert (record.state, record.instance, record.error) == (
        State.MISSED,
        "host-a",
        "nobody in time",
    )


def test_manual_runs_win_once_per_key_and_keep_their_key(
    make: Callable[..., RabbitMQBackend],
) -> None:
    a, b = make("host-a"), make("host-b")
    keep = now_ms() + 200_000  # beyond slot_ttl (60 s): the gate lives 4 x 60 s
    first = a.claim_manual("deploy", "v1", keep)
    assert first.won and isinstance(first.token, str)
    assert not b.claim_manual("deploy", "v1", keep).won
    a.mark(first, State.SENT, task_id="manual-1")
    [record] = b.history("deploy")
    assert (record.manual_key, record.state, record.task_id) == ("v1", State.SENT, "manual-1")


def test_a_run_whose_runner_crashed_stays_running(make: Callable[..., RabbitMQBackend]) -> None:
    backend = make("host-a")
    claim = backend.claim([request("crash", now_ms())])[0]
    backend.mark(claim, State.SENT, task_id="t")
    backend.mark(claim, State.RUNNING)
    assert backend.history("crash")[0].state is State.RUNNING
    assert backend.last_run("crash") is not None


# -- connections and settings ----------------------------------------------------


def test_user_connections_are_not_used_for_claims_nor_closed(vhost: str, prefix: str) -> None:
    with kombu.Connection(url_for(vhost), transport_options={"confirm_publish": True}) as theirs:
        theirs.connect()
        channels = set(theirs.connection.channels)
        backend = backend_from_url(None, client=theirs, instance="a", options={"prefix": prefix})
        backend.open()
        slot = now_ms()
        assert backend.claim([request("own", slot)])[0].won
        assert not backend.claim([request("own", slot)])[0].won  # a nack, not an exception
        assert set(theirs.connection.channels) == channels
        assert "guest:guest" not in backend.describe()
        backend.close()
        assert theirs.connected
        theirs.default_channel.queue_declare(queue=f"{prefix}still-open", auto_delete=True)
    raw = amqp.Connection(f"{BROKER[0]}:{BROKER[1]}", virtual_host=vhost)
    raw.connect()
    backend = RabbitMQBackend(None, client=raw, instance="b", prefix=prefix)
    backend.open()
    assert backend.claim([request("own", now_ms() + 5)])[0].won
    assert set(raw.channels) == {0}  # only the connection itself
    backend.close()
    assert raw.connected
    raw.close()


def test_url_options_and_bad_settings(vhost: str) -> None:
    backend = backend_from_url(f"{url_for(vhost)}?slot_ttl=2.5&prefix=p.", instance="a")
    assert isinstance(backend, RabbitMQBackend)
    assert (backend.slot_ttl, backend.slot_ttl_ms, backend.prefix) == (2.5, 2500, "p.")
    with pytest.raises(ConfigurationError, match="slot_ttl"):
        RabbitMQBackend(url_for(vhost), instance="a", slot_ttl="soon")
    with pytest.raises(ConfigurationError, match="amq."):
        RabbitMQBackend(url_for(vhost), instance="a", prefix="amq.cron.")
    with pytest.raises(ConfigurationError, match="too long"):
        RabbitMQBackend(url_for(vhost), instance="a", prefix="p" * 240)
    with pytest.raises(ConfigurationError, match="kombu Connection"):
        RabbitMQBackend(None, client=object(), instance="a")


def test_bad_login_or_vhost_is_a_configuration_error(vhost: str) -> None:
    require_service("rabbitmq")
    for url in (
        f"amqp://guest:wrong@127.0.0.1:5672/{vhost}",
        "amqp://guest:guest@127.0.0.1:5672/no-such-vhost-anarchon",
    ):
        backend = RabbitMQBackend(url, instance="a")
        with pytest.raises(ConfigurationError) as caught:
            backend.open()
        assert "wrong" not in str(caught.value)
        backend.close()


def test_a_dead_broker_raises_backend_unavailable_and_publishes_nothing(
    make: Callable[..., RabbitMQBackend], vhost: str, proxy: WireProxy
) -> None:
    b = make("host-b", url=url_for(vhost, port=proxy.port))
    proxy.close()  # the link and the listener are gone: nothing reaches the broker
    with pytest.raises(BackendUnavailable):
        b.claim([request("dead", now_ms())])
    assert proxy.publishes == []


def test_check_job_refuses_a_slot_ttl_a_late_instance_could_outlive(
    make: Callable[..., RabbitMQBackend],
) -> None:
    check_job("ok", jitter_s=2, max_late_s=60, max_skew_s=10, slot_ttl_s=72.5)
    with pytest.raises(ConfigurationError) as caught:
        check_job("late", jitter_s=2, max_late_s=60, max_skew_s=10, slot_ttl_s=72)
    for part in ("'late'", "jitter (2 s)", "max_late (60 s)", "max_skew (10 s)", "slot_ttl (72 s)"):
        assert part in str(caught.value)
    backend = make("host-a", slot_ttl=30)
    backend.check_job("fits", jitter_s=2, max_late_s=10, max_skew_s=5)
    with pytest.raises(ConfigurationError, match="slot_ttl"):
        backend.check_job("late", jitter_s=2, max_late_s=60, max_skew_s=10)


# -- folding history (no broker) --------------------------------------------------


def test_fold_keeps_the_winner_and_drops_other_instances_lost_records() -> None:
    records: list[dict[str, Any]] = [
        {"job": "j", "slot_ms": 1, "state": "lost", "instance": "b", "token": "b/1"},
        {"job": "j", "slot_ms": 1, "state": "claimed", "token": "a/1", "claimed_at_ms": 5},
        {"job": "j", "slot_ms": 1, "state": "sent", "token": "a/1", "task_id": "t"},
        {"job": "j", "slot_ms": 2, "state": "lost", "instance": "c", "token": "c/1"},
        {"job": "j", "slot_ms": 3, "state": "claimed", "token": "m/1", "manual_key": "k1"},
        {"job": "j", "slot_ms": 3, "state": "claimed", "token": "m/2", "manual_key": "k2"},
        {"job": "j", "slot_ms": "bad", "state": "sent"},
        {"job": "j", "slot_ms": 4, "state": "nonsense"},
    ]
    runs = fold_history(records)
    assert [(r.slot_ms, r.state.value) for r in runs] == [
        (3, "claimed"),
        (3, "claimed"),
        (2, "lost"),
        (1, "sent"),
    ]
    assert {r.manual_key for r in runs[:2]} == {"k1", "k2"}
    assert (runs[3].claimed_at_ms, runs[3].task_id) == (5, "t")


def test_fold_moves_a_run_forward_only() -> None:
    run = {"job": "j", "slot_ms": 1, "token": "a/1"}
    records: list[dict[str, Any]] = [
        {**run, "state": "claimed", "claimed_at_ms": 1},
        {**run, "state": "running", "started_at_ms": 3},
        {**run, "state": "sent", "sent_at_ms": 2, "task_id": "t"},  # late sent
        {**run, "state": "running", "started_at_ms": 9},  # duplicate delivery
        {**run, "state": "succeeded", "finished_at_ms": 4},
        {**run, "state": "failed", "finished_at_ms": 5, "error": "late"},
    ]
    [folded] = fold_history(records)
    assert folded.state is State.SUCCEEDED
    assert (folded.sent_at_ms, folded.task_id) == (2, "t")
    assert (folded.started_at_ms, folded.finished_at_ms, folded.error) == (3, 4, None)


def test_fold_keeps_the_instance_that_claimed_the_run() -> None:
    """With the worker integration, the worker appends running/succeeded
    under its own instance id: the run still shows the beat that sent it,
    as on Redis and SQL."""
    run = {"job": "j", "slot_ms": 1, "token": "beat-a/1"}
    records: list[dict[str, Any]] = [
        {**run, "state": "claimed", "instance": "beat-a", "claimed_at_ms": 1},
        {**run, "state": "sent", "instance": "beat-a", "sent_at_ms": 2, "task_id": "t"},
        {**run, "state": "running", "instance": "worker-w", "started_at_ms": 3},
        {**run, "state": "succeeded", "instance": "worker-w", "finished_at_ms": 4},
    ]
    [folded] = fold_history(records)
    assert (folded.state, folded.instance) == (State.SUCCEEDED, "beat-a")


def test_a_claim_logs_one_info_line_and_open_says_the_backend_is_ready(
    make: Callable[..., RabbitMQBackend], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="celery_anarchon"):
        backend = make("host-a")
        slot = now_ms() // 1000 * 1000
        [claim] = backend.claim([request("heartbeat", slot)])
    assert claim.won
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert any(m.startswith("anarchon: RabbitMQ claim backend ready: ") for m in info), info
    assert all(m.startswith("anarchon: ") for m in info), info
    assert not any(str(slot) in m for m in info), info  # no raw milliseconds at INFO
