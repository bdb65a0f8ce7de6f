"""What the harness puts between the beats and a service, or runs itself:
a TCP proxy on loopback that cuts, delays and stalls, and Redis,
PostgreSQL, MariaDB and RabbitMQ servers on spare ports that a scenario can crash
and restart (never the machine's shared services).

Everything listens on 127.0.0.1 only, every thread and process stops on
:meth:`close`, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from .harness import free_port, port_open, wait_until

#: How often blocked proxy threads look at their flags, seconds.
POLL_S = 0.1


class Proxy:
    """A TCP proxy from ``127.0.0.1:<port>`` to ``127.0.0.1:<target>``.

    Faults, each switched on and off at any time:

    * :meth:`cut`: close every connection and refuse new ones (accepted and
      closed at once) until :meth:`restore`;
    * ``latency``: seconds added before each chunk of a reply is passed on
      (server to client), so a request/reply round trip takes that much more;
    * :meth:`stall`: stop passing replies on (connections stay open, data is
      held) until :meth:`unstall`: a server that hangs mid-reply;
    * :meth:`blackhole`: accept connections and pass nothing on, either way
      (what arrives is read and dropped, so the client's TCP stack sees its
      data acknowledged), until :meth:`restore`, which also closes the
      connections accepted meanwhile: a hung server, or a pooler whose
      database went away;
    * ``request_delay``: seconds each chunk from the client waits before it
      is passed on (requests reach the server late; replies are not
      delayed): a request held up in the network.
    """

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.latency = 0.0
        self.request_delay = 0.0
        self._open = True
        self._stalled = False
        self._blackholed = False
        self._held: set[socket.socket] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(128)
        self._listener.settimeout(POLL_S)
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- faults ------------------------------------------------------------------

    def cut(self) -> None:
        """Drop every connection now and refuse new ones."""
        self._open = False
        with self._lock:
            conns, self._conns = set(self._conns), set()
        for conn in conns:
            _close(conn)

    def restore(self) -> None:
        """End a cut or a blackhole; connections accepted during a
        blackhole are closed."""
        self._open = True
        self._blackholed = False
        with self._lock:
            held, self._held = set(self._held), set()
        for conn in held:
            _close(conn)

    def blackhole(self) -> None:
        self._blackholed = True

    def stall(self) -> None:
        self._stalled = True

    def unstall(self) -> None:
        self._stalled = False

    def close(self) -> None:
        self._stop.set()
        self.cut()
        self.restore()
        _close(self._listener)
        for thread in self._threads:
            thread.join(2)

    # -- plumbing ----------------------------------------------------------------

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._open:
                _close(client)
                continue
            if self._blackholed:
                with self._lock:
                    self._held.add(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                _close(client)
                continue
            for sock in (client, upstream):
                sock.settimeout(POLL_S)
            with self._lock:
                self._conns.update((client, upstream))
            self._spawn(self._pump, client, upstream, False)
            self._spawn(self._pump, upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        try:
            while not self._stop.is_set():
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                if self._blackholed:
                    continue
                if not reply and self.request_delay:
                    time.sleep(self.request_delay)
                if reply:
                    while self._stalled and not self._stop.is_set():
                        time.sleep(POLL_S)
                    if self.latency:
                        time.sleep(self.latency)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                _close(sock)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class RedisServer:
    """A ``redis-server`` of the harness's own on a spare port, with an
    append-only file synced on every write (``appendfsync always``), so a
    crash loses no acknowledged claim. :meth:`crash` kills it (-9);
    :meth:`start` brings it back on the same port and data."""

    def __init__(self, folder: Path, *, password: str | None = None) -> None:
        self.folder = folder / "redis-data"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.crash()

    def start(self) -> None:
        args = [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.folder),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        log = open(self.folder / "redis.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if not wait_until(lambda: port_open(self.port), 15):
            raise RuntimeError(f"redis-server on port {self.port} did not start")

    def crash(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


class PostgresServer:
    """A PostgreSQL cluster of the harness's own on a spare port, run as the
    ``postgres`` user (PostgreSQL refuses root), with a database ``test``.
    :meth:`crash` stops it with ``-m immediate`` (no shutdown checkpoint: a
    crash as far as the data is concerned); :meth:`start` brings it back."""

    def __init__(self, folder: Path) -> None:
        self.root = Path(f"/tmp/anarchon-faults-pg-{os.getpid()}-{free_port()}")
        self.data = self.root / "data"
        self.port = free_port()
        self.bin = _pg_bin()

    @staticmethod
    def available() -> bool:
        return _pg_bin() is not None and shutil.which("su") is not None

    def __enter__(self) -> PostgresServer:
        assert self.bin is not None
        self.root.mkdir(parents=True)
        shutil.chown(self.root, "postgres", "postgres")
        self._as_postgres(f"{self.bin}/initdb -D {self.data} -A trust -U postgres --no-sync")
        self.start()
        self._as_postgres(f"{self.bin}/createdb -h 127.0.0.1 -p {self.port} -U postgres test")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.crash()
        shutil.rmtree(self.root, ignore_errors=True)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        self._as_postgres(
            f"{self.bin}/pg_ctl -D {self.data} -l {self.root}/pg.log -w -t 30 -o '{options}' start"
        )

    def crash(self) -> None:
        if self.data.exists():
            self._as_postgres(
                f"{self.bin}/pg_ctl -D {self.data} -m immediate -w -t 30 stop", check=False
            )

    def _as_postgres(self, command: str, check: bool = True) -> None:
        subprocess.run(
            ["su", "postgres", "-s", "/bin/sh", "-c", command],
            check=check,
            capture_output=True,
            timeout=90,
        )


class MariaDBServer:
    """A MariaDB server of the harness's own on a spare port, with a data
    directory and socket of its own and a database ``test`` (no grant
    tables: any user name logs in, as root does on the shared server).
    :meth:`crash` kills it (-9: InnoDB recovers from its redo log, flushed
    at every commit by default); :meth:`start` brings it back on the same
    port and data."""

    def __init__(self, folder: Path) -> None:
        self.root = folder / "mariadb"
        self.data = self.root / "data"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return all(shutil.which(name) for name in ("mariadbd", "mariadb-install-db"))

    def __enter__(self) -> MariaDBServer:
        self.root.mkdir(parents=True)
        subprocess.run(
            [
                "mariadb-install-db",
                "--no-defaults",
                f"--datadir={self.data}",
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            check=True,
            capture_output=True,
            timeout=90,
        )
        self.start()
        import pymysql

        conn = pymysql.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=5)
        try:
            conn.cursor().execute("CREATE DATABASE IF NOT EXISTS test")
        finally:
            conn.close()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.crash()
        shutil.rmtree(self.root, ignore_errors=True)

    def start(self) -> None:
        args = [
            shutil.which("mariadbd") or "mariadbd",
            "--no-defaults",
            f"--datadir={self.data}",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            f"--socket={self.root / 'mariadb.sock'}",
            f"--pid-file={self.root / 'mariadb.pid'}",
            f"--log-error={self.root / 'mariadb.log'}",
            "--user=root",
            "--skip-grant-tables",
            "--innodb-buffer-pool-size=32M",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_until(lambda: port_open(self.port), 60):
            raise RuntimeError(f"mariadbd on port {self.port} did not start")

    def crash(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


def _pg_bin() -> str | None:
    root = Path("/usr/lib/postgresql")
    if not root.is_dir():
        return None
    versions = sorted(root.iterdir(), key=lambda p: p.name)
    for version in reversed(versions):
        if (version / "bin" / "initdb").exists():
            return str(version / "bin")
    return None


class RabbitServer:
    """A RabbitMQ node of the harness's own: its own node name
    (``anarchon-faults-<random>@localhost``), AMQP and distribution ports
    (spare, on 127.0.0.1), data, log and plugin folders under a temporary
    folder, no plugins, and its own Erlang cookie (``HOME`` is that folder),
    so no command of the harness can reach another node: the machine's
    shared node (``rabbit@localhost`` on 5672) is never stopped, restarted
    or reset by it. It gets the vhost ``vhost`` with ``guest`` allowed.

    :meth:`crash` kills the node's process group with SIGKILL; :meth:`start`
    boots it again on the same ports and data. Leaving the context kills it
    and removes the folder.

    Raises:
        RuntimeError: the node did not come up within ``boot_timeout``
            seconds (its log's tail is in the message).
    """

    def __init__(self, vhost: str, *, boot_timeout: float = 90.0) -> None:
        self.vhost = vhost
        self.node = f"anarchon-faults-{uuid.uuid4().hex[:8]}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        self.boot_timeout = boot_timeout
        self.sbin = _rabbit_sbin()
        self.root = Path(tempfile.mkdtemp(prefix="anarchon-faults-rabbit-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return _rabbit_sbin() is not None

    def env(self) -> dict[str, str]:
        """The environment of the node and of its ``rabbitmqctl``: every
        location and port its own, the system's rabbitmq-env.conf and
        rabbitmq.conf (which name the shared node) replaced by empty ones."""
        root = str(self.root)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(
            HOME=root,
            RABBITMQ_CONF_ENV_FILE=f"{root}/rabbitmq-env.conf",
            RABBITMQ_CONFIG_FILE=f"{root}/rabbitmq.conf",
            RABBITMQ_ADVANCED_CONFIG_FILE=f"{root}/advanced.config",
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=f"{root}/mnesia",
            RABBITMQ_LOG_BASE=f"{root}/log",
            RABBITMQ_PID_FILE=f"{root}/rabbit.pid",
            RABBITMQ_ENABLED_PLUGINS_FILE=f"{root}/enabled_plugins",
            RABBITMQ_PLUGINS_EXPAND_DIR=f"{root}/plugins-expand",
            RABBITMQ_FEATURE_FLAGS_FILE=f"{root}/feature_flags",
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
            ERL_EPMD_ADDRESS="127.0.0.1",
        )
        return env

    def __enter__(self) -> RabbitServer:
        for name, text in (
            ("rabbitmq-env.conf", ""),
            # The node makes its default vhost and user (guest, every
            # permission there) at first boot: no rabbitmqctl round trip
            # (each starts an Erlang VM: seconds on a loaded machine).
            ("rabbitmq.conf", f"default_vhost = {self.vhost}\n"),
            ("advanced.config", "[].\n"),
            ("enabled_plugins", "[].\n"),
        ):
            (self.root / name).write_text(text)
        try:
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.crash()
        shutil.rmtree(self.root, ignore_errors=True)

    def start(self) -> None:
        """Boot the node; return once it accepts AMQP connections and its
        boot has completed (``rabbitmqctl await_startup``)."""
        assert self.sbin is not None
        log = open(self.root / "server.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [f"{self.sbin}/rabbitmq-server"],
            env=self.env(),
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: crash() kills the node's only
        )
        log.close()
        proc = self.proc
        up = wait_until(
            lambda: proc.poll() is not None or (port_open(self.port) and self._login()),
            self.boot_timeout,
            interval=0.2,
        )
        if not up or proc.poll() is not None:
            self.crash()
            raise RuntimeError(f"RabbitMQ node {self.node} did not start: {self._log_tail()}")

    def _login(self) -> bool:
        """True when guest can open a channel on the vhost (the node's boot
        has got as far as serving it)."""
        import amqp

        try:
            conn = amqp.Connection(
                f"127.0.0.1:{self.port}", virtual_host=self.vhost, connect_timeout=2
            )
            conn.connect()
            conn.channel().close()
            conn.close()
            return True
        except Exception:
            return False

    def crash(self) -> None:
        """SIGKILL the node (its whole process group: the start script and
        the Erlang VM), and wait for it to be gone."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        wait_until(lambda: not _group_alive(proc.pid), 15)

    def ctl(self, *args: str) -> str:
        """``rabbitmqctl -n <this node> args``; its output. Raises
        :class:`subprocess.CalledProcessError` when it fails."""
        assert self.sbin is not None
        out = subprocess.run(
            [f"{self.sbin}/rabbitmqctl", "-n", self.node, "-q", *args],
            env=self.env(),
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=self.boot_timeout + 30,
            check=True,
        )
        return out.stdout

    def _log_tail(self, chars: int = 800) -> str:
        found = []
        for path in [self.root / "server.log", *sorted((self.root / "log").glob("*.log"))]:
            with contextlib.suppress(OSError):
                found.append(path.read_text(errors="replace")[-chars:])
        return " | ".join(found) or "no log"


def _group_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` lives (zombies included)."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _rabbit_sbin() -> str | None:
    """The folder of RabbitMQ's own start scripts (not Debian's wrapper in
    /usr/sbin, which runs them as the ``rabbitmq`` user with the system's
    settings), newest version first."""
    found = sorted(glob.glob("/usr/lib/rabbitmq/lib/rabbitmq_server-*/sbin/rabbitmq-server"))
    return str(Path(found[-1]).parent) if found else None
