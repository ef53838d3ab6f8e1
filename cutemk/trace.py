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


def node_summary(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per node, in order of first start: tasks run, SMs used, first start and last end (us
    since the launch's first task) and the median task duration (us): where a launch's time
    goes, read off one profiled run."""
    t0 = min((r["start_ns"] for r in records), default=0)
    by_node: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_node.setdefault(r["node"], []).append(r)
    rows = []
    for node, rs in by_node.items():
        durs = sorted(r["end_ns"] - r["start_ns"] for r in rs)
        rows.append(
            {
                "node": node,
                "tasks": len(rs),
                "sms": len({r["sm"] for r in rs}),
                "first_start_us": round((min(r["start_ns"] for r in rs) - t0) / 1e3, 2),
                "last_end_us": round((max(r["end_ns"] for r in rs) - t0) / 1e3, 2),
                "median_task_us": round(durs[len(durs) // 2] / 1e3, 2),
            }
        )
    return sorted(rows, key=lambda r: r["first_start_us"])


def launch_summary(
    records: Sequence[dict[str, Any]], ctas: Sequence[dict[str, Any]], num_sms: int
) -> dict[str, float]:
    """Where one profiled launch's time goes outside and between its tasks (us), from its task
    records and its CTA records (``CuteGraph.profile_ctas``): the spread of the CTAs' entries,
    from the first entry to the first task, the task span, the SMs' busy share of it (task
    time / (SMs x span)), from the last task's end to the last CTA's roles done and to the
    last exit (the close)."""
    if not records or not ctas:
        return {}
    first_entry = min(c["entry_ns"] for c in ctas)
    start = min(r["start_ns"] for r in records)
    end = max(r["end_ns"] for r in records)
    busy = sum(r["end_ns"] - r["start_ns"] for r in records)
    span = max(end - start, 1)
    return {
        "ctas": len(ctas),
        "entry_spread_us": round((max(c["entry_ns"] for c in ctas) - first_entry) / 1e3, 2),
        "entry_to_first_task_us": round((start - first_entry) / 1e3, 2),
        "task_span_us": round(span / 1e3, 2),
        "sm_busy_share": round(busy / (num_sms * span), 3),
        "last_task_to_roles_done_us": round((max(c["roles_done_ns"] for c in ctas) - end) / 1e3, 2),
        "last_task_to_exit_us": round((max(c["exit_ns"] for c in ctas) - end) / 1e3, 2),
    }
