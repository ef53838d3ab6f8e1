"""The interpreter backend: runs a graph's tasks with their torch references on N simulated SMs.

It executes the same event protocol the GPU runs (wait until count, run, notify), under the
static or dynamic policy, with a seeded random interleaving of the SMs: each step one SM either
starts a task whose events are complete or finishes its running task. It is the semantic
reference of the megakernel and checks two things the GPU would only show as a hang or garbage:

- **deadlock**: no SM can make progress while tasks remain; the error names a stuck task, the
  event it waits on, and the expected vs seen count;
- **races**: a task reads an element that no task ordered before it (transitively, through the
  events it waited on) has written.

It also keeps a cost-model timeline of the run (per-SM order, makespan, critical path).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .binding import bind, env_key, poison_
from .errors import DeadlockError, RaceError
from .graph import Graph
from .plan import Plan, instantiate, node_regions
from .costmodel import H200
from .scheduling import (
    SchedulingMode,
    StaticSchedule,
    check_static_schedule,
    critical_path,
    resolve_scheduler,
)
from .tileop import box_is_empty, box_slices


@dataclass
class ScheduleReport:
    """What one interpreted launch did, on the cost model's clock (microseconds)."""

    scheduler: str
    num_sms: int
    num_tasks: int
    num_events: int
    num_edges: int
    skipped: int
    per_sm: list[list[tuple[str, float, float]]] = field(default_factory=list)
    makespan_us: float = 0.0
    critical_path_us: float = 0.0
    critical_path: list[str] = field(default_factory=list)

    @property
    def busy_fraction(self) -> float:
        busy = sum(e - s for q in self.per_sm for _, s, e in q)
        return busy / (self.makespan_us * self.num_sms) if self.makespan_us else 0.0

    def summary(self, max_sms: int = 4, max_tasks: int = 6) -> str:
        lines = [
            f"{self.scheduler} scheduler on {self.num_sms} SMs: {self.num_tasks} tasks "
            f"({self.skipped} skipped: no data), {self.num_events} events, {self.num_edges} "
            f"task edges",
            f"  est. makespan {self.makespan_us:.2f} us, critical path "
            f"{self.critical_path_us:.2f} us ({len(self.critical_path)} tasks), "
            f"SM busy {100 * self.busy_fraction:.0f}%",
        ]
        for sm, q in enumerate(self.per_sm[:max_sms]):
            names = " ".join(n for n, _, _ in q[:max_tasks]) + (
                " ..." if len(q) > max_tasks else ""
            )
            lines.append(f"  SM{sm:<3} {len(q):4d} tasks: {names}")
        if len(self.per_sm) > max_sms:
            lines.append(f"  ... {len(self.per_sm) - max_sms} more SMs")
        return "\n".join(lines)


class InterpretedGraph:
    """A graph compiled for the CPU interpreter. Call it like a function of the graph leaves."""

    def __init__(
        self,
        graph: Graph,
        num_sms: int = 8,
        scheduler: Any = "static",
        seed: int = 0,
        check_races: bool = True,
    ) -> None:
        if not isinstance(num_sms, int) or num_sms < 1:
            raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
        self.graph = graph
        self.num_sms = num_sms
        self.scheduler = resolve_scheduler(scheduler)
        self.seed = seed
        self.check_races = check_races
        self._plans: dict[tuple, Plan] = {}
        self._schedules: dict[tuple, StaticSchedule] = {}
        self.last_report: ScheduleReport | None = None
        self.launches = 0

    def plan(self, env: dict[str, int]) -> Plan:
        """The instantiated task graph for these dims (cached)."""
        key = env_key(env)
        if key not in self._plans:
            self._plans[key] = instantiate(self.graph, env)
        return self._plans[key]

    def schedule(self, env: dict[str, int]) -> StaticSchedule:
        key = env_key(env)
        if key not in self._schedules:
            sched = self.scheduler.build(self.plan(env), self.num_sms)
            check_static_schedule(
                self.plan(env), sched, self.num_sms
            )  # custom policies are checked too
            self._schedules[key] = sched
        return self._schedules[key]

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor):
        env, leaves = bind(self.graph, args, kwargs)
        plan = self.plan(env)
        device = next(iter(leaves.values())).device
        tensors: dict[str, torch.Tensor] = dict(leaves)
        for v in self.graph.values:
            if v.kind == "intermediate":
                tensors[v.name] = poison_(
                    torch.empty(plan.shapes[v.name], dtype=v.dtype, device=device)
                )
        sched = self.schedule(env) if self.scheduler.mode is SchedulingMode.STATIC else None
        sim = _Simulation(
            plan, tensors, self.num_sms, random.Random(self.seed + self.launches), self.check_races
        )
        self.launches += 1
        if sched is not None:
            sim.run_static(sched)
        else:
            sim.run_dynamic(self.scheduler.initial_order(plan))
        self.last_report = sim.report(self.scheduler.name)
        outs = tuple(tensors[v.name] for v in self.graph.outputs)
        return outs[0] if len(outs) == 1 else outs


class _Simulation:
    def __init__(
        self,
        plan: Plan,
        tensors: dict[str, torch.Tensor],
        num_sms: int,
        rng: random.Random,
        check_races: bool,
    ) -> None:
        self.plan, self.tensors, self.num_sms, self.rng = plan, tensors, num_sms, rng
        self.check_races = check_races
        self.counter = [0] * plan.num_events
        self.done = [False] * plan.num_tasks
        self.skipped = 0
        self.inflight: list[int | None] = [None] * num_sms
        # happens-before: bitset of tasks ordered before each task / each event's completion
        self.anc = [0] * plan.num_tasks
        self.ev_anc = [0] * plan.num_events
        self.writer = (
            {
                n: np.full(plan.shapes[n], -1, dtype=np.int32)
                for n, v in ((v.name, v) for v in plan.graph.values)
                if v.kind == "intermediate"
            }
            if check_races
            else {}
        )
        self.views = []
        for node in plan.graph.nodes:
            view = {a: tensors[v.name] for a, v in node.args.items()}
            view.update({o: tensors[v.name] for o, v in node.results.items()})
            self.views.append(view)
        # cost-model clock
        self.sm_clock = [0.0] * num_sms
        self.ev_time = [0.0] * plan.num_events
        self.start_time = [0.0] * plan.num_tasks
        self.per_sm: list[list[tuple[str, float, float]]] = [[] for _ in range(num_sms)]

    # -- shared steps ---------------------------------------------------------------------
    def _complete(self, e: int) -> bool:
        return self.counter[e] >= self.plan.event_count[e]

    def _exists(self, t: int) -> bool:
        task = self.plan.tasks[t]
        return task.node.op.exists(task.coord, self.plan.env, self.views[task.node.index])

    def _start(self, sm: int, t: int) -> None:
        plan = self.plan
        anc = 0
        for e in plan.waits[t]:
            anc |= self.ev_anc[e]
        self.anc[t] = anc
        ready = max((self.ev_time[e] + H200.hop_us for e in plan.waits[t]), default=0.0)
        self.start_time[t] = max(self.sm_clock[sm], ready)
        self.inflight[sm] = t

    def _finish(self, sm: int) -> list[int]:
        """Run the SM's task body and notify; return the events that completed."""
        t = self.inflight[sm]
        assert t is not None
        self.inflight[sm] = None
        plan = self.plan
        task = plan.tasks[t]
        cost = 0.0
        if self._exists(t):
            if self.check_races:
                self._check_reads(t)
            task.node.op.reference(task.coord, plan.env, self.views[task.node.index])
            if self.check_races:
                self._record_writes(t)
            cost = plan.cost[t]
        else:
            self.skipped += 1
        end = self.start_time[t] + cost
        self.sm_clock[sm] = end
        self.per_sm[sm].append((task.label, self.start_time[t], end))
        self.done[t] = True
        return self._notify(t, end)

    def _notify(self, t: int, when: float) -> list[int]:
        """Apply task t's notifies; return the events that just reached their count."""
        completed = []
        mine = self.anc[t] | (1 << t)
        for e in self.plan.notifies[t]:
            self.counter[e] += 1
            self.ev_anc[e] |= mine
            self.ev_time[e] = max(self.ev_time[e], when)
            if self.counter[e] == self.plan.event_count[e]:
                completed.append(e)
        return completed

    def _check_reads(self, t: int) -> None:
        task = self.plan.tasks[t]
        node = task.node
        reads = node_regions(node, "reads", task.coord, self.plan.env, self.views[node.index])
        for arg, box in ((a, b) for a, r in reads.items() for b in r):
            v = node.args[arg]
            if v.kind != "intermediate" or box_is_empty(box):
                continue
            w = self.writer[v.name][box_slices(box)]
            if (w < 0).any():
                idx = tuple(int(i) for i in np.argwhere(w < 0)[0] + [lo for lo, _ in box])
                raise RaceError(
                    f"task {task.label} reads {v.name}{list(idx)} (box {list(box)}) "
                    "which no task has written: a dependency is missing"
                )
            for wt in np.unique(w).tolist():
                if not (self.anc[t] >> wt) & 1:
                    raise RaceError(
                        f"task {task.label} reads {v.name} (box {list(box)}) written by task "
                        f"{self.plan.tasks[wt].label}, which no event it waits on orders before "
                        "it: a dependency is missing"
                    )

    def _record_writes(self, t: int) -> None:
        task = self.plan.tasks[t]
        node = task.node
        writes = node_regions(node, "writes", task.coord, self.plan.env, self.views[node.index])
        for out, box in ((o, b) for o, r in writes.items() for b in r):
            v = node.results.get(out)
            if v is not None and not box_is_empty(box):
                self.writer[v.name][box_slices(box)] = t

    # -- static -------------------------------------------------------------------------------
    def run_static(self, sched: StaticSchedule) -> None:
        plan = self.plan
        queues = [deque(q) for q in sched.queues]
        queues += [deque() for _ in range(self.num_sms - len(queues))]
        while True:
            actions = []
            for sm in range(self.num_sms):
                if self.inflight[sm] is not None:
                    actions.append((sm, None))
                elif queues[sm] and all(self._complete(e) for e in plan.waits[queues[sm][0]]):
                    actions.append((sm, queues[sm][0]))
            if not actions:
                break
            sm, t = self.rng.choice(actions)
            if t is None:
                self._finish(sm)
            else:
                queues[sm].popleft()
                self._start(sm, t)
        stuck = [(sm, q[0]) for sm, q in enumerate(queues) if q]
        if stuck:
            self._raise_deadlock([t for _, t in stuck], {t: sm for sm, t in stuck})

    # -- dynamic ------------------------------------------------------------------------------
    def run_dynamic(self, initial: list[int]) -> None:
        plan = self.plan
        consumers = plan.consumers()
        remaining = [
            sum(1 for e in plan.waits[t] if plan.event_count[e] > 0) for t in range(plan.num_tasks)
        ]
        ready: deque[int] = deque()

        def push(ts: list[int]) -> None:
            # a task that does not exist is never queued: its pusher completes it in place
            work = list(ts)
            while work:
                t = work.pop(0)
                if self._exists(t):
                    ready.append(t)
                    continue
                self._start_skip(t)
                for e in self._notify(t, self.start_time[t]):
                    for c in consumers[e]:
                        remaining[c] -= 1
                        if remaining[c] == 0:
                            work.append(c)

        push([t for t in initial if remaining[t] == 0])
        while True:
            actions = [
                (sm, self.inflight[sm] is not None)
                for sm in range(self.num_sms)
                if self.inflight[sm] is not None or ready
            ]
            if not actions:
                break
            sm, busy = self.rng.choice(actions)
            if busy:
                newly = []
                for e in self._finish(sm):
                    for c in consumers[e]:
                        remaining[c] -= 1
                        if remaining[c] == 0:
                            newly.append(c)
                push(newly)
            else:
                self._start(sm, ready.popleft())
        stuck = [t for t in range(plan.num_tasks) if not self.done[t]]
        if stuck:
            self._raise_deadlock(stuck, {})

    def _start_skip(self, t: int) -> None:
        anc = 0
        for e in self.plan.waits[t]:
            anc |= self.ev_anc[e]
        self.anc[t] = anc
        self.start_time[t] = max((self.ev_time[e] for e in self.plan.waits[t]), default=0.0)
        self.done[t] = True
        self.skipped += 1

    # -- reporting ----------------------------------------------------------------------------
    def _raise_deadlock(self, stuck: list[int], sm_of: dict[int, int]) -> None:
        plan = self.plan
        lines = []
        for t in stuck:
            for e in plan.waits[t]:
                if not self._complete(e):
                    where = f" on SM {sm_of[t]}" if t in sm_of else ""
                    lines.append(
                        f"task {plan.tasks[t].label}{where} waits on event "
                        f"{plan.event_label[e]}: expected count {plan.event_count[e]}, "
                        f"seen {self.counter[e]}"
                    )
                    break
        n_left = sum(1 for d in self.done if not d)
        head = lines[0] if lines else f"tasks {[plan.tasks[t].label for t in stuck[:4]]}"
        more = f" ({len(lines) - 1} more stuck tasks)" if len(lines) > 1 else ""
        raise DeadlockError(
            f"deadlock with {n_left} tasks unfinished: {head}{more}\n  " + "\n  ".join(lines[:8])
        )

    def report(self, name: str) -> ScheduleReport:
        cp_us, cp = critical_path(self.plan)
        return ScheduleReport(
            scheduler=name,
            num_sms=self.num_sms,
            num_tasks=self.plan.num_tasks,
            num_events=self.plan.num_events,
            num_edges=self.plan.num_edges(),
            skipped=self.skipped,
            per_sm=self.per_sm,
            makespan_us=max(self.sm_clock, default=0.0),
            critical_path_us=cp_us,
            critical_path=[self.plan.tasks[t].label for t in cp],
        )
