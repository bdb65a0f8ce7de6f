"""Claim backends, chosen by URL scheme.

The table below maps each scheme to ``"module:Class"``; a backend's module is
imported only when its scheme is used, so a missing optional driver only
matters to those who pick that backend.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from kombu.utils.url import maybe_sanitize_url

from ..exceptions import ConfigurationError
from .base import Backend

if TYPE_CHECKING:
    from ..settings import Settings

__all__ = [
    "BACKENDS",
    "SCHEMES",
    "Backend",
    "Scheme",
    "backend_from_settings",
    "backend_from_url",
    "sanitize_url",
    "scheme_of",
]


@dataclass(frozen=True)
class Scheme:
    """What one URL scheme names.

    Attributes:
        target: the backend class, ``"module:Class"`` relative to this
            package, imported only when the scheme is used.
        driver: the Python package the scheme needs besides the backend's
            own imports (SQLAlchemy imports a database driver only when it
            connects, so it is checked up front for a clear start-up
            error), or None.
        sqlalchemy: SQL schemes only: the SQLAlchemy driver name the URL is
            given (``postgres://`` becomes ``postgresql+psycopg://``).
    """

    target: str
    driver: str | None = None
    sqlalchemy: str | None = None


_SQL = "sql:SQLBackend"
_REDIS = "redis:RedisBackend"
_RABBITMQ = "rabbitmq:RabbitMQBackend"

#: Every URL scheme a backend serves: the one table of them.
SCHEMES: dict[str, Scheme] = {
    "sqlite": Scheme(_SQL, None, "sqlite"),
    "postgresql": Scheme(_SQL, "psycopg", "postgresql+psycopg"),
    "postgresql+psycopg": Scheme(_SQL, "psycopg", "postgresql+psycopg"),
    "postgres": Scheme(_SQL, "psycopg", "postgresql+psycopg"),
    "mysql": Scheme(_SQL, "pymysql", "mysql+pymysql"),
    "mysql+pymysql": Scheme(_SQL, "pymysql", "mysql+pymysql"),
    "mariadb": Scheme(_SQL, "pymysql", "mysql+pymysql"),
    "mariadb+pymysql": Scheme(_SQL, "pymysql", "mysql+pymysql"),
    "redis": Scheme(_REDIS),
    "rediss": Scheme(_REDIS),
    "redis+sentinel": Scheme(_REDIS),
    "sentinel": Scheme(_REDIS),
    "amqp": Scheme(_RABBITMQ),
    "amqps": Scheme(_RABBITMQ),
    "pyamqp": Scheme(_RABBITMQ),
}

#: URL scheme -> ``"module:Class"`` (relative to this package), from
#: :data:`SCHEMES`.
BACKENDS: dict[str, str] = {name: scheme.target for name, scheme in SCHEMES.items()}

#: Extra to install for a driver that is missing, by module name.
_EXTRAS = {"psycopg": "postgres", "pymysql": "mysql"}

#: A URL's ``user:password@`` part, wherever a URL appears in a text.
_CREDENTIALS = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^\s:/@;,]*:)[^\s@]+@")


def sanitize_url(text: str) -> str:
    """``text`` with every URL password replaced by ``**``, safe to log: the
    one masking helper, for every log line and error that shows a URL.

    ``text`` may be one URL (masked as kombu's ``sanitize_url`` does), a URL
    kombu cannot parse (several Sentinel hosts, a malformed one) or a
    message that quotes URLs; those have each ``user:password@`` part
    masked in place.
    """
    if "://" in text and not any(c in text for c in " \t\n;,"):
        try:
            return str(maybe_sanitize_url(text))
        except ValueError:
            pass
    return _CREDENTIALS.sub(r"\1**@", text)


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
    driver = SCHEMES[scheme].driver
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


def backend_from_settings(settings: Settings, *, instance: str) -> Backend:
    """Build (without connecting) the backend an app's settings name:
    ``anarchon_backend`` (or the user's client) with
    ``anarchon_backend_options``, as :func:`backend_from_url` does.

    Raises:
        ConfigurationError: as :func:`backend_from_url`.
    """
    return backend_from_url(
        settings.backend,
        instance=instance,
        options=settings.effective_backend_options(),
        client=settings.backend_client,
    )


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
