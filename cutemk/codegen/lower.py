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

from .. import native
from ..errors import GraphError
from ..plan import Plan
from ..scheduling import StaticSchedule

REC_WIDTH = 8
R_TASK, R_NODE, R_C0, R_C1, R_WLO, R_WHI, R_NLO, R_NHI = range(REC_WIDTH)
R_LIVE, R_WORD = R_WLO, R_WHI
"""In a record the producer hands to the consumers: whether a ring tile exists and its task
word (``TileOp.device_task_word``), decided by the producer after the task's events."""
QUEUE_CHUNK = 4
"""Static queue records the producer warp fetches at a time, one word a lane."""
QHEAD_WIDTH = QUEUE_CHUNK * REC_WIDTH + 8
"""Words of a CTA's row of ``queue_head``: its first ``QUEUE_CHUNK`` records, then the range of
its queue in ``queue_rec`` (begin, end), then padding (rows stay 16-byte aligned). The kernel
reads its row at launch start from a fixed offset, in the same round trip as the epoch, where
the queue's range and first records would otherwise cost two dependent round trips more (the
packed buffer's header, then ``queue_ptr``, then ``queue_rec``)."""
QHEAD_BEGIN, QHEAD_END = QUEUE_CHUNK * REC_WIDTH, QUEUE_CHUNK * REC_WIDTH + 1
STATE_SIZE = 8
# state[] slots (int32), shared by host and device
EPOCH, HEAD, TAIL, DONE, EXITED, ABORT, BARRIER = range(7)
# BARRIER (distributed): ranks that finished each launch, counted up to world * epoch
DEBUG_SIZE = 8
# debug[] slots written by a watchdog timeout
DBG_TASK, DBG_EVENT, DBG_EXPECTED, DBG_SEEN, DBG_SM, DBG_KIND = range(6)
KIND_EVENT_WAIT, KIND_QUEUE_IDLE, KIND_REMOTE_WAIT, KIND_BARRIER_WAIT = 1, 2, 3, 4
KIND_RANK_BARRIER = 5
PEER_ABORT = 2
"""``state[ABORT]`` as another rank sets it: that rank's watchdog fired in this launch (a rank's
own watchdog sets 1)."""
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
    queue_head: np.ndarray  # (G * QHEAD_WIDTH,) per CTA its queue's first records and range
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

    def validate(self, grid: int, static: bool) -> None:
        """Raise GraphError unless the arrays are a well-formed program for ``grid`` CTAs: every
        record's wait and notify ranges inside their lists, every event id and task id in
        range, the CSR pointers monotone, each task queued once (``static``) and the tasks
        with no waits exactly the initial ones. The boundary check between lowering and the
        kernel (a malformed program would hang or read out of bounds on the GPU)."""
        n, n_ev = self.num_tasks, self.num_events
        rows = max(n, 1)

        def bad(what: str) -> None:
            raise GraphError(f"lowered plan ({n} tasks, {n_ev} events): {what}")

        def csr(ptr: np.ndarray, size: int, flat_len: int, name: str) -> None:
            if len(ptr) != size + 1 or ptr[0] != 0 or (np.diff(ptr) < 0).any():
                bad(f"{name} is not a CSR pointer of {size} rows")
            if ptr[-1] > flat_len:
                bad(f"{name} points past its list ({int(ptr[-1])} > {flat_len})")

        if self.task_rec.size != rows * REC_WIDTH:
            bad(f"task_rec holds {self.task_rec.size} words, not {rows} records")
        rec = self.task_rec.reshape(rows, REC_WIDTH)[:n]
        if not np.array_equal(rec[:, R_TASK], np.arange(n)):
            bad("task_rec is not indexed by task id")
        for lo, hi, ids, name in (
            (R_WLO, R_WHI, self.wait_ev, "wait"),
            (R_NLO, R_NHI, self.notify_ev, "notify"),
        ):
            starts, ends = rec[:, lo], rec[:, hi]
            if n and ((starts < 0).any() or (ends < starts).any() or ends.max() > ids.size):
                bad(f"a task's {name} range falls outside {name}_ev")
            used = ids[: int(ends.max())] if n else ids[:0]
            if ((used < 0) | (used >= n_ev)).any():
                bad(f"{name}_ev holds an event id outside 0..{n_ev - 1}")
        if (
            n
            and int(rec[:, R_WHI].max())
            and not np.array_equal(
                self.wait_target[: int(rec[:, R_WHI].max())],
                self.ev_count[self.wait_ev[: int(rec[:, R_WHI].max())]],
            )
        ):
            bad("a wait's target is not its event's count")
        csr(self.queue_ptr, grid, n, "queue_ptr")
        if self.queue_rec.size != max(int(self.queue_ptr[-1]), 1) * REC_WIDTH:
            bad(
                f"queue_rec holds {self.queue_rec.size} words for {int(self.queue_ptr[-1])} records"
            )
        queued = self.queue_rec.reshape(-1, REC_WIDTH)[: int(self.queue_ptr[-1]), R_TASK]
        if static and not np.array_equal(np.sort(queued), np.arange(n)):
            bad("the static queues do not hold every task exactly once")
        if not static and len(queued):
            bad("a dynamic program has static queues")
        if not np.array_equal(self.queue_head, queue_heads(self.queue_ptr, self.queue_rec)):
            bad("queue_head is not the static queues' first records and ranges")
        csr(self.cons_ptr, n_ev, self.cons_task.size, "cons_ptr")
        cons = self.cons_task[: int(self.cons_ptr[-1])]
        cons = np.where(cons < 0, -cons - 1, cons)
        if ((cons < 0) | (cons >= n)).any():
            bad("cons_task holds a task id outside the plan")
        nwait = self.task_nwait[:n]
        if (nwait < 0).any():
            bad("a task waits on a negative number of events")
        init = np.sort(self.init_tasks[: self.num_init])
        if not np.array_equal(init, np.flatnonzero(nwait == 0)):
            bad("the initial tasks are not exactly the tasks with no waits")
        csr(self.rwait_ptr, n, self.rwait_ev.size, "rwait_ptr")

    def max_launches(self) -> int:
        """Launches before a counter target (count * epoch) would overflow int32; the kernel
        zeroes its counters and restarts at epoch 0 when it gets there."""
        worst = max(
            int(self.ev_count.max(initial=1)),
            int(self.task_nwait.max(initial=1)),
            self.num_tasks + 1,
        )  # ring slots hold epoch * num_tasks + task
        return MAX_EPOCH_COUNT // worst - 1


def queue_heads(queue_ptr: np.ndarray, queue_rec: np.ndarray) -> np.ndarray:
    """``queue_head``: a ``QHEAD_WIDTH`` row per CTA (see there), zeros past a queue's end."""
    grid = len(queue_ptr) - 1
    head = np.zeros((grid, QHEAD_WIDTH), dtype=np.int32)
    recs = queue_rec.reshape(-1, REC_WIDTH)
    begin, end = queue_ptr[:-1], queue_ptr[1:]
    for j in range(QUEUE_CHUNK):
        has = begin + j < end
        rows = np.flatnonzero(has)
        head[rows, j * REC_WIDTH : (j + 1) * REC_WIDTH] = recs[begin[rows] + j]
    head[:, QHEAD_BEGIN], head[:, QHEAD_END] = begin, end
    return head.reshape(-1)


def _csr(lists) -> tuple[np.ndarray, np.ndarray]:
    ptr, flat = native.csr(lists)
    return ptr, _nonempty(flat)


def _nonempty(a: np.ndarray) -> np.ndarray:
    return a if a.size else np.zeros(1, dtype=np.int32)


def _ptr(counts: np.ndarray) -> np.ndarray:
    ptr = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=ptr[1:])
    return ptr


def _task_records(plan: Plan) -> np.ndarray:
    """(tasks, REC_WIDTH) records without the wait / notify ranges: task, node, coords."""
    n = plan.num_tasks
    rec = np.zeros((max(n, 1), REC_WIDTH), dtype=np.int32)
    for node in plan.graph.nodes:
        ts = plan.node_tasks[node.index]
        if not len(ts):
            continue
        rank = len(plan.tasks[ts[0]].coord)
        if rank > 2:
            raise GraphError(f"{node.name}: task grids of more than 2 dims are not lowered yet")
        rec[ts.start : ts.stop, R_NODE] = node.index
        if rank:
            rec[ts.start : ts.stop, R_C0 : R_C0 + rank] = plan.coords_of(node.index)
    rec[:n, R_TASK] = np.arange(n, dtype=np.int32)
    return rec


def lower(plan: Plan, schedule: StaticSchedule | None, grid: int) -> LoweredPlan:
    """Arrays for ``plan``; ``schedule`` (static mode) must have at most ``grid`` queues.

    Built array-at-a-time: each task's waits and notifies are flattened once, and the
    per-event consumer lists come from a stable sort of the wait entries by event (so each
    event's consumers stay in task order)."""
    n = plan.num_tasks
    ev_count_all = np.asarray(plan.event_count, dtype=np.int64)
    n_ev = len(ev_count_all)
    # the scheduler's C passes built the same arrays from the same plan moments ago
    pre = schedule.native if schedule is not None else None
    wait_ptr, wait_flat = (pre.wait_ptr, _nonempty(pre.wait_idx)) if pre else _csr(plan.waits)
    n_w = int(wait_ptr[-1])
    wait_flat = wait_flat[:n_w].astype(np.int64)
    wait_task = np.repeat(np.arange(n, dtype=np.int64), np.diff(wait_ptr))
    # an explicit event of count 0 is complete from the start: it never readies a consumer
    live = ev_count_all[wait_flat] > 0 if n_w else np.zeros(0, dtype=bool)
    nlive = np.bincount(wait_task[live], minlength=n).astype(np.int32)
    wait_ev = _nonempty(wait_flat.astype(np.int32))
    wait_target = _nonempty(ev_count_all[wait_flat].astype(np.int32))
    has_cons = np.bincount(wait_flat, minlength=n_ev) > 0
    keep = has_cons.copy()
    if plan.shared_events:
        keep[np.fromiter(plan.shared_events, dtype=np.int64)] = True
    note_ptr, note_flat = (pre.ntf_ptr, _nonempty(pre.ntf_idx)) if pre else _csr(plan.notifies)
    note_flat = note_flat[: int(note_ptr[-1])].astype(np.int64)
    note_task = np.repeat(np.arange(n, dtype=np.int64), np.diff(note_ptr))
    kept = keep[note_flat] if len(note_flat) else np.zeros(0, dtype=bool)
    notify_ptr = _ptr(np.bincount(note_task[kept], minlength=n))
    notify_ev = _nonempty(note_flat[kept].astype(np.int32))
    if any(plan.remote_waits):
        remote = plan.remote_waits
        rwait_ptr, rwait_ev = _csr([[e for _, e in w] for w in remote])
        _, rwait_rank = _csr([[r for r, _ in w] for w in remote])
        _, rwait_target = _csr([[plan.event_count[e] for _, e in w] for w in remote])
    else:  # a single-GPU plan: no task waits on another rank
        rwait_ptr = np.zeros(n + 1, dtype=np.int32)
        rwait_ev = rwait_rank = rwait_target = np.zeros(1, dtype=np.int32)
    rec = _task_records(plan)
    rec[:n, R_WLO], rec[:n, R_WHI] = wait_ptr[:-1], wait_ptr[1:]
    rec[:n, R_NLO], rec[:n, R_NHI] = notify_ptr[:-1], notify_ptr[1:]
    ev_count = _nonempty(ev_count_all.astype(np.int32))
    if schedule is not None:
        if schedule.num_sms > grid:
            raise GraphError(f"static schedule has {schedule.num_sms} queues for {grid} CTAs")
        queues = list(schedule.queues) + [()] * (grid - schedule.num_sms)
    else:
        queues = [()] * grid
    queue_ptr, queue_tasks = _csr(queues)
    queue_rec = rec[queue_tasks] if n else rec
    # each event's consumers (events of count 0 have none): a consumer that waits on one event
    # only is stored as -(c + 1): completing that event readies it, with no pending-count atomic
    order = np.argsort(wait_flat, kind="stable")
    ev_sorted, cons = wait_flat[order], wait_task[order]
    counted = ev_count_all[ev_sorted] > 0 if n_w else np.zeros(0, dtype=bool)
    ev_sorted, cons = ev_sorted[counted], cons[counted]
    cons_ptr = _ptr(np.bincount(ev_sorted, minlength=n_ev))
    cons_task = _nonempty(np.where(nlive[cons] > 1, cons, -cons - 1).astype(np.int32))
    init = sorted(np.flatnonzero(nlive == 0).tolist(), key=plan.ready_key)
    lowered = LoweredPlan(
        num_tasks=n,
        num_events=plan.num_events,
        task_rec=rec.reshape(-1),
        wait_ev=wait_ev,
        wait_target=wait_target,
        notify_ev=notify_ev,
        ev_count=ev_count,
        queue_ptr=queue_ptr,
        queue_rec=np.ascontiguousarray(queue_rec).reshape(-1),
        queue_head=queue_heads(queue_ptr, queue_rec.reshape(-1)),
        cons_ptr=cons_ptr,
        cons_task=cons_task,
        task_nwait=_nonempty(nlive),
        init_tasks=_nonempty(np.asarray(init, dtype=np.int32)),
        rwait_ptr=rwait_ptr,
        rwait_ev=rwait_ev,
        rwait_rank=rwait_rank,
        rwait_target=rwait_target,
        num_init=len(init),
    )
    lowered.validate(grid, schedule is not None)
    return lowered


def pack_int32(arrays: list[np.ndarray]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Concatenate int32 arrays behind a header of (offset, size) pairs, one pair per array.

    The kernel takes one packed buffer instead of a dozen tensors (each kernel argument costs
    host time at every launch) and rebuilds the views from the header once, at its start.
    Offsets are multiples of 4 words, so every view stays 16-byte aligned.
    """
    off = first_offset(len(arrays))
    spans = []
    for a in arrays:
        spans.append((off, int(a.size)))
        off += (int(a.size) + 3) // 4 * 4
    buf = np.zeros(max(off, 4), dtype=np.int32)
    for k, (a, (o, n)) in enumerate(zip(arrays, spans)):
        buf[2 * k], buf[2 * k + 1] = o, n
        buf[o : o + n] = a
    return buf, spans


def first_offset(num_arrays: int) -> int:
    """Word offset of the first array ``pack_int32`` packs behind the header of
    ``num_arrays`` arrays: a constant the kernel may read at without the header."""
    return (2 * num_arrays + 3) // 4 * 4
