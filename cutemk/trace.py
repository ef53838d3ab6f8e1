"""Exporting megakernel profiles: Chrome-trace JSON (Perfetto) and a timeline PNG.

A record is one task: ``{"sm", "start_ns", "end_ns", "label", "node"}`` with ``%globaltimer``
nanoseconds. Times are shifted so the launch's first task starts at 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def chrome_trace(records: Sequence[dict[str, Any]], name: str = "megakernel") -> dict[str, Any]:
    """Trace-event JSON: one process (the kernel), one thread track per SM, one event per task."""
    t0 = min((r["start_ns"] for r in records), default=0)
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": name}}
    ]
    for sm in sorted({r["sm"] for r in records}):
        events.append(
            {"ph": "M", "pid": 0, "tid": sm, "name": "thread_name", "args": {"name": f"SM {sm}"}}
        )
    for r in records:
        events.append(
            {
                "ph": "X",
                "pid": 0,
                "tid": r["sm"],
                "name": r["label"],
                "cat": r["node"],
                "ts": (r["start_ns"] - t0) / 1e3,
                "dur": (r["end_ns"] - r["start_ns"]) / 1e3,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def timeline_png(records: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """One row per SM, one bar per task coloured by node (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    t0 = min((r["start_ns"] for r in records), default=0)
    nodes = sorted({r["node"] for r in records})
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(nodes)}
    sms = sorted({r["sm"] for r in records})
    row = {sm: i for i, sm in enumerate(sms)}
    fig, ax = plt.subplots(figsize=(12, max(3, 0.06 * len(sms) + 1.5)))
    for r in records:
        ax.barh(
            row[r["sm"]],
            (r["end_ns"] - r["start_ns"]) / 1e3,
            left=(r["start_ns"] - t0) / 1e3,
            height=0.8,
            color=colors[r["node"]],
        )
    ax.set_xlabel("time since first task (us)")
    ax.set_ylabel("SM (row)")
    ax.set_title(title or "megakernel timeline")
    ax.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in nodes],
        labels=nodes,
        loc="upper right",
        fontsize="small",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
