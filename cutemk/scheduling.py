"""The scheduler protocol shared by every policy, and schedule checks.

A policy is one of two modes. STATIC: a pure function ``(plan, num_sms) -> StaticSchedule``
(per-SM task queues, each SM runs its queue in order and waits on events before each task).
DYNAMIC: an on-GPU ready queue; the policy gives the order in which initially-ready tasks are
pushed, and tasks become ready when the last event they wait on completes.

A static schedule is valid only if the union of dependency edges and same-queue order edges is
acyclic: a cycle means some SM waits on a task queued behind a waiting task on another SM, which
on the GPU is a hang. :func:`check_static_schedule` rejects such schedules when they are built.
"""

from __future__ import annotations

import enum
import itertools
import operator
from dataclasses import dataclass, field
from typing import Protocol, Union, runtime_checkable

import numpy as np

from . import native
from .depgraph import DepGraph
from .errors import ScheduleError
from .plan import Plan
from .registry import scheduler_classes


class SchedulingMode(enum.Enum):
    STATIC = "static"
    DYNAMIC = "dynamic"


@dataclass(frozen=True)
class StaticSchedule:
    queues: tuple[tuple[int, ...], ...]  # per SM, task ids in run order
    # the plan's dependency graph the scheduler built it from, if the same one the check walks
    # (the check then reuses it instead of building it again); None: built by the check
    deps: DepGraph | None = field(default=None, compare=False, repr=False)
    # the same for the C passes (``cutemk.native.PlanArrays``)
    native: object | None = field(default=None, compare=False, repr=False)

    @property
    def num_sms(self) -> int:
        return len(self.queues)


@runtime_checkable
class Scheduler(Protocol):
    mode: SchedulingMode
    name: str


@runtime_checkable
class StaticPolicy(Scheduler, Protocol):
    def build(self, plan: Plan, num_sms: int) -> StaticSchedule: ...


@runtime_checkable
class DynamicPolicy(Scheduler, Protocol):
    def initial_order(self, plan: Plan) -> list[int]: ...


def resolve_scheduler(spec: Union[str, Scheduler]) -> Scheduler:
    """'static' / 'dynamic' (or another registered name) -> that policy; instances pass
    through. Either way the policy is checked: a mode of :class:`SchedulingMode` and the
    method that mode calls (``build`` / ``initial_order``)."""
    if isinstance(spec, Scheduler) and not isinstance(spec, type):  # a class is no instance
        policy = spec
    else:
        known = scheduler_classes()
        if not isinstance(spec, str) or spec not in known:
            raise ValueError(
                f"scheduler must be one of {sorted(known)} or a Scheduler instance, got {spec!r}"
            )
        try:
            policy = known[spec]()
        except TypeError as e:
            raise ValueError(
                f"scheduler {spec!r}: a registered policy is built with no arguments ({e})"
            ) from None
    if not isinstance(policy.mode, SchedulingMode):
        raise ValueError(
            f"scheduler {policy!r}: mode must be a SchedulingMode, got {policy.mode!r}"
        )
    method = "build" if policy.mode is SchedulingMode.STATIC else "initial_order"
    if not callable(getattr(policy, method, None)):
        raise ValueError(
            f"scheduler {policy!r}: a {policy.mode.value} policy needs a {method}() method"
        )
    return policy


def checked_initial_order(policy: Scheduler, plan: Plan) -> list[int]:
    """A dynamic policy's ``initial_order(plan)``, checked: the tasks with no waits (events of
    count 0 aside), each once, as ints; ``ScheduleError`` naming what is off (the GPU kernel
    pushes exactly those tasks, so an order that differs would test something else)."""
    order = policy.initial_order(plan)
    try:  # ints (numpy's too), never a float or a string int() would truncate or parse
        order = [operator.index(t) for t in order]
        if any(isinstance(t, bool) for t in order):
            raise TypeError
    except (TypeError, ValueError):
        raise ScheduleError(
            f"{policy.name}: initial_order must be a list of task ids, got {order!r:.200}"
        ) from None
    n = plan.num_tasks
    bad = [t for t in order if not 0 <= t < n]
    if bad:
        raise ScheduleError(
            f"{policy.name}: initial_order names task ids outside 0..{n - 1}: {bad[:8]}"
        )
    if len(set(order)) != len(order):
        twice = sorted({t for t in order if order.count(t) > 1})[:8]
        raise ScheduleError(f"{policy.name}: initial_order names tasks twice: {twice}")
    ready = {t for t in range(n) if all(plan.event_count[e] == 0 for e in plan.waits[t])}
    if set(order) != ready:
        waiting = sorted(set(order) - ready)[:8]
        left = sorted(ready - set(order))[:8]
        raise ScheduleError(
            f"{policy.name}: initial_order must be exactly the tasks with nothing to wait for "
            f"(tasks that wait: {waiting}; ready tasks left out: {left})"
        )
    return order


def topological_order(plan: Plan) -> list[int]:
    """Task ids in dependency order; raises GraphError if the task graph has a cycle."""
    return DepGraph.of(plan).topological_order(plan)


def _check_queue_types(queues) -> None:
    """A static schedule's queues are a sequence of sequences of int task ids (numpy ints too):
    a float id passed the checks and was truncated by the lowering, a string queue failed
    deep inside them. One pass over the ids' types, in C (``map(type, ...)``)."""
    if not isinstance(queues, (tuple, list)) or not all(
        isinstance(q, (tuple, list, range, np.ndarray)) for q in queues
    ):
        raise ScheduleError(
            f"a static schedule's queues must be a sequence of task-id sequences, got "
            f"{queues!r:.200}"
        )
    for kind in set(map(type, itertools.chain.from_iterable(queues))):
        if kind is bool or not issubclass(kind, (int, np.integer)):
            raise ScheduleError(
                f"a static schedule queues task ids that are {kind.__name__}, not ints"
            )


def check_static_schedule(plan: Plan, sched: StaticSchedule, num_sms: int | None = None) -> None:
    """Raise ScheduleError unless every task is queued once, there are at most ``num_sms``
    queues (when given), and no cross-SM wait cycle exists."""
    if not isinstance(sched, StaticSchedule):
        raise ScheduleError(
            f"a static policy's build() must return a StaticSchedule, got {type(sched).__name__}"
        )
    _check_queue_types(sched.queues)
    if num_sms is not None and sched.num_sms > num_sms:
        raise ScheduleError(f"static schedule has {sched.num_sms} queues for {num_sms} SMs")
    if sched.deps is None and native.lib() is not None:
        arrays = sched.native or native.PlanArrays(
            plan.waits, plan.notifies, plan.num_events, plan.cost
        )
        queue_next = _queue_next_array(plan.num_tasks, sched.queues)
        if queue_next is not None and arrays.valid and arrays.orders_all(queue_next):
            return
        # a task queued twice, out of range or not at all, or a cycle: the walk below names it
    seen: dict[int, int] = {}
    for sm, q in enumerate(sched.queues):
        for t in q:
            if not 0 <= t < plan.num_tasks:
                raise ScheduleError(f"SM {sm} queues task id {t}, outside 0..{plan.num_tasks - 1}")
            if t in seen:
                raise ScheduleError(
                    f"task {plan.tasks[t].label} is queued twice (SM {seen[t]} and SM {sm})"
                )
            seen[t] = sm
    if len(seen) != plan.num_tasks:
        missing = [plan.tasks[t].label for t in range(plan.num_tasks) if t not in seen][:8]
        raise ScheduleError(f"{plan.num_tasks - len(seen)} tasks are in no queue: {missing}")
    # dependencies (through events) and queue order q[i] -> q[i+1] must be acyclic
    queue_next = [-1] * plan.num_tasks
    for q in sched.queues:
        for a, b in zip(q, q[1:]):
            queue_next[a] = b
    deps = sched.deps if sched.deps is not None else DepGraph.of(plan)
    order, _ = deps.kahn(queue_next)
    if len(order) == plan.num_tasks:
        return
    # a cycle: name it from the expanded task graph (slow, and only on this path)
    preds = plan.preds()
    edges_in: list[list[tuple[int, str]]] = [[(p, "dep") for p in ps] for ps in preds]
    for q in sched.queues:
        for a, b in zip(q, q[1:]):
            edges_in[b].append((a, "queue"))
    indeg = [len(e) for e in edges_in]
    succs: list[list[int]] = [[] for _ in range(plan.num_tasks)]
    for t, es in enumerate(edges_in):
        for p, _ in es:
            succs[p].append(t)
    ready = [t for t in range(plan.num_tasks) if indeg[t] == 0]
    done = 0
    while ready:
        t = ready.pop()
        done += 1
        for s in succs[t]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    assert done < plan.num_tasks, "the event walk and the expanded graph disagree"
    raise ScheduleError(
        "static schedule would deadlock on the GPU: " + _describe_cycle(plan, seen, edges_in, indeg)
    )


def _queue_next_array(n: int, queues) -> np.ndarray | None:
    """Task -> the task queued right behind it on its SM (-1: none), or None unless every task
    is queued exactly once."""
    flat = np.fromiter(itertools.chain.from_iterable(queues), dtype=np.int64)
    if flat.size != n or (n and (flat.min() < 0 or flat.max() >= n)):
        return None
    if n and (np.bincount(flat, minlength=n) != 1).any():
        return None
    nxt = np.full(n, -1, dtype=np.int32)
    if n > 1:
        follows = np.ones(n - 1, dtype=bool)
        ends = np.cumsum(np.fromiter(map(len, queues), dtype=np.int64)) - 1
        follows[ends[(ends >= 0) & (ends < n - 1)]] = False
        nxt[flat[:-1][follows]] = flat[1:][follows]
    return nxt


def _describe_cycle(plan: Plan, sm_of: dict[int, int], edges_in, indeg) -> str:
    # walk predecessors inside the unresolved set until a task repeats
    t = next(t for t in range(plan.num_tasks) if indeg[t] > 0)
    path: list[tuple[int, str]] = []
    pos: dict[int, int] = {}
    while t not in pos:
        pos[t] = len(path)
        p, kind = next((p, k) for p, k in edges_in[t] if indeg[p] > 0)
        path.append((t, kind))
        t = p
    cycle = path[pos[t] :]
    parts = []
    for i, (task, kind) in enumerate(cycle):
        pred = cycle[(i + 1) % len(cycle)][0]
        how = "waits on" if kind == "dep" else "is queued behind"
        parts.append(
            f"{plan.tasks[task].label}@SM{sm_of[task]} {how} "
            f"{plan.tasks[pred].label}@SM{sm_of[pred]}"
        )
    return "; ".join(parts) + " (cycle)"


def critical_path(plan: Plan) -> tuple[float, list[int]]:
    """Longest cost-weighted dependency path: (microseconds, task ids)."""
    g = DepGraph.of(plan)
    order = g.topological_order(plan)
    best = [0.0] * plan.num_tasks
    via = [-1] * plan.num_tasks
    ev_end = [0.0] * len(g.notifiers)  # latest end among an event's notifiers so far
    ev_via = [-1] * len(g.notifiers)
    for t in order:
        start = 0.0
        for e in g.waits[t]:
            if ev_end[e] > start:
                start, via[t] = ev_end[e], ev_via[e]
        best[t] = start + plan.cost[t]
        for e in g.notifies[t]:
            if ev_via[e] < 0 or best[t] > ev_end[e]:
                ev_end[e], ev_via[e] = best[t], t
    if not order:
        return 0.0, []
    end = max(range(plan.num_tasks), key=best.__getitem__)
    path = [end]
    while via[path[-1]] >= 0:
        path.append(via[path[-1]])
    return best[end], path[::-1]
