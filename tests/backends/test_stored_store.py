"""The stored-jobs store every lease backend offers: one change counter,
versions unique and in commit order under concurrent writers, the
``exists`` conditions, and tombstones that readers see."""

from __future__ import annotations

import threading
import uuid

import pytest

from celery_anarchon.backends.store import JOB, PAUSE, StoredJobsStore, StoredWrite

from ..conftest import RUN_ID, BackendFactory, require_service


@pytest.fixture(params=["sqlite", "postgresql", "mysql", "redis"])
def backend_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_service(name)
    if name == "redis":
        request.getfixturevalue("_redis_cleanup")
    else:
        request.getfixturevalue("_sql_cleanup")
    return name


@pytest.fixture
def namespace(backend_name: str) -> str:
    """A prefix of this test's own, under the run's (its clean-up finds it)."""
    tag = uuid.uuid4().hex[:6]
    return f"anarchon-test:{RUN_ID}:{tag}:" if backend_name == "redis" else f"t{RUN_ID}_{tag}_"


def store(make_backend: BackendFactory, namespace: str) -> StoredJobsStore:
    backend = make_backend(prefix=namespace)
    assert isinstance(backend, StoredJobsStore)
    return backend


def test_writes_take_the_next_version_and_readers_see_what_changed(
    make_backend: BackendFactory, namespace: str
) -> None:
    s = store(make_backend, namespace)
    assert s.stored_version() == 0
    first = s.write_stored(JOB, "a <b>", '{"x":1}', exists=False)
    assert first is not None and first.version == 1
    assert s.write_stored(JOB, "a <b>", '{"x":2}', exists=False) is None  # taken
    assert s.write_stored(JOB, "missing", '{"x":2}', exists=True) is None  # not there
    second = s.write_stored(JOB, "a <b>", '{"x":3}', exists=True)
    pause = s.write_stored(PAUSE, "a <b>", '{"paused":true}')
    assert second is not None and pause is not None
    assert (second.version, pause.version) == (2, 3)
    assert s.stored_version() == 3
    assert [(r.kind, r.body, r.version) for r in s.stored_changes(1)] == [
        (JOB, '{"x":3}', 2),
        (PAUSE, '{"paused":true}', 3),
    ]
    assert second.committed_ms <= pause.committed_ms


def test_a_removal_is_a_tombstone_readers_see(make_backend: BackendFactory, namespace: str) -> None:
    s = store(make_backend, namespace)
    s.write_stored(JOB, "gone", "{}", exists=False)
    removed = s.write_stored(JOB, "gone", None, exists=True)
    assert removed is not None
    assert s.write_stored(JOB, "gone", None, exists=True) is None  # removed already
    [tombstone] = s.stored_changes(removed.version - 1)
    assert (tombstone.name, tombstone.body) == ("gone", None)
    assert s.stored_records(["gone"], JOB) == {}
    again = s.write_stored(JOB, "gone", '{"v":2}', exists=False)  # the name is free again
    assert again is not None and s.stored_records(["gone"], JOB)["gone"].body == '{"v":2}'


def test_concurrent_writers_get_unique_versions_in_commit_order(
    make_backend: BackendFactory, namespace: str
) -> None:
    writers = [store(make_backend, namespace) for _ in range(4)]
    errors: list[BaseException] = []

    def write(s: StoredJobsStore, n: int) -> None:
        try:
            for i in range(20):
                s.write_stored(JOB, f"w{n}-{i}", "{}")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(s, n)) for n, s in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    versions = [r.version for r in writers[0].stored_changes(0)]
    assert versions == list(range(1, 81))
    assert writers[0].stored_version() == 80


def test_a_long_name_keeps_its_own_record(make_backend: BackendFactory, namespace: str) -> None:
    s = store(make_backend, namespace)
    long_a, long_b = "x" * 300 + "a", "x" * 300 + "b"
    s.write_stored(JOB, long_a, '{"n":"a"}', exists=False)
    s.write_stored(JOB, long_b, '{"n":"b"}', exists=False)
    found = s.stored_records([long_a, long_b], JOB)
    assert {n: r.body for n, r in found.items()} == {long_a: '{"n":"a"}', long_b: '{"n":"b"}'}


def test_a_record_remembers_its_earlier_writes(
    make_backend: BackendFactory, namespace: str
) -> None:
    """A reader that missed writes learns when the first of them committed."""
    s = store(make_backend, namespace)
    writes = [s.write_stored(JOB, "j", f'{{"n":{i}}}') for i in range(10)]
    writes.append(s.write_stored(JOB, "j", None))
    last = writes[-1]
    assert last is not None and last.body is None
    [read] = s.stored_changes(last.version - 1)
    expected = tuple((w.version, w.committed_ms) for w in reversed(writes[:-1]) if w)[:8]
    assert read.prior == last.prior == expected
    assert read.first_change_after(writes[7].version) == writes[8].committed_ms  # type: ignore[union-attr]
    assert read.first_change_after(last.version) == last.committed_ms


def test_several_writes_are_all_or_none(make_backend: BackendFactory, namespace: str) -> None:
    """What ``add(paused=...)`` relies on: a refused job write leaves the
    pause state it came with unwritten too."""
    s = store(make_backend, namespace)
    s.write_stored(PAUSE, "j", '{"paused":true,"note":"A"}')
    s.write_stored(JOB, "j", '{"v":"A"}', exists=False)
    version = s.stored_version()
    refused = s.write_stored_many(
        [StoredWrite(PAUSE, "j", None), StoredWrite(JOB, "j", '{"v":"B"}', exists=False)]
    )
    assert refused is None and s.stored_version() == version
    assert s.stored_records(["j"], PAUSE)["j"].body == '{"paused":true,"note":"A"}'
    both = s.write_stored_many(
        [StoredWrite(JOB, "j", None, exists=True), StoredWrite(PAUSE, "j", None)]
    )
    assert both is not None and [r.version for r in both if r] == [version + 1, version + 2]
    nothing = s.write_stored_many([StoredWrite(PAUSE, "never", None)])
    assert nothing == [None] and s.stored_version() == version + 2
