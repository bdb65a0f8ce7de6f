"""The publish floor of the burst benchmark: a process that only sends.

    python -m bench.publisher INDEX SHARES

Reads the burst benchmark's environment (``BENCH_BROKER``, ``BENCH_QUEUE``,
``BENCH_JOBS``, ``BENCH_PERIOD``, ``BENCH_FIRST``, ``BENCH_ROUNDS``,
``BENCH_READY_DIR``), writes its ready mark, and at each of ``BENCH_ROUNDS``
slots sends its share of the jobs (job ``i`` with ``i % SHARES == INDEX``)
through Celery's own ``apply_async`` with the same headers anarchon adds:
no scheduler, no claim, so the round time is what publishing alone costs
with this many processes on this broker.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .bench_app import FIRST, JOBS, PERIOD, app, job_name, noop


def main(argv: list[str]) -> int:
    index, shares = int(argv[0]), int(argv[1])
    rounds = int(os.environ.get("BENCH_ROUNDS", "1"))
    mine = [job_name(i) for i in range(JOBS) if i % shares == index]
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection(max_retries=3)
        # warm-up: declares the queue (the benchmark empties it before the slot)
        noop.apply_async(producer=producer, headers={"anarchon_job": "warm-up"})
        folder = os.environ.get("BENCH_READY_DIR")
        if folder:
            # Written under a temporary name, then renamed: the benchmark reads
            # every ready-* mark and must never see one half written.
            tmp = Path(folder, f".tmp-ready-{os.getpid()}")
            tmp.write_text(repr(time.time()))
            tmp.rename(Path(folder, f"ready-{os.getpid()}"))
        for k in range(rounds):
            slot = FIRST + k * PERIOD
            time.sleep(max(0.0, slot - time.time()))
            slot_ms = int(round(slot * 1000))
            for job in mine:
                noop.apply_async(
                    producer=producer,
                    headers={"anarchon_job": job, "anarchon_slot": slot_ms},
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
