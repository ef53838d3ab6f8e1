"""The host's reading of an aborted launch: the watchdog's debug record and the event counters
of the plan it ran, turned into an error that names the stuck wait (``CuteGraph`` raises it)."""

from __future__ import annotations

import numpy as np

from .codegen.lower import (
    DBG_EVENT,
    DBG_EXPECTED,
    DBG_KIND,
    DBG_SEEN,
    DBG_SM,
    DBG_TASK,
    KIND_BARRIER_WAIT,
    KIND_EVENT_WAIT,
    KIND_RANK_BARRIER,
    KIND_REMOTE_WAIT,
    PEER_ABORT,
)
from .device.ring import WAIT_NAMES
from .plan import Plan


def diagnose_abort(
    plan: Plan, dbg: list[int], counters: np.ndarray, epoch: int, abort: int = 1
) -> str:
    """Name the event a stuck task waits on, from the watchdog record and the live counters
    (``abort``: the state's abort word, ``PEER_ABORT`` where another rank's watchdog fired)."""
    lines = []
    if abort == PEER_ABORT and dbg[DBG_KIND] < 0:
        return (
            f"megakernel watchdog: another rank aborted launch {epoch} (that rank's error names "
            "the cause); this rank's launch stopped with it"
        )
    if dbg[DBG_KIND] == KIND_RANK_BARRIER:
        return (
            f"megakernel watchdog: the rank barrier closing launch {epoch} timed out: "
            f"{dbg[DBG_SEEN] - dbg[DBG_EXPECTED] + dbg[DBG_EXPECTED] // max(epoch, 1)} of "
            f"{dbg[DBG_EXPECTED] // max(epoch, 1)} ranks arrived (a rank that never launched "
            "this plan, or launched another)"
        )
    if dbg[DBG_KIND] in (KIND_EVENT_WAIT, KIND_REMOTE_WAIT) and 0 <= dbg[DBG_TASK] < plan.num_tasks:
        e = dbg[DBG_EVENT]
        count = plan.event_count[e]
        where = " on another rank" if dbg[DBG_KIND] == KIND_REMOTE_WAIT else ""
        lines.append(
            f"task {plan.tasks[dbg[DBG_TASK]].label} on SM {dbg[DBG_SM]} waits on event "
            f"{plan.event_label[e]}{where}: expected count {count}, seen "
            f"{dbg[DBG_SEEN] - (epoch - 1) * count} (timed out in launch {epoch})"
        )
    elif dbg[DBG_KIND] == KIND_BARRIER_WAIT:
        what = WAIT_NAMES.get(dbg[DBG_EVENT], f"pipeline wait {dbg[DBG_EVENT]}")
        lines.append(f"on SM {dbg[DBG_SM]}, {what} and timed out (launch {epoch})")
    else:
        lines.append(
            f"the ready queue stayed empty on SM {dbg[DBG_SM]} with "
            f"{dbg[DBG_SEEN]} of {plan.num_tasks} tasks done (launch {epoch})"
        )
    base = (epoch - 1) * np.asarray(plan.event_count, dtype=np.int64)
    seen = counters[: plan.num_events].astype(np.int64) - base
    for t in range(plan.num_tasks):
        for e in plan.waits[t]:
            if seen[e] < plan.event_count[e]:
                lines.append(
                    f"first stuck task {plan.tasks[t].label} waits on event "
                    f"{plan.event_label[e]}: expected count {plan.event_count[e]}, "
                    f"seen {int(seen[e])}"
                )
                break
        if len(lines) > 1:
            break
    return "megakernel watchdog: " + "; ".join(lines)
