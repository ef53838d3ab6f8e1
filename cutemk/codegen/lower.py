"""Lowering a plan and its schedule to the int32 arrays the megakernel reads.

The megakernel is compiled once per graph structure; everything that depends on the bound dims
(task list, events, queues) lives in these arrays, built on the host per token count and cached.
Fixed-width task record (``REC_WIDTH`` int32): ``(task, node, coord0, coord1, wait_lo, wait_hi,
notify_lo, notify_hi)``, the last four indexing the CSR lists ``wait_ev``/``wait_target`` and
``notify_ev``. ``task_rec`` is indexed by task id (dynamic mode); ``queue_rec`` holds the same
records in queue order (static mode), so a CTA streams its queue with coalesced loads. Notifies of
events nobody waits on are dropped here: they could release nobody. Every array has at least one element (an
empty array cannot be handed to the kernel as a tensor).

Counters use epoch counting: in launch number ``epoch`` (1, 2, ...) of a plan an event is
complete when its counter reaches ``count * epoch``, so nothing is reset between launches.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ..errors import GraphError
from ..plan import Plan
from ..scheduling import StaticSchedule

REC_WIDTH = 8
R_TASK, R_NODE, R_C0, R_C1, R_WLO, R_WHI, R_NLO, R_NHI = range(REC_WIDTH)
STATE_SIZE = 8
# state[] slots (int32), shared by host and device
EPOCH, HEAD, TAIL, DONE, EXITED, ABORT, BARRIER = range(7)
# BARRIER (distributed): ranks that finished each launch, counted up to world * epoch
DEBUG_SIZE = 8
# debug[] slots written by a watchdog timeout
DBG_TASK, DBG_EVENT, DBG_EXPECTED, DBG_SEEN, DBG_SM, DBG_KIND = range(6)
KIND_EVENT_WAIT, KIND_QUEUE_IDLE, KIND_REMOTE_WAIT, KIND_BARRIER_WAIT = 1, 2, 3, 4
MAX_EPOCH_COUNT = 2**31 - 1


@dataclass
class LoweredPlan:
    """Host copies (numpy int32) of the megakernel's program for one plan."""

    num_tasks: int
    num_events: int
    task_rec: np.ndarray  # (N * REC_WIDTH,) by task id
    wait_ev: np.ndarray  # (W,)
    wait_target: np.ndarray  # (W,) count of wait_ev[j] (per launch; times the epoch on device)
    notify_ev: np.ndarray  # (M,)
    ev_count: np.ndarray  # (E,)
    queue_ptr: np.ndarray  # (G + 1,) static: SM g runs queue positions queue_ptr[g]..[g+1]
    queue_rec: np.ndarray  # (N * REC_WIDTH,) records in queue order
    cons_ptr: np.ndarray  # (E + 1,) dynamic: tasks waiting on each event
    cons_task: np.ndarray  # (C,)
    task_nwait: np.ndarray  # (N,) number of waits of each task
    init_tasks: np.ndarray  # (I,) tasks with no waits (pushed at launch start)
    rwait_ptr: np.ndarray  # (N + 1,) distributed: task t waits on remote entries [ptr[t], ptr[t+1])
    rwait_ev: np.ndarray  # (R,) event id (the same id on every rank)
    rwait_rank: np.ndarray  # (R,) the rank whose counter is awaited
    rwait_target: np.ndarray  # (R,) count per launch
    num_init: int

    def program_arrays(self) -> dict[str, np.ndarray]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if isinstance(getattr(self, f.name), np.ndarray)
        }

    def max_launches(self) -> int:
        """Launches before a counter target (count * epoch) would overflow int32; the kernel
        zeroes its counters and restarts at epoch 0 when it gets there."""
        worst = max(
            int(self.ev_count.max(initial=1)),
            int(self.task_nwait.max(initial=1)),
            self.num_tasks + 1,
        )  # ring slots hold epoch * num_tasks + task
        return MAX_EPOCH_COUNT // worst - 1


def _csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, dtype=np.int32)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    flat = np.fromiter((v for x in lists for v in x), dtype=np.int32, count=int(ptr[-1]))
    return ptr, _nonempty(flat)


def _nonempty(a: np.ndarray) -> np.ndarray:
    return a if a.size else np.zeros(1, dtype=np.int32)


def lower(plan: Plan, schedule: StaticSchedule | None, grid: int) -> LoweredPlan:
    """Arrays for ``plan``; ``schedule`` (static mode) must have at most ``grid`` queues."""
    n = plan.num_tasks
    consumers = plan.consumers()
    # an explicit event of count 0 is complete from the start: it never readies a consumer
    live_waits = [[e for e in w if plan.event_count[e] > 0] for w in plan.waits]
    wait_ptr, wait_ev = _csr(plan.waits)
    wait_target = _nonempty(
        np.asarray([plan.event_count[e] for w in plan.waits for e in w], dtype=np.int32)
    )
    keep = [bool(c) or e in plan.shared_events for e, c in enumerate(consumers)]
    notify_ptr, notify_ev = _csr([[e for e in ns if keep[e]] for ns in plan.notifies])
    remote = plan.remote_waits or [[] for _ in range(n)]
    rwait_ptr, rwait_ev = _csr([[e for _, e in w] for w in remote])
    _, rwait_rank = _csr([[r for r, _ in w] for w in remote])
    _, rwait_target = _csr([[plan.event_count[e] for _, e in w] for w in remote])
    rec = np.zeros((max(n, 1), REC_WIDTH), dtype=np.int32)
    for t in plan.tasks:
        if len(t.coord) > 2:
            raise GraphError(f"{t.node.name}: task grids of more than 2 dims are not lowered yet")
        rec[t.tid, R_TASK] = t.tid
        rec[t.tid, R_NODE] = t.node.index
        rec[t.tid, R_C0 : R_C0 + len(t.coord)] = t.coord
    rec[:n, R_WLO], rec[:n, R_WHI] = wait_ptr[:-1], wait_ptr[1:]
    rec[:n, R_NLO], rec[:n, R_NHI] = notify_ptr[:-1], notify_ptr[1:]
    ev_count = _nonempty(np.asarray(plan.event_count, dtype=np.int32))
    if schedule is not None:
        if schedule.num_sms > grid:
            raise GraphError(f"static schedule has {schedule.num_sms} queues for {grid} CTAs")
        queues = list(schedule.queues) + [()] * (grid - schedule.num_sms)
    else:
        queues = [()] * grid
    queue_ptr, queue_tasks = _csr([list(q) for q in queues])
    queue_rec = rec[queue_tasks] if n else rec
    # a consumer that waits on one event only is stored as -(c + 1): completing that event
    # readies it, with no pending-count atomic
    cons_ptr, cons_task = _csr(
        [
            [c if len(live_waits[c]) > 1 else -c - 1 for c in cs] if plan.event_count[e] > 0 else []
            for e, cs in enumerate(consumers)
        ]
    )
    init = sorted((t for t in range(n) if not live_waits[t]), key=plan.ready_key)
    return LoweredPlan(
        num_tasks=n,
        num_events=plan.num_events,
        task_rec=rec.reshape(-1),
        wait_ev=wait_ev,
        wait_target=wait_target,
        notify_ev=notify_ev,
        ev_count=ev_count,
        queue_ptr=queue_ptr,
        queue_rec=np.ascontiguousarray(queue_rec).reshape(-1),
        cons_ptr=cons_ptr,
        cons_task=cons_task,
        task_nwait=_nonempty(np.asarray([len(w) for w in live_waits], dtype=np.int32)),
        init_tasks=_nonempty(np.asarray(init, dtype=np.int32)),
        rwait_ptr=rwait_ptr,
        rwait_ev=rwait_ev,
        rwait_rank=rwait_rank,
        rwait_target=rwait_target,
        num_init=len(init),
    )


def pack_int32(arrays: list[np.ndarray]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Concatenate int32 arrays behind a header of (offset, size) pairs, one pair per array.

    The kernel takes one packed buffer instead of a dozen tensors (each kernel argument costs
    host time at every launch) and rebuilds the views from the header once, at its start.
    Offsets are multiples of 4 words, so every view stays 16-byte aligned.
    """
    head = 2 * len(arrays)
    off = (head + 3) // 4 * 4
    spans = []
    for a in arrays:
        spans.append((off, int(a.size)))
        off += (int(a.size) + 3) // 4 * 4
    buf = np.zeros(max(off, 4), dtype=np.int32)
    for k, (a, (o, n)) in enumerate(zip(arrays, spans)):
        buf[2 * k], buf[2 * k + 1] = o, n
        buf[o : o + n] = a
    return buf, spans
