"""Reading megakernel profiles: task records, where a task's time goes, Chrome-trace JSON
(Perfetto) and a timeline PNG.

A record is one task (``task_record``): ``{"sm", "start_ns", "end_ns", "label", "node"}`` and
its phases, ``%globaltimer`` nanoseconds. Times are shifted so the launch's first task starts
at 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .codegen.layout import (
    PROF_ARMED,
    PROF_END,
    PROF_FETCHED,
    PROF_LANDED,
    PROF_READY,
    PROF_SM_NODE,
    PROF_STAGED,
    PROF_START,
)

PHASES = ("fetched_ns", "armed_ns", "ready_ns", "landed_ns", "staged_ns")
"""A task's stamps besides its start and end, in the order they happen: the producer took it
up (the previous task's slices all issued), issued the loads that may precede its events
(each into a free ring slot), found its events met; its consumers first found a ring tile's
first slice landed in shared memory (at or after they took the task: loaded before its
events, it may have landed long before), staged its output for the storer."""

GAPS = (
    ("slots_us", "fetched_ns", "armed_ns"),
    ("wait_us", "armed_ns", "ready_ns"),
    ("queued_us", "ready_ns", "start_ns"),
    ("first_slice_us", "start_ns", "landed_ns"),
    ("stream_us", "landed_ns", "staged_ns"),
    ("store_us", "staged_ns", "end_ns"),
)
"""A task's time between its stamps: its producer waiting for free ring slots for its early
loads, i.e. for the consumers to drain earlier tiles (``slots``), then for its events
(``wait``), ready but not yet taken by its consumers, which were busy with earlier tasks or
waited for the producer's hand-over (``queued``), its consumers waiting for its first slice
(``first_slice``: about 0 where it had landed before they took the task), the rest of its
slices and its compute (``stream``), its store and publication (``store``)."""


def task_record(row: Sequence[int], task: Any) -> dict[str, Any]:
    """One task's record from its raw profile row (``codegen.layout.PROF_WIDTH`` int64s) and
    its plan task (``label``, ``node``); a phase not recorded (0) is None."""
    rec: dict[str, Any] = {
        "sm": int(row[PROF_SM_NODE]) & 0xFFFFFFFF,
        "start_ns": int(row[PROF_START]),
        "end_ns": int(row[PROF_END]),
        "label": task.label,
        "node": task.node.name,
    }
    cols = (PROF_FETCHED, PROF_ARMED, PROF_READY, PROF_LANDED, PROF_STAGED)
    for key, col in zip(PHASES, cols):
        rec[key] = int(row[col]) or None
    return rec


def task_gaps(rec: dict[str, Any]) -> dict[str, float]:
    """A record's ``GAPS`` in us, those whose two stamps it has (a gap that the clock's skew
    between roles makes negative counts 0: the stamps are of different warps)."""
    out = {}
    for name, a, b in GAPS:
        if rec.get(a) is not None and rec.get(b) is not None:
            out[name] = max(rec[b] - rec[a], 0) / 1e3
    return out


def slice_summary(tasks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per node, from ``CuteGraph.profile_slices()``: its ring tasks that issued a slice and
    their slices (median a task), and the medians over its slices of the latency from issue to landing
    (``latency_us``: a slice issued before the task's events waits for them too, where its
    loads depend on them), of the time between two issues of a task (``issue_gap_us``: the
    producer waited for a free slot, i.e. for the consumers, or was elsewhere) and between two
    landings (``landed_gap_us``: the task's rate of slices; a stream that keeps up with its
    issues lands a slice every issue gap). For a node whose tiles stamp their slices' phases
    (``cutemk.codegen.profiling.PHASE_FIELDS``), also the median cycles of each phase over its
    stamped slices (``phase_cycles``) and how many there were (``phase_slices``)."""
    from .codegen.profiling import unpack_phases

    by_node: dict[str, dict[str, list[float]]] = {}
    phases: dict[str, list[dict[str, int]]] = {}
    for t in tasks:
        acc = by_node.setdefault(
            t["node"], {"slices": [], "latency": [], "issue_gap": [], "landed_gap": []}
        )
        phases.setdefault(t["node"], []).extend(unpack_phases(w) for w in t.get("phases", ()) if w)
        sl = t["slices"]
        acc["slices"].append(len(sl))
        acc["latency"] += [(b - a) / 1e3 for a, b in sl if a and b]
        for (a0, b0), (a1, b1) in zip(sl, sl[1:]):
            if a0 and a1:
                acc["issue_gap"].append((a1 - a0) / 1e3)
            if b0 and b1:
                acc["landed_gap"].append((b1 - b0) / 1e3)

    def median(v: list[float]) -> float | None:
        return round(sorted(v)[len(v) // 2], 3) if v else None

    rows = []
    for node, acc in by_node.items():
        row = {
            "node": node,
            "tasks": len(acc["slices"]),
            "slices_per_task": median(acc["slices"]),
            "latency_us": median(acc["latency"]),
            "issue_gap_us": median(acc["issue_gap"]),
            "landed_gap_us": median(acc["landed_gap"]),
        }
        stamped = phases[node]
        if stamped:
            row["phase_cycles"] = {f: median([p[f] for p in stamped]) for f in stamped[0]}
            row["phase_slices"] = len(stamped)
        rows.append(row)
    return rows


def chrome_trace(records: Sequence[dict[str, Any]], name: str = "megakernel") -> dict[str, Any]:
    """Trace-event JSON: one process (the kernel), one thread track per SM, one event per task
    (from its start to its end; its ``GAPS`` as the event's arguments)."""
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
                "args": {k: round(v, 3) for k, v in task_gaps(r).items()},
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
    since the launch's first task), the median task duration and the longest task (us, and
    its label): where a launch's time goes, read off one profiled run. With the phases: the
    first and last time one of its tasks was ready (events met), the median of each of a
    task's ``GAPS``, and the task that ended last (``last_task``, its SM and its gaps: what
    the node's tail is made of)."""
    t0 = min((r["start_ns"] for r in records), default=0)
    by_node: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_node.setdefault(r["node"], []).append(r)
    rows = []
    for node, rs in by_node.items():
        durs = sorted(r["end_ns"] - r["start_ns"] for r in rs)
        row = {
            "node": node,
            "tasks": len(rs),
            "sms": len({r["sm"] for r in rs}),
            "first_start_us": round((min(r["start_ns"] for r in rs) - t0) / 1e3, 2),
            "last_end_us": round((max(r["end_ns"] for r in rs) - t0) / 1e3, 2),
            "median_task_us": round(durs[len(durs) // 2] / 1e3, 2),
        }
        # a straggler shows beside the median (e.g. the attention range that merges the others)
        longest = max(rs, key=lambda r: r["end_ns"] - r["start_ns"])
        row["longest_task_us"] = round((longest["end_ns"] - longest["start_ns"]) / 1e3, 2)
        row["longest_task"] = longest["label"]
        ready = [r["ready_ns"] for r in rs if r.get("ready_ns") is not None]
        if ready:  # the phases (records of a kernel that stamps them)
            row["first_ready_us"] = round((min(ready) - t0) / 1e3, 2)
            row["last_ready_us"] = round((max(ready) - t0) / 1e3, 2)
            gaps: dict[str, list[float]] = {}
            for r in rs:
                for name, v in task_gaps(r).items():
                    gaps.setdefault(name, []).append(v)
            for name, _, _ in GAPS:
                if name in gaps:
                    v = sorted(gaps[name])
                    row[f"median_{name}"] = round(v[len(v) // 2], 2)
            # what the node's tail is made of: its last task to end, and that task's gaps
            last = max(rs, key=lambda r: r["end_ns"])
            row["last_task"] = last["label"]
            row["last_task_sm"] = last["sm"]
            row["last_task_gaps_us"] = {k: round(v, 2) for k, v in task_gaps(last).items()}
        rows.append(row)
    return sorted(rows, key=lambda r: r["first_start_us"])


def launch_summary(
    records: Sequence[dict[str, Any]], ctas: Sequence[dict[str, Any]], num_sms: int
) -> dict[str, float]:
    """Where one profiled launch's time goes outside and between its tasks (us), from its task
    records and its CTA records (``CuteGraph.profile_ctas``): the spread of the CTAs' entries,
    from the first entry to the first task, the task span, the SMs' busy share of it (task
    time / (SMs x span)), from the last task's end to the last CTA's roles done and to the
    last exit (the close)."""
    if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1:
        raise ValueError(f"num_sms must be a positive int (the launch's CTAs), got {num_sms!r}")
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
