"""``celery anarchon``: operator commands (a click group under Celery's CLI).

Registered through the ``celery.commands`` entry point, so ``celery -A proj
anarchon --help`` lists the commands.
"""

from __future__ import annotations

import click

__all__ = ["anarchon"]


@click.group(name="anarchon")
@click.pass_context
def anarchon(ctx: click.Context) -> None:
    """Inspect and operate celery-anarchon: jobs, history, runs, instances."""
