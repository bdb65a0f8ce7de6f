"""The Celery app the demo runs (``python -m celery_anarchon demo``).

Needs no server: the broker is kombu's ``filesystem://`` transport in the
demo's folder (``ANARCHON_DEMO_DIR``), and claims go to the embedded default,
a SQLite file beside beat's schedule file (every beat runs in that folder).
The task appends one line per execution to ``executions.log`` there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from celery import Celery

DEMO_DIR = Path(os.environ.get("ANARCHON_DEMO_DIR", "anarchon-demo")).resolve()
BROKER_DIR = DEMO_DIR / "broker"
BROKER_DIR.mkdir(parents=True, exist_ok=True)

app = Celery("anarchon_demo")
app.conf.update(
    broker_url="filesystem://",
    broker_transport_options={
        "data_folder_in": str(BROKER_DIR),
        "data_folder_out": str(BROKER_DIR),
        "control_folder": str(BROKER_DIR),
    },
    task_ignore_result=True,
    worker_enable_remote_control=False,
    worker_hijack_root_logger=False,
    beat_max_loop_interval=1,
    timezone="UTC",
    anarchon_history_size=1000,
    # A first start sends the slots of the last max_late seconds (docs/scheduling.md,
    # "Start-up"); a short one keeps that backlog small in a 20 s demo.
    anarchon_max_late=10,
    beat_schedule={
        "every-second": {"task": "demo.record", "schedule": 1.0},
        "cron-every-5s": {"task": "demo.record", "schedule": "* * * * * */5"},
    },
)


@app.task(name="demo.record", bind=True)
def record(self: Any) -> None:
    """Append ``{job, slot, task_id}`` of this execution to executions.log."""
    line = json.dumps(
        {
            "job": self.request.get("anarchon_job"),
            "slot": self.request.get("anarchon_slot"),
            "task_id": self.request.id,
        }
    )
    with open(DEMO_DIR / "executions.log", "a", encoding="utf-8") as log:
        log.write(line + "\n")
