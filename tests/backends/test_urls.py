"""Backend URLs: the one table of schemes and the one masking helper."""

from __future__ import annotations

import pytest

from celery_anarchon.backends import BACKENDS, SCHEMES, sanitize_url
from celery_anarchon.backends.sql import DRIVERS


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("redis://:pw@localhost:6379/0", "redis://:**@localhost:6379/0"),
        ("postgresql://u:pw@db/test", "postgresql://u:**@db/test"),
        ("amqp://guest:guest@localhost:5672//", "amqp://guest:**@localhost:5672//"),
        # several Sentinel hosts, which kombu's sanitizer cannot parse
        (
            "redis+sentinel://:pw@h1:26379,h2:26379/0",
            "redis+sentinel://:**@h1:26379,h2:26379/0",
        ),
        (
            "sentinel://:pw@h1:26379;sentinel://:pw2@h2:26379",
            "sentinel://:**@h1:26379;sentinel://:**@h2:26379",
        ),
        # a password with an unescaped '/': kombu cannot parse the port
        ("redis://:p/w@h/0", "redis://:**@h/0"),
        # a driver's message quoting a URL
        (
            "Error 111 connecting to redis://:pw@h:6379/0. Refused.",
            "Error 111 connecting to redis://:**@h:6379/0. Refused.",
        ),
        ("sqlite:////var/lib/anarchon.db", "sqlite:////var/lib/anarchon.db"),
        ("no URL here", "no URL here"),
    ],
)
def test_every_url_password_is_masked(text: str, masked: str) -> None:
    assert sanitize_url(text) == masked


def test_sql_drivers_come_from_the_one_table_of_schemes() -> None:
    sql_schemes = {name for name, target in BACKENDS.items() if target == "sql:SQLBackend"}
    assert set(DRIVERS) == sql_schemes
    assert {name: scheme.target for name, scheme in SCHEMES.items()} == BACKENDS
    assert DRIVERS["postgres"] == "postgresql+psycopg"
    assert SCHEMES["mariadb"].driver == "pymysql"
