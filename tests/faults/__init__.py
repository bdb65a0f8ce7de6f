"""The fault campaign (issue 7): ``python -m tests.faults``, or ``pytest -m faults``.

See :mod:`tests.faults.harness` for how a run is built and read back,
:mod:`tests.faults.scenarios` for the faults, and ``docs/reliability.md`` for
the published results.
"""
