"""The live-instance registry: this instance's heartbeat, its peers, their
rendezvous order, and definition drift.

Each instance registers itself every :data:`HEARTBEAT_INTERVAL` seconds
with its schedule's fingerprint (:func:`schedule_fingerprint`, the one hash
of the schedule, which ``celery anarchon status`` compares too) and reads
the others. A slot's rendezvous order over the live instances picks the one
that claims it at once (:meth:`Registry.claim_delay_ms`) and staggers the
backups' take-over checks (:mod:`.takeover`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._version import __version__
from ..backends.base import InstanceInfo
from ..exceptions import BackendUnavailable, ConfigurationError
from ..model import Job
from ..times import ms as _ms
from ..times import seconds
from .link import BackendLink

__all__ = [
    "HAND_OVER_MARGIN",
    "HEARTBEAT_INTERVAL",
    "PEER_STALE",
    "REGISTRY_TTL",
    "Registry",
    "new_instance_id",
    "registry_ttl",
    "schedule_fingerprint",
]

logger = logging.getLogger(__name__)

#: Registry heartbeat period and default time-to-live, seconds (the TTL is
#: the ``anarchon_registry_ttl`` setting, see :func:`registry_ttl`).
HEARTBEAT_INTERVAL = 5.0
REGISTRY_TTL = 30.0

#: A peer whose last heartbeat is this much older than the newest one in the
#: registry counts as dead (for rendezvous ranks and take-over checks) before
#: the registry drops it, seconds.
PEER_STALE = 2 * HEARTBEAT_INTERVAL

#: Least time left before ``max_late`` for a claim released on shutdown,
#: seconds: the other instances see this one leave the registry at their
#: next heartbeat (one period), then take the slot in a tick (another
#: period's margin for a loaded machine).
HAND_OVER_MARGIN = 2 * HEARTBEAT_INTERVAL

#: A peer still on an older stored-jobs version this long after the newer
#: one committed is warned about, milliseconds (every instance applies a
#: change within a second; heartbeats come every HEARTBEAT_INTERVAL).
STORED_LAG_MS = 3000

#: Most time a heartbeat gives the backend's deferred upkeep, seconds.
HOUSEKEEPING_BUDGET = 0.5


def new_instance_id() -> str:
    """``host:pid:random``, unique per scheduler process."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def registry_ttl(conf: Any) -> float:
    """``anarchon_registry_ttl``, seconds (default :data:`REGISTRY_TTL`): an
    instance killed without a graceful shutdown drops out of the registry
    this long after its last heartbeat.

    Raises:
        ConfigurationError: not a duration, or below two heartbeat periods
            (a live instance would blink out between heartbeats).
    """
    value = conf.get("anarchon_registry_ttl")
    ttl = REGISTRY_TTL if value is None else seconds(value, setting="anarchon_registry_ttl")
    if ttl < 2 * HEARTBEAT_INTERVAL:
        raise ConfigurationError(
            f"anarchon_registry_ttl ({ttl:g}s) must be at least {2 * HEARTBEAT_INTERVAL:g}s, "
            f"two heartbeat periods of {HEARTBEAT_INTERVAL:g}s; raise it."
        )
    return ttl


def schedule_fingerprint(jobs: Mapping[str, Job]) -> str:
    """The fingerprint of a schedule: a hash of every job's name and
    definition, the same on every host that runs the same schedule (what
    an instance registers and ``celery anarchon status`` compares)."""
    text = "\x00".join(f"{name}={job.definition}" for name, job in sorted(jobs.items()))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def weight(instance: str, key: bytes) -> int:
    """Rendezvous weight of ``instance`` for a slot ``key``."""
    digest = hashlib.blake2b(instance.encode() + key, digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Registry:
    """This instance in the registry, and the peers it sees.

    Args:
        instance_id: this instance (:func:`new_instance_id`).
        jobs: the jobs it runs, by name.
        link: the backend.
        conf: the app's configuration (``anarchon_registry_ttl``).
        clock: seconds since the epoch.
        rng: randomness for the claim delay without a registry.
        started_ms: when this instance started, epoch ms.
        on_peer_left: called when a peer left the registry or stopped
            heartbeating (the take-over checks it backs up fall due at once).
        stored: ``(version, committed_ms)`` of the stored jobs this instance
            applies (:class:`~celery_anarchon.beat.stored.StoredJobs`).
    """

    def __init__(
        self,
        instance_id: str,
        jobs: Mapping[str, Job],
        link: BackendLink,
        conf: Any,
        clock: Callable[[], float],
        rng: random.Random,
        started_ms: int,
        on_peer_left: Callable[[], None],
        stored: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        self.instance_id = instance_id
        self._jobs = jobs
        self._link = link
        self._conf = conf
        self._clock = clock
        #: randomness of the claim delay without a registry
        self.random = rng
        self._started_ms = started_ms
        self._on_peer_left = on_peer_left
        self._stored_version = stored
        #: live instance ids (this one included), sorted
        self.peers: list[str] = []
        #: the next heartbeat is due at this clock time (seconds)
        self.next_heartbeat = 0.0
        code = {name: job for name, job in jobs.items() if job.source == "code"}
        #: the code entries' definitions (stored jobs are compared by version)
        self._definitions = {name: job.definition for name, job in code.items()}
        self.fingerprint = schedule_fingerprint(code)
        #: the fingerprint whose definitions the registry holds for us, if known
        self._stored: str | None = None
        #: (job, instance, definition) drift already warned about
        self._drift_seen: set[tuple[str, str, str]] = set()
        #: (instance, fingerprint) of peers whose definitions were compared
        self._drift_read: set[tuple[str, str]] = set()
        #: (instance, version) of peers warned about for lagging stored jobs
        self._lag_seen: set[tuple[str, int]] = set()

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    # -- rendezvous ------------------------------------------------------------

    def rank(self, job: str, slot_ms: int) -> int:
        """This instance's place in the slot's rendezvous order over the
        live peers (0 = preferred)."""
        key = f"\x00{job}\x00{slot_ms}".encode()
        mine = weight(self.instance_id, key)
        return sum(1 for peer in self.peers if weight(peer, key) > mine)

    def claim_delay_ms(self, job: Job, slot_ms: int) -> int:
        """The claim delay of ``slot_ms`` for this instance, milliseconds.

        With a registry of live instances (lease backends), the slot's
        preferred owner by rendezvous hashing claims at once and every other
        instance, a backup, after the full jitter: a burst is spread evenly
        and lateness stays near zero. When the registry shows this instance
        alone, it claims at once (a delay would only make it late). Without
        a registry (claim-only backends, or before the first heartbeat), a
        random delay in ``[0, jitter]`` per instance and slot.
        """
        jitter_ms = _ms(job.options.jitter)
        if self.peers == [self.instance_id]:
            return 0
        if len(self.peers) > 1:
            return 0 if self.rank(job.name, slot_ms) == 0 else jitter_ms
        return self.random.randint(0, jitter_ms) if jitter_ms else 0

    def peer_died(self, seen: Sequence[str]) -> bool:
        """True when a peer of ``seen`` (instance ids) has left the registry
        or stopped heartbeating (see :data:`PEER_STALE`) since."""
        live = set(self.peers)
        return any(peer not in live for peer in seen)

    # -- the heartbeat -----------------------------------------------------------

    def heartbeat(self, now: float, *, housekeep: bool) -> None:
        """Refresh this instance in the registry, read the live instances
        (for rendezvous preference) and warn about definition drift; then,
        when ``housekeep``, let the backend run its deferred upkeep.

        Args:
            now: clock seconds.
            housekeep: no slot falls due within :data:`HOUSEKEEPING_BUDGET`.
        """
        backend = self._link.backend
        assert backend is not None
        self.next_heartbeat = now + HEARTBEAT_INTERVAL
        if not self._link.leases:
            return
        info = self.instance_info()
        ttl_ms = _ms(registry_ttl(self._conf))
        try:
            # The definitions go with the first heartbeat of this schedule
            # only; later ones carry the fingerprint (constant cost per job
            # count). If the registry lost them (our entry expired), resend.
            sent = self._stored != info.fingerprint
            stored = backend.register(info if sent else _without_jobs(info), ttl_ms)
            if not stored and not sent:
                stored = backend.register(info, ttl_ms)
            self._stored = info.fingerprint if stored else None
            live = backend.instances()
        except BackendUnavailable as exc:
            self._link.on_outage(exc)
            return
        except Exception:
            logger.exception("anarchon: registry heartbeat failed")
            return
        # A peer that stopped heartbeating counts as dead before the registry
        # drops it (a beat killed with SIGKILL stays listed for registry_ttl).
        newest = max((peer.heartbeat_ms for peer in live), default=0)
        stale_ms = _ms(PEER_STALE)
        fresh = {peer.instance for peer in live if newest - peer.heartbeat_ms <= stale_ms}
        peers = sorted(fresh | {self.instance_id})
        left = bool(set(self.peers) - set(peers))
        self.peers = peers
        if left:
            self._on_peer_left()
        self._warn_drift(live)
        if housekeep:
            self._housekeep()

    def _housekeep(self) -> None:
        """Let the backend run the upkeep it left out of the claim path
        (SQL history trims), for at most :data:`HOUSEKEEPING_BUDGET` seconds."""
        assert self._link.backend is not None
        try:
            self._link.backend.housekeep(HOUSEKEEPING_BUDGET)
        except Exception:  # never let upkeep stop beat
            logger.exception("anarchon: backend housekeeping failed")

    def _warn_drift(self, live: Sequence[InstanceInfo]) -> None:
        """Warn once per job and instance whose definition differs from ours.

        A peer's definitions are read (:meth:`Backend.definitions`) only when
        its fingerprint differs from ours, and once per peer and fingerprint.
        Meanwhile each definition's slots are claimed on their own keys only
        when the slot times differ; where they agree, one claim still wins.

        Also warns of a peer's code entry that has the name of a stored
        job here (the code entry wins on the hosts that have it), and of a
        peer whose stored-jobs version lags ours more than
        :data:`STORED_LAG_MS` after our newest change committed.
        """
        self._warn_stored_lag(live)
        for other in live:
            if other.instance == self.instance_id or other.fingerprint == self.fingerprint:
                continue
            if (other.instance, other.fingerprint) in self._drift_read:
                continue
            theirs_all = other.jobs or self._peer_definitions(other.instance)
            if not theirs_all:
                continue  # not stored yet: read again at the next heartbeat
            self._drift_read.add((other.instance, other.fingerprint))
            for name, theirs in theirs_all.items():
                ours = self._definitions.get(name)
                if ours is None:
                    self._warn_collision(name, other.instance)
                    continue
                if ours == theirs:
                    continue
                seen = (name, other.instance, theirs)
                if seen not in self._drift_seen:
                    self._drift_seen.add(seen)
                    logger.warning(
                        "anarchon: job %s is defined differently on instance %s (a rolling "
                        "deploy?); slots both definitions share are still claimed once",
                        name,
                        other.instance,
                    )

    def _warn_collision(self, name: str, instance: str) -> None:
        job = self._jobs.get(name)
        seen = (name, instance, "stored")
        if job is None or job.source != "stored" or seen in self._drift_seen:
            return
        self._drift_seen.add(seen)
        logger.warning(
            "anarchon: job %s is a beat_schedule entry on instance %s and a stored job "
            "here: the code entry wins on the hosts that have it; rename or remove one",
            name,
            instance,
        )

    def _warn_stored_lag(self, live: Sequence[InstanceInfo]) -> None:
        version, committed_ms = self._stored_version()
        for other in live:
            theirs = other.stored_version
            if other.instance == self.instance_id or theirs is None or theirs >= version:
                continue
            if other.heartbeat_ms - committed_ms <= STORED_LAG_MS:
                continue  # still applying it
            if (other.instance, theirs) not in self._lag_seen:
                self._lag_seen.add((other.instance, theirs))
                logger.warning(
                    "anarchon: instance %s applies stored jobs at version %d, this one at "
                    "%d: its slots follow older definitions (a backend it cannot read?)",
                    other.instance,
                    theirs,
                    version,
                )

    def _peer_definitions(self, instance: str) -> dict[str, str]:
        """A peer's stored definitions; empty when they cannot be read."""
        assert self._link.backend is not None
        try:
            return self._link.backend.definitions(instance)
        except BackendUnavailable as exc:
            self._link.on_outage(exc)
        except Exception:
            logger.exception("anarchon: reading the definitions of %s failed", instance)
        return {}

    def instance_info(self) -> InstanceInfo:
        """This instance as the registry keeps it, with its definitions
        (``jobs``, shared with this registry: do not change it); the
        heartbeat sends them only when the registry lacks them."""
        host, pid, _ = self.instance_id.rsplit(":", 2)
        return InstanceInfo(
            instance=self.instance_id,
            host=host,
            pid=int(pid),
            version=__version__,
            started_ms=self._started_ms,
            heartbeat_ms=self._now_ms(),
            clock_ms=self._now_ms(),
            fingerprint=self.fingerprint,
            jobs=self._definitions,
            stored_version=self._stored_version()[0],
        )


def _without_jobs(info: InstanceInfo) -> InstanceInfo:
    """``info`` without its definitions: a heartbeat's payload."""
    return dataclasses.replace(info, jobs={})
