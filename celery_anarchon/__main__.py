"""``python -m celery_anarchon``: the demo and other entry points."""

from __future__ import annotations

from .demo import main

if __name__ == "__main__":
    main()
