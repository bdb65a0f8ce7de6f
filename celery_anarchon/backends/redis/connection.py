"""Connecting the Redis backend: URLs (plain, TLS, Sentinel), the server checks
at open (version, eviction policy), running scripts in pipelines, and Redis
errors as BackendUnavailable."""

from __future__ import annotations

import difflib
import inspect
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoScriptError,
    RedisError,
    ResponseError,
)
from redis.retry import Retry
from redis.sentinel import Sentinel

from ...exceptions import BackendUnavailable, ConfigurationError
from ...times import option_seconds
from .. import sanitize_url
from .naming import RedisNaming
from .scripts import SCRIPTS, _Call, _Script

logger = logging.getLogger(__name__)


#: Oldest Redis the scripts run on (``SET .. PXAT`` and ``KEEPTTL``).
MIN_REDIS = (6, 2)


#: Default Sentinel port.
SENTINEL_PORT = 26379


#: A client: a plain (or Sentinel-managed) Redis, or a cluster.
_Client = redis.Redis | RedisCluster


_TRUE = {"1", "true", "yes", "on"}


_FALSE = {"0", "false", "no", "off", ""}


def _memory_configs(client: _Client) -> list[tuple[str, dict[str, Any]]]:
    """``CONFIG GET maxmemory*`` of the server (named ``""``), or of every
    cluster primary (named ``host:port``)."""
    if isinstance(client, RedisCluster):
        nodes = client.config_get("maxmemory*", target_nodes=RedisCluster.PRIMARIES)
        return list(cast("dict[str, dict[str, Any]]", nodes).items())
    return [("", cast("dict[str, Any]", client.config_get("maxmemory*")))]


def _pipeline(client: _Client, calls: Sequence[_Call]) -> list[Any]:
    """The calls' replies, an error reply as its exception. One call goes
    out as a plain command: a pipeline object costs a single claim about a
    third of its client time."""
    if len(calls) == 1:
        script, keys, args = calls[0]
        try:
            return [client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)]
        except ResponseError as exc:  # an error reply (NOSCRIPT, OOM, ...), as a pipeline gives it
            return [exc]
    with client.pipeline(transaction=False) as pipe:
        for script, keys, args in calls:
            # execute_command, not evalsha(): a cluster pipeline blocks the
            # latter but routes EVALSHA by its first key.
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        replies: list[Any] = pipe.execute(raise_on_error=False)
    return replies


def _wrong_type(error: Exception) -> bool:
    """True for Redis's ``WRONGTYPE`` reply: one key holds a value of another
    kind (not ours), a fault of that key, not of the server."""
    return isinstance(error, ResponseError) and "WRONGTYPE" in str(error)


def _one_reconnect() -> Retry:
    """Retry once, at once, on a connection error, never on a timeout.

    redis-py's pool already replaces a connection the server closed before
    it is used; this covers one that breaks while in use. A server that is
    down still fails fast (two refused connects), and a frozen one after one
    ``socket_timeout``. Re-running a script whose reply was lost is safe: a
    claim then answers ``taken`` (lost, never a duplicate)."""
    return Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))


def _seconds(value: float | str) -> float:
    """``socket_timeout`` (:func:`~celery_anarchon.times.option_seconds`)."""
    return option_seconds("socket_timeout", value)


def _flag(name: str, value: bool | str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ConfigurationError(
        f"anarchon_backend_options: {name} must be true or false, got {value!r}."
    )


def _is_sentinel(url: str) -> bool:
    return urlsplit(url).scheme.lower() in {"sentinel", "redis+sentinel"}


def _sentinel_parts(url: str) -> tuple[list[tuple[str, int]], int, str | None, str | None]:
    """Sentinel hosts, db, user name and password from a Sentinel URL.

    Accepts ``redis+sentinel://[:pw@]h1:26379,h2:26379/0`` and kombu's
    ``sentinel://[:pw@]h1:26379/0;sentinel://h2:26379``; credentials and db
    come from the first part that has them.

    Raises:
        ConfigurationError: a part without a host, or a bad port or db.
    """
    hosts: list[tuple[str, int]] = []
    db, username, password = 0, None, None
    try:
        for part in url.split(";"):
            split = urlsplit(part.strip())
            userinfo, _, hostlist = split.netloc.rpartition("@")
            if userinfo and password is None:
                user, _, secret = userinfo.partition(":")
                username, password = unquote(user) or None, unquote(secret) or None
            path = split.path.strip("/")
            if path and db == 0:
                db = int(path)
            for host in hostlist.split(","):
                one = urlsplit("//" + host)
                if not one.hostname:
                    raise ValueError(f"no host in {host!r}")
                hosts.append((one.hostname, one.port or SENTINEL_PORT))
    except ValueError as exc:
        raise ConfigurationError(
            f"anarchon_backend {sanitize_url(url)!r}: not a Sentinel URL ({exc}); use "
            "redis+sentinel://host:26379,host2:26379/0 or "
            "sentinel://host:26379;sentinel://host2:26379."
        ) from exc
    return hosts, db, username, password


def _connection_arguments(pool: redis.ConnectionPool) -> frozenset[str]:
    """The keyword arguments ``pool`` passes its connections can take (and
    the pool's own, such as ``max_connections``): the names redis-py accepts
    as URL query parameters."""
    names = set(URL_QUERY_ARGUMENT_PARSERS)
    for cls in (*pool.connection_class.__mro__, type(pool)):
        init = cls.__dict__.get("__init__")
        if init is None or init is object.__init__:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):  # a C-level __init__: nothing to read
            continue
        names |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(names - {"self", "connection_class"})


class RedisConnection(RedisNaming):
    """The client of a Redis backend (the user's, or made from the URL), and the one path every
    script call takes."""

    #: seconds to wait for connecting and for each reply
    socket_timeout: float
    master_name: str | None
    allow_eviction: bool
    _url: str | None
    #: whether close() closes the client (False for a user's client)
    _owns_client: bool
    _client: _Client | None
    _sentinel: Sentinel | None

    def open(self) -> None:
        """Connect, check the eviction policy and load the scripts.

        Idempotent. Raises:
            BackendUnavailable: Redis cannot be reached in ``socket_timeout``.
            ConfigurationError: authentication is refused, Redis is older
                than 6.2, or ``maxmemory``
                is set with a policy other than ``noeviction`` and
                ``allow_eviction`` is off.
        """
        if self._client is None:
            self._client = self._connect()
        client = self._client
        try:
            self._check_version(client)
            self._check_eviction(client)
            self._load_scripts(client)
        except (AuthenticationError, AuthorizationError) as exc:
            raise ConfigurationError(
                f"anarchon_backend: Redis at {self.describe()} refused the credentials "
                f"({exc}); fix the user name or password in the URL."
            ) from exc
        except RedisError as exc:
            raise self._unavailable("open", exc) from exc
        self._measure_clock_offset()
        logger.info("anarchon: Redis %s ready: %s", self.role, self.describe())

    def close(self) -> None:
        """Close the connections this backend opened; a user's client is left
        open. Safe to call twice."""
        client, self._client = self._client, None
        if not self._owns_client:
            self._client = client
            return
        if client is not None:
            client.close()
        if self._sentinel is not None:
            for sentinel in self._sentinel.sentinels:
                sentinel.close()
            self._sentinel = None

    def describe(self) -> str:
        """``RedisBackend <url, password masked> prefix=...``."""
        where = sanitize_url(self._url) if self._url else "(user's client)"
        return f"RedisBackend {where} prefix={self.prefix!r}"

    def request_timeout_s(self) -> float:
        """``socket_timeout``: how long the client waits for a reply, seconds."""
        return self.socket_timeout

    def now_ms(self) -> int:
        """The Redis server's clock (``TIME``), epoch ms.

        Raises:
            BackendUnavailable: no answer.
        """
        with self._translated("TIME"):
            seconds, micros = self._require_client().time()
        return int(seconds) * 1000 + int(micros) // 1000

    def _call(self, call: _Call) -> Any:
        """Run one script; its error reply raises BackendUnavailable."""
        [reply] = self._run([call])
        if isinstance(reply, Exception):
            raise self._unavailable(call[0].name, reply) from reply
        return reply

    def _run(self, calls: Sequence[_Call]) -> list[Any]:
        """Run scripts in one pipeline (``EVALSHA``, no transaction; a single
        call without one) and return their replies in order, an error reply
        as its exception.
        Scripts Redis lost (``NOSCRIPT``, e.g. after a restart) are loaded
        and those calls run again: they did not run the first time."""
        client = self._require_client()
        with self._translated(calls[0][0].name):
            replies = _pipeline(client, calls)
            again = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if again:
                self._load_scripts(client, {calls[i][0] for i in again})
                for i, reply in zip(
                    again, _pipeline(client, [calls[i] for i in again]), strict=True
                ):
                    replies[i] = reply
        return replies

    def _load_scripts(self, client: _Client, scripts: Iterable[_Script] = SCRIPTS) -> None:
        # One call per script, not a pipeline: a cluster client refuses to
        # pipeline SCRIPT LOAD, and sends each to every primary.
        for script in scripts:
            client.script_load(script.source)

    @contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        try:
            yield
        except RedisError as exc:
            raise self._unavailable(what, exc) from exc

    def _unavailable(self, what: str, exc: BaseException) -> BackendUnavailable:
        return BackendUnavailable(f"Redis {what} failed on {self.describe()}: {exc}")

    def _require_client(self) -> _Client:
        if self._client is None:
            self.open()
        assert self._client is not None
        return self._client

    def _check_url(self, url: str) -> None:
        if _is_sentinel(url):
            if not self.master_name:
                raise ConfigurationError(
                    f"anarchon_backend {sanitize_url(url)!r}: a Sentinel URL needs the "
                    "master_name option (anarchon_backend_options={'master_name': "
                    "'mymaster'} or ?master_name=mymaster)."
                )
            _sentinel_parts(url)
            return
        try:
            # Builds a connection object (no socket) so that a query
            # parameter redis-py does not know fails here, not in a tick.
            pool = redis.ConnectionPool.from_url(url)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"anarchon_backend {sanitize_url(url)!r}: {exc}.") from exc
        self._refuse_unknown_query(url, _connection_arguments(pool))
        try:
            pool.connection_class(**pool.connection_kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"anarchon_backend {sanitize_url(url)!r}: {exc}. Query parameters other than "
                f"{', '.join(sorted(self.options))} go to redis-py's connection as is."
            ) from exc

    def _refuse_unknown_query(self, url: str, accepted: frozenset[str]) -> None:
        """Refuse URL query parameters that are neither this backend's
        options nor redis-py connection arguments, with a "did you mean"."""
        names = {key for key, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)}
        unknown = sorted(names - accepted - self.options)
        if not unknown:
            return
        close = difflib.get_close_matches(unknown[0], sorted(accepted | self.options), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(
            f"anarchon_backend {sanitize_url(url)!r}: unknown URL query parameter(s) "
            f"{', '.join(unknown)}.{hint} The query takes this backend's options "
            f"({', '.join(sorted(self.options))}) and redis-py's connection arguments "
            "(socket_connect_timeout, health_check_interval, ssl_ca_certs, ...)."
        )

    def _connect(self) -> redis.Redis:
        assert self._url is not None
        timeouts: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_timeout,
            "retry": _one_reconnect(),
            "decode_responses": True,
        }
        if not _is_sentinel(self._url):
            return redis.Redis.from_url(self._url, **timeouts)
        hosts, db, username, password = _sentinel_parts(self._url)
        self._sentinel = Sentinel(
            hosts,
            sentinel_kwargs={
                "socket_timeout": self.socket_timeout,
                "socket_connect_timeout": self.socket_timeout,
                "retry": _one_reconnect(),
            },
        )
        assert self.master_name is not None
        client: redis.Redis = self._sentinel.master_for(
            self.master_name, db=db, username=username, password=password, **timeouts
        )
        return client

    def _check_version(self, client: _Client) -> None:
        """Refuse a Redis older than 6.2 (the scripts use ``SET .. PXAT``)."""
        if isinstance(client, RedisCluster):
            return  # redis-py answers INFO per node there; cluster needs 7 anyway
        version = str(client.info("server").get("redis_version", "0"))
        if tuple(int(p) for p in re.findall(r"\d+", version)[:2]) < MIN_REDIS:
            raise ConfigurationError(
                f"anarchon_backend: Redis at {self.describe()} is version {version}; "
                "the claim scripts need Redis 6.2 or later."
            )

    def _check_eviction(self, client: _Client) -> None:
        """Refuse a Redis that may evict claim keys (see class docstring);
        with a cluster client, every primary is checked."""
        try:
            configs = _memory_configs(client)
        except (AuthenticationError, AuthorizationError, redis.ConnectionError):
            raise
        except ResponseError as exc:
            logger.warning(
                "anarchon: could not verify the eviction policy of %s (CONFIG GET "
                "refused: %s). If maxmemory is set with a policy other than "
                "noeviction, Redis can evict claim keys and a slot can run twice.",
                self.describe(),
                exc,
            )
            return
        for where, config in configs:
            self._refuse_eviction(where, config)

    def _refuse_eviction(self, where: str, config: dict[str, Any]) -> None:
        maxmemory = int(config.get("maxmemory") or 0)
        policy = config.get("maxmemory-policy")
        if maxmemory == 0 or policy in (None, "noeviction"):
            return
        node = f" (node {where})" if where else ""
        message = (
            f"Redis at {self.describe()}{node} has maxmemory {maxmemory} with "
            f"maxmemory-policy {policy}: it can evict claim keys ('volatile-*' "
            "policies evict exactly the keys that have an expiry, as claim keys do), "
            "and an evicted claim lets a second instance run the same slot."
        )
        if not self.allow_eviction:
            raise ConfigurationError(
                f"{message} Set maxmemory-policy noeviction (or use a Redis of its own), "
                "or accept duplicates with anarchon_allow_eviction = True."
            )
        logger.warning("anarchon: %s Accepted because anarchon_allow_eviction is set.", message)
