"""Every ```python example in README.md and docs/ runs, and does not raise.

Each block runs in a fresh namespace, in a fresh temporary folder, after
:data:`PREAMBLE`: a Celery app ``app`` on the in-memory broker whose default
claim backend is a SQLite file in that folder, with the jobs the examples
talk about. A block can therefore use ``app`` without defining it, and
building a Control or sending a ``run_now`` works without any server.

A block that cannot run here (it needs a Django project, a running service,
...) is preceded by a MyST comment giving the reason::

    <!-- docs-test: skip needs a Django project -->

Console, shell and text blocks are never executed.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Fenced blocks: the opening fence (``` or more, or :::), its info string, body.
_FENCE = re.compile(r"^(?P<indent>[ ]{0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")
_SKIP = re.compile(r"<!--\s*docs-test:\s*skip\b(?P<reason>[^>]*)-->")

#: Run before every block, in the block's own namespace.
PREAMBLE = """
from celery import Celery

app = Celery("proj", broker="memory://")
app.conf.update(
    timezone="UTC",
    beat_schedule_filename=__docs_folder__ + "/celerybeat-schedule",
    beat_schedule={
        "report": {"task": "proj.report", "schedule": "0 7 * * *"},
        "sync": {"task": "proj.sync", "schedule": 5.0},
    },
)
"""


@dataclass(frozen=True)
class Example:
    """One ```python block of a Markdown file."""

    path: Path
    line: int
    code: str
    skip: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[Path]:
    """README.md and every Markdown page under docs/ (build output excluded)."""
    pages = sorted(
        p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.relative_to(ROOT).parts
    )
    return [ROOT / "README.md", *pages]


def examples_in(path: Path) -> list[Example]:
    """The ```python blocks of ``path``, with the skip reason of each.

    A skip comment counts when it is the last non-blank line before the
    block's opening fence.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""
        ):
            body.append(lines[j])
            j += 1
        language = info.split()[0].lower() if info else ""
        if language in {"python", "py", "python3"}:
            found.append(Example(path, i + 1, "\n".join(body) + "\n", _skip_reason(lines, i)))
        i = j + 1
    return found


def _skip_reason(lines: list[str], fence_index: int) -> str | None:
    k = fence_index - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    if k < 0:
        return None
    match = _SKIP.search(lines[k])
    if match is None:
        return None
    return match["reason"].strip() or "no reason given"


ALL_EXAMPLES = [example for path in markdown_files() for example in examples_in(path)]


def test_the_docs_have_examples() -> None:
    """The extraction finds blocks (a regex that matches nothing cannot fail)."""
    assert len(ALL_EXAMPLES) >= 10
    assert any(e.path.name == "README.md" for e in ALL_EXAMPLES)


def test_skips_are_few_and_explained() -> None:
    skipped = [e for e in ALL_EXAMPLES if e.skip is not None]
    assert all(e.skip != "no reason given" for e in skipped), [e.name for e in skipped]
    assert len(skipped) <= max(3, len(ALL_EXAMPLES) // 5), [e.name for e in skipped]


def test_extraction_sees_fences_and_skip_comments(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        textwrap.dedent(
            """\
            ```console
            $ not python
            ```

            ```python
            x = 1
            ```

            <!-- docs-test: skip needs a server -->

            ```python
            y = 2
            ```
            """
        )
    )
    found = examples_in(page)
    assert [(e.line, e.code, e.skip) for e in found] == [
        (5, "x = 1\n", None),
        (11, "y = 2\n", "needs a server"),
    ]


@pytest.mark.parametrize("example", ALL_EXAMPLES, ids=[e.name for e in ALL_EXAMPLES])
def test_example_runs(example: Example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if example.skip is not None:
        pytest.skip(example.skip)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {
        "__name__": "__docs_example__",
        "__docs_folder__": os.fspath(tmp_path),
    }
    exec(compile(PREAMBLE, "<docs preamble>", "exec"), namespace)
    code = compile(example.code, example.name, "exec")
    exec(code, namespace)  # an exception fails the test, naming the page and line
