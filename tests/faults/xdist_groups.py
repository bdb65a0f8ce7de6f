"""A pytest plugin (``-p tests.faults.xdist_groups`` in setup.cfg): the fault
campaign's tests run one after another on one xdist worker.

pytest-xdist's ``--dist loadgroup`` groups tests marked ``xdist_group`` by
renaming their node ids on the workers (``item._nodeid``), which pytest 9 no
longer reads, so every test ran as a group of its own and three campaign
rows (each three beats and a worker) ran at once beside the rest of the
suite on two cores. This scheduler (for ``-n N`` with the default
``--dist load``, or ``--dist loadgroup``) puts the campaign's test files in
one group by node id instead, decided where tests are scheduled, and leaves
every other test its own unit (as ``--dist load`` does); ``loadgroup``'s
default ordering sends the largest group, the campaign, out first.
"""

from __future__ import annotations

from typing import Any

import pytest

#: Test files whose tests form the group ``faults`` (node ids from the rootdir).
GROUPED = ("tests/faults/test_campaign.py", "tests/faults/test_servers.py")
GROUP = "faults"

#: The delayed tasks' fault rows: in the same group, one row at a time (a
#: group of their own beside the campaign's left the run's time as it was,
#: 17 minutes, and loaded the machine with two rows at once).
DELAYED = "tests/faults/test_delayed_faults.py"


#: The benchmarks' smoke tests: a group of their own, one at a time beside
#: the fault group. Each runs real beats and workers at full speed; five at
#: once (with ``-n 5``) stalled a PostgreSQL statement past the backend's
#: watchdog (6 s) on this 2-core machine.
BENCH = "tests/test_bench_smoke.py"
BENCH_GROUP = "bench"


def group_of(nodeid: str) -> str:
    """The scheduling unit of test ``nodeid``: :data:`GROUP` for the
    campaign's tests, :data:`GROUP` also for the delayed rows,
    :data:`BENCH_GROUP` for the benchmarks' smoke tests, an ``@name``
    suffix where xdist managed to add one, the node id itself otherwise."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.split("@")[-1]
    if nodeid.startswith(GROUPED):
        return GROUP
    if nodeid.startswith(DELAYED):
        return GROUP
    if nodeid.startswith(BENCH):
        return BENCH_GROUP
    return nodeid


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # a hook of pytest-xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    # "load" is what -n picks by default: no --dist in addopts, which would
    # break every run without xdist (-p no:xdist).
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadGroupScheduling

    class CampaignGroupScheduling(LoadGroupScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return CampaignGroupScheduling(config, log)
