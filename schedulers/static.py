"""Static scheduling: per-SM task queues built ahead of the launch.

List scheduling in the HEFT style: tasks are taken in order of decreasing upward rank (cost of
the longest path from the task to the end of the graph) among those whose predecessors are all
placed, and each goes to the SM where the cost model says it can start earliest (an SM is free
when its last task ends; a dependency on another SM adds one notify -> wait hop). Because tasks
are placed in one topological order, every queue is consistent with that order, so the schedule
can never hold a cross-SM wait cycle (the backends check it anyway).

Dependencies are walked as tasks and events (``cutemk.depgraph``), never as expanded
producer-consumer pairs: each event keeps a summary of its notifiers placed so far (the latest
finish, its SM, and the latest finish on any other SM), which is all a consumer's earliest start
on each SM depends on. Building costs O(tasks x SMs + waits + notifies).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from cutemk import native
from cutemk.costmodel import H200, Hardware
from cutemk.depgraph import DepGraph
from cutemk.plan import Plan
from cutemk.registry import register_scheduler
from cutemk.scheduling import SchedulingMode, StaticSchedule


def _add(best: float, sm: int, second: float, f: float, fsm: int) -> tuple[float, int, float]:
    """A latest-finish record (the latest finish ``best`` on SM ``sm``, the latest on any other
    SM ``second``; -1.0: none) after adding a finish ``f`` on SM ``fsm``."""
    if fsm == sm:
        return (f if f > best else best), sm, second
    if f > best:
        return f, fsm, (best if best > second else second)
    return best, sm, (f if f > second else second)


def _first_earliest(start: np.ndarray, sm_free: np.ndarray) -> int:
    return int(start.argmin())


def _earliest_free_longest(start: np.ndarray, sm_free: np.ndarray) -> int:
    """Of the SMs where a task starts earliest, the one free longest (then the first)."""
    tied = np.flatnonzero(start == start.min())
    return int(tied[sm_free[tied].argmin()])


def _priority_order(plan: Plan, rank: list[float]) -> list[int]:
    """Task ids by decreasing upward rank, then ``plan.task_key`` (node, the op's preferred
    tile order), then id: one ``np.lexsort`` over the ops' key arrays, the same order as
    sorting the tuples (keys of one node have one length; the node index decides between
    nodes)."""
    n = plan.num_tasks
    keys = [
        plan.graph.nodes[k].op.order_key_array(plan.coords_of(k))
        for k in range(len(plan.node_tasks))
    ]
    width = max([k.shape[1] for k in keys if len(k)], default=0)
    if not all(np.issubdtype(k.dtype, np.integer) for k in keys if len(k)):
        return sorted(range(n), key=lambda t: (-rank[t], plan.task_key(t), t))
    mat = np.zeros((n, 1 + width), dtype=np.int64)
    for k, ts in enumerate(plan.node_tasks):
        if len(ts):
            mat[ts.start : ts.stop, 0] = k
            mat[ts.start : ts.stop, 1 : 1 + keys[k].shape[1]] = keys[k]
    cols = [np.arange(n)] + [mat[:, c] for c in range(width, -1, -1)]
    cols.append(-np.asarray(rank, dtype=np.float64))
    return np.lexsort(cols).tolist()


@register_scheduler
@dataclass(frozen=True)
class StaticScheduler:
    hw: Hardware = H200
    mode: SchedulingMode = SchedulingMode.STATIC
    name: str = "static"
    # between SMs where a task can start as early (by the cost model): "index" takes the
    # first, "idle" the one that has been free longest, which puts small tasks behind a wait
    # (a split reduce, a norm) on SMs with nothing else to do rather than in front of a GEMM
    # tile whose weights their wait would hold back (to measure: benchmarks/NOTES.md)
    ties: str = "index"

    def __post_init__(self) -> None:
        if self.ties not in ("index", "idle"):
            raise ValueError(f"StaticScheduler ties must be 'index' or 'idle', got {self.ties!r}")

    def build(self, plan: Plan, num_sms: int) -> StaticSchedule:
        if num_sms < 1:
            raise ValueError(f"num_sms must be >= 1, got {num_sms}")
        if native.lib() is not None and not plan.shared_events:
            sched = self._build_native(plan, num_sms)
            if sched is not None:
                return sched
        g = DepGraph.of(plan, mirror_remote=True)
        order = g.topological_order(plan)
        rank = g.upward_rank(order, plan.cost)
        n_ev = len(g.notifiers)
        # per event, over its notifiers placed so far: the latest finish (best), its SM, and
        # the latest finish on any SM other than that one (second); -1.0 where there is none
        # (``_add``)
        ev_best = [-1.0] * n_ev
        ev_sm = [-1] * n_ev
        ev_second = [-1.0] * n_ev
        ev_left = [len(p) for p in g.notifiers]
        waits, extra, notifies = g.waits, g.extra, g.notifies
        consumers, extra_succ = g.consumers, g.extra_succ
        missing = [len(waits[t]) + len(extra[t]) for t in range(plan.num_tasks)]
        sm_free = np.zeros(num_sms)
        finish = [0.0] * plan.num_tasks
        sm_of = [-1] * plan.num_tasks
        queues: list[list[int]] = [[] for _ in range(num_sms)]
        # ties: node order, then the op's preferred tile order (grid order by default); the
        # heap holds each task's place in that total order (ints compare faster than tuples)
        by_prio = _priority_order(plan, rank)
        prio = [0] * plan.num_tasks
        for i, t in enumerate(by_prio):
            prio[t] = i
        heap = [prio[t] for t in range(plan.num_tasks) if missing[t] == 0]
        heapq.heapify(heap)
        heappop, heappush = heapq.heappop, heapq.heappush
        hop = self.hw.hop_us
        cost = plan.cost
        pick = _first_earliest if self.ties == "index" else _earliest_free_longest
        start = np.zeros(num_sms)
        # ``start`` after the last task placed through the wait branch, for its waits: a task
        # with the same waits (the next tile of a row, say) needs only the entry of the SM the
        # last one went to updated (the events it waits on are complete: their summaries no
        # longer change)
        last_wt: tuple[int, ...] | None = None
        last_sm = 0
        threshold = own = 0.0
        b_sm = -1
        while heap:
            t = by_prio[heappop(heap)]
            wt, xt = waits[t], extra[t]
            if wt and not xt and wt == last_wt:
                if last_sm == b_sm:
                    start[b_sm] = max(own, sm_free[b_sm])
                else:
                    start[last_sm] = max(sm_free[last_sm], threshold)
                sm = pick(start, sm_free)
                begin = float(start[sm])
            elif wt or xt:
                # when t can start on each SM: a predecessor on the same SM is waited for as
                # it ends, one on another SM one hop later. Only the latest predecessor (on SM
                # b) and the latest on any other SM matter: every SM but b waits for the
                # latest plus a hop, SM b for the later of its own latest and the other SMs'
                # latest plus a hop
                b_best, b_sm, b_second = -1.0, -1, -1.0
                for e in wt:  # _add, inlined (the loop's hottest step)
                    f, fsm = ev_best[e], ev_sm[e]
                    if fsm == b_sm:
                        if f > b_best:
                            b_best = f
                    elif f > b_best:
                        if b_best > b_second:
                            b_second = b_best
                        b_best, b_sm = f, fsm
                    elif f > b_second:
                        b_second = f
                for q in xt:
                    b_best, b_sm, b_second = _add(b_best, b_sm, b_second, finish[q], sm_of[q])
                # an event's second is on some SM other than its best's; where that SM is the
                # union's best SM, the event's best (later, on another SM) is already a
                # candidate, so it changes nothing
                for e in wt:
                    v = ev_best[e] if ev_sm[e] != b_sm else ev_second[e]
                    if v > b_second:
                        b_second = v
                threshold = b_best + hop
                np.maximum(sm_free, threshold, out=start)
                own = max(b_best, b_second + hop if b_second >= 0.0 else 0.0)
                start[b_sm] = max(own, sm_free[b_sm])
                sm = pick(start, sm_free)
                begin = float(start[sm])
                last_wt = None if xt else wt
            else:  # ready at once: the SM that frees first
                sm = int(sm_free.argmin())
                begin = float(sm_free[sm])
                last_wt = None
            last_sm = sm
            ft = begin + cost[t]
            finish[t] = ft
            sm_free[sm] = ft
            sm_of[t] = sm
            queues[sm].append(t)
            for e in notifies[t]:  # _add, inlined
                if ev_sm[e] == sm:
                    if ft > ev_best[e]:
                        ev_best[e] = ft
                elif ft > ev_best[e]:
                    if ev_best[e] > ev_second[e]:
                        ev_second[e] = ev_best[e]
                    ev_best[e], ev_sm[e] = ft, sm
                elif ft > ev_second[e]:
                    ev_second[e] = ft
                ev_left[e] -= 1
                if ev_left[e] == 0:
                    for c in consumers[e]:
                        missing[c] -= 1
                        if missing[c] == 0:
                            heappush(heap, prio[c])
            for x in extra_succ[t]:
                missing[x] -= 1
                if missing[x] == 0:
                    heappush(heap, prio[x])
        # without shared events the mirrored graph is the plain one the check walks
        deps = None if plan.shared_events else g
        return StaticSchedule(tuple(tuple(q) for q in queues), deps)

    def _build_native(self, plan: Plan, num_sms: int) -> StaticSchedule | None:
        """The same schedule by the C passes (``cutemk.native``); None if the graph has a
        cycle or ids out of range (the Python passes name them)."""
        arrays = native.PlanArrays(plan.waits, plan.notifies, plan.num_events, plan.cost)
        if not arrays.valid:
            return None
        rank = arrays.upward_rank()
        if rank is None:
            return None
        sm_of, placed = arrays.list_schedule(
            _priority_order(plan, rank), num_sms, self.hw.hop_us, self.ties == "idle"
        )
        on = sm_of[placed]
        ordered = placed[np.argsort(on, kind="stable")]
        bounds = np.cumsum(np.bincount(on, minlength=num_sms))[:-1]
        queues = tuple(tuple(q.tolist()) for q in np.split(ordered, bounds))
        return StaticSchedule(queues, native=arrays)
