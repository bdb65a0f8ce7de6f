"""The pictures of the operator pages, as inline SVG built on the server.

Every picture is a :class:`markupsafe.Markup` string made only of numbers,
fixed names and texts passed through :func:`markupsafe.escape`, so a job
name or an error text cannot become markup. Each mark has a ``<title>``
(shown on hover, read by screen readers) and a ``class`` naming its state,
which the stylesheet colours (``static/anarchon.css``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

from markupsafe import Markup, escape

from ..backends.base import RunRecord, State

__all__ = ["histogram", "lateness_chart", "lateness_s", "timeline"]


def lateness_s(record: RunRecord) -> float | None:
    """How late ``record``'s run was sent after its slot, seconds, or None
    when it was never sent (missed, skipped, lost before the send)."""
    if record.sent_at_ms is None:
        return None
    return max(record.sent_at_ms - record.slot_ms, 0) / 1000


def _short_s(value: float) -> str:
    """``0.25s``, ``12.3s``, ``3000s``: seconds for an axis label."""
    return f"{value:.0f}s" if value >= 100 else f"{value:.3g}s"


def _stamp(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _title(record: RunRecord) -> str:
    late = lateness_s(record)
    text = f"{_stamp(record.slot_ms)}: {record.state.value}"
    if late is not None:
        text += f", sent +{late:.3f}s"
    if record.error:
        text += f" ({record.error})"
    return text


def _state_class(state: State) -> str:
    return f"st-{state.value}"


def timeline(records: Sequence[RunRecord], *, width: int = 160, height: int = 24) -> Markup:
    """A job's last slots as marks, oldest left: one mark per record,
    coloured by state, its height above the baseline growing with how late
    it was sent (the top for a run never sent); ``records`` newest first,
    as history gives them.

    Args:
        records: the records to draw, newest first.
        width, height: the picture's size, CSS pixels.
    """
    shown = list(reversed(records))
    parts = [
        f'<svg class="timeline" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="last {len(shown)} slots">'
    ]
    if not shown:
        parts.append(f'<text x="2" y="{height - 8}" class="empty">no runs yet</text>')
    else:
        late = [lateness_s(r) for r in shown]
        top = max([v for v in late if v is not None] + [1.0])
        step = width / max(len(shown), 1)
        for i, (record, value) in enumerate(zip(shown, late, strict=True)):
            share = 1.0 if value is None else value / top
            y = 4 + (height - 8) * (1 - share)
            x = i * step + step / 2
            parts.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" '
                f'class="mark {_state_class(record.state)}">'
                f"<title>{escape(_title(record))}</title></circle>"
            )
    parts.append("</svg>")
    return Markup("".join(parts))


def lateness_chart(records: Sequence[RunRecord], *, width: int = 640, height: int = 200) -> Markup:
    """Lateness over time: one point per record at its slot (x) and how
    late it was sent (y, seconds); a run never sent is drawn on the top
    edge. ``records`` in any order."""
    pad = 40
    parts = [
        f'<svg class="chart" id="lateness-chart" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="lateness over time">'
    ]
    if not records:
        parts.append(f'<text x="{pad}" y="{height / 2}" class="empty">no runs yet</text></svg>')
        return Markup("".join(parts))
    first = min(r.slot_ms for r in records)
    last = max(r.slot_ms for r in records)
    span = max(last - first, 1)
    values = [lateness_s(r) for r in records]
    top = max([v for v in values if v is not None] + [0.001])
    inner_w, inner_h = width - 2 * pad, height - 2 * pad
    parts.append(
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        'class="axis"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" class="axis"/>'
        f'<text x="2" y="{pad + 4}" class="label">{_short_s(top)}</text>'
        f'<text x="2" y="{height - pad}" class="label">0s</text>'
        f'<text x="{pad}" y="{height - pad + 16}" class="label">{_stamp(first)}</text>'
        f'<text x="{width - pad}" y="{height - pad + 16}" class="label" '
        f'text-anchor="end">{_stamp(last)}</text>'
    )
    for record, value in zip(records, values, strict=True):
        x = pad + inner_w * (record.slot_ms - first) / span
        y = pad - 6 if value is None else pad + inner_h * (1 - value / top)
        parts.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" class="mark {_state_class(record.state)}">'
            f"<title>{escape(_title(record))}</title></circle>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def histogram(
    counts: Sequence[int],
    labels: Sequence[str],
    *,
    element_id: str,
    width: int = 640,
    height: int = 160,
) -> Markup:
    """Bars of ``counts`` with one label per bar (shown under each bar
    when the labels fit, else under the first, middle and last, and in
    each bar's ``<title>``).

    Args:
        counts: one count per bin.
        labels: one text per bin (escaped).
        element_id: the ``id`` of the ``<svg>`` element.
        width, height: the picture's size, CSS pixels.
    """
    pad = 24
    parts = [
        f'<svg class="chart" id="{escape(element_id)}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="histogram">'
    ]
    top = max([*counts, 1])
    step = (width - 2 * pad) / max(len(counts), 1)
    for i, (value, label) in enumerate(zip(counts, labels, strict=True)):
        bar = (height - 2 * pad) * value / top
        x = pad + i * step
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{height - pad - bar:.1f}" width="{max(step - 2, 1):.1f}" '
            f'height="{bar:.1f}" class="bar"><title>{escape(label)}: {value}</title></rect>'
        )
        if value:
            parts.append(
                f'<text x="{x + step / 2:.1f}" y="{height - pad - bar - 2:.1f}" class="label" '
                f'text-anchor="middle">{value}</text>'
            )
    # Every bar's label under it when they fit (10 px text: about 6.5 px a
    # character), else the first, middle and last.
    if labels and step >= 6.5 * max(len(label) for label in labels):
        for i, label in enumerate(labels):
            parts.append(
                f'<text x="{pad + i * step + step / 2:.1f}" y="{height - 6}" class="label" '
                f'text-anchor="middle">{escape(label)}</text>'
            )
    else:
        for i in sorted({0, len(labels) // 2, len(labels) - 1}):
            if 0 <= i < len(labels):
                parts.append(
                    f'<text x="{pad + i * step:.1f}" y="{height - 6}" class="label">'
                    f"{escape(labels[i])}</text>"
                )
    parts.append("</svg>")
    return Markup("".join(parts))
