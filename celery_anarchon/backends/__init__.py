"""Claim backends, chosen by URL scheme.

The table below maps each scheme to ``"module:Class"``; a backend's module is
imported only when its scheme is used, so a missing optional driver only
matters to those who pick that backend.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from kombu.utils.url import maybe_sanitize_url

from ..exceptions import ConfigurationError
from .base import Backend

__all__ = ["BACKENDS", "Backend", "backend_from_url", "sanitize_url", "scheme_of"]

#: URL scheme -> ``"module:Class"`` (relative to this package).
BACKENDS: dict[str, str] = {
    "sqlite": "sql:SQLBackend",
    "postgresql": "sql:SQLBackend",
    "postgresql+psycopg": "sql:SQLBackend",
    "postgres": "sql:SQLBackend",
    "mysql": "sql:SQLBackend",
    "mysql+pymysql": "sql:SQLBackend",
    "mariadb": "sql:SQLBackend",
    "mariadb+pymysql": "sql:SQLBackend",
    "redis": "redis:RedisBackend",
    "rediss": "redis:RedisBackend",
    "redis+sentinel": "redis:RedisBackend",
    "sentinel": "redis:RedisBackend",
    "amqp": "rabbitmq:RabbitMQBackend",
    "amqps": "rabbitmq:RabbitMQBackend",
    "pyamqp": "rabbitmq:RabbitMQBackend",
}

#: Extra to install for a driver that is missing, by module name.
_EXTRAS = {"psycopg": "postgres", "pymysql": "mysql"}

#: The database driver each SQL scheme needs (imported by SQLAlchemy only
#: when it connects, so checked up front for a clear start-up error).
_DRIVERS = {
    "postgresql": "psycopg",
    "postgresql+psycopg": "psycopg",
    "postgres": "psycopg",
    "mysql": "pymysql",
    "mysql+pymysql": "pymysql",
    "mariadb": "pymysql",
    "mariadb+pymysql": "pymysql",
}


def sanitize_url(url: str) -> str:
    """``url`` with its password masked, safe to log."""
    return str(maybe_sanitize_url(url))


def scheme_of(url: str) -> str:
    """The lower-cased scheme of ``url`` (``"redis"``, ``"postgresql+psycopg"``)."""
    return urlsplit(url).scheme.lower()


def backend_class(url: str) -> type[Backend]:
    """The backend class serving ``url``'s scheme.

    Raises:
        ConfigurationError: unknown scheme (with a "did you mean"), or the
            backend's driver is not installed (naming the extra to install).
    """
    scheme = scheme_of(url)
    try:
        target = BACKENDS[scheme]
    except KeyError:
        close = difflib.get_close_matches(scheme, BACKENDS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(
            f"anarchon_backend: unknown URL scheme {scheme!r} in "
            f"{sanitize_url(url)!r}.{hint} Known schemes: {', '.join(sorted(BACKENDS))}."
        ) from None
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        extra = _EXTRAS.get(missing)
        fix = f"pip install 'celery-anarchon[{extra}]'" if extra else f"pip install {missing}"
        raise ConfigurationError(
            f"anarchon_backend {sanitize_url(url)!r} needs the {missing!r} package: {fix}"
        ) from exc
    driver = _DRIVERS.get(scheme)
    if driver is not None and importlib.util.find_spec(driver) is None:
        raise ConfigurationError(
            f"anarchon_backend {sanitize_url(url)!r} needs the {driver!r} package: "
            f"pip install 'celery-anarchon[{_EXTRAS[driver]}]'"
        )
    cls: type[Backend] = getattr(module, class_name)
    return cls


def split_options(url: str) -> tuple[str, dict[str, str]]:
    """Split backend options given as URL query parameters off ``url``.

    Only keys the backend declares in ``Backend.options`` are taken; other
    query parameters (a driver's own, like ``sslmode``) stay in the URL.
    """
    cls = backend_class(url)
    parts = urlsplit(url)
    ours: dict[str, str] = {}
    kept: list[tuple[str, str]] = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in cls.options:
            ours[key] = value
        else:
            kept.append((key, value))
    # Rebuilt by hand: urlunsplit drops the empty host of sqlite:////abs/path.
    base = url.split("?", 1)[0]
    query = urlencode(kept, safe=":/;,")
    return (f"{base}?{query}" if query else base), ours


def backend_from_url(
    url: str | None,
    *,
    instance: str,
    options: dict[str, Any] | None = None,
    client: Any = None,
) -> Backend:
    """Build (without connecting) the backend for ``url`` or ``client``.

    Args:
        url: the backend URL; ignored for the scheme when ``client`` is given
            and ``url`` is None.
        instance: this scheduler's instance id (owner of its claims).
        options: backend options; URL query parameters named in the
            backend's ``options`` are merged in, explicit ``options`` win.
        client: a client the user owns (``redis.Redis``, an SQLAlchemy
            ``Engine``, a kombu ``Connection``); never closed by us.

    Raises:
        ConfigurationError: unknown scheme, missing driver, unknown option.
    """
    opts = dict(options or {})
    if url is None:
        if client is None:
            raise ConfigurationError("anarchon_backend: give a URL or a client.")
        cls = _class_for_client(client)
        return cls(None, client=client, instance=instance, **_checked(cls, opts))
    cls = backend_class(url)
    url, from_query = split_options(url)
    merged = {**from_query, **opts}
    return cls(url, client=client, instance=instance, **_checked(cls, merged))


def _checked(cls: type[Backend], options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        close = difflib.get_close_matches(unknown[0], cls.options, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(
            f"anarchon_backend_options: unknown option(s) {', '.join(unknown)} for "
            f"{cls.__name__}.{hint} It accepts {', '.join(sorted(cls.options)) or 'none'}."
        )
    return options


def _class_for_client(client: Any) -> type[Backend]:
    kind = type(client).__module__.split(".")[0]
    scheme = {"redis": "redis", "sqlalchemy": "sqlite", "kombu": "amqp", "amqp": "amqp"}.get(kind)
    if scheme is None:
        raise ConfigurationError(
            f"anarchon_backend: cannot tell which backend serves a {type(client).__name__}; "
            "pass a redis.Redis, an SQLAlchemy Engine or a kombu Connection."
        )
    return backend_class(f"{scheme}://")
