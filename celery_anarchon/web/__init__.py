"""The operator web page (``celery -A proj anarchon web``, docs/web.md).

Needs the ``web`` extra (``pip install 'celery-anarchon[web]'``): Flask for
the app, waitress to serve it from the command. Importing this package
imports neither; :func:`create_app` (from :mod:`celery_anarchon.web.app`)
does, with a message naming the extra when it is missing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def create_app(celery_app: Any, **options: Any) -> Any:
    """:func:`celery_anarchon.web.app.create_app`: the operator web app
    (a Flask WSGI app) for ``celery_app``.

    Raises:
        ConfigurationError: the ``web`` extra is not installed, or as
            :func:`celery_anarchon.web.app.create_app`.
    """
    from .app import create_app as create

    return create(celery_app, **options)
