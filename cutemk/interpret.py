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

from .binding import bind, env_key, fresh_
from .comm import PeerTable, peer_key
from .costmodel import H200
from .errors import CuteMKError, DeadlockError, GraphError, RaceError
from .graph import Graph
from .plan import Plan, check_env, dump_stage, instantiate
from .regions import node_regions
from .scheduling import (
    SchedulingMode,
    StaticSchedule,
    check_static_schedule,
    checked_initial_order,
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
        if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1:
            raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if not isinstance(check_races, bool):
            raise TypeError(f"check_races must be a bool, got {check_races!r}")
        world = graph.world_size()
        if world not in (None, 1):
            raise GraphError(
                f"graph {graph.name!r} was built for {world} ranks: one interpreted process has "
                f"no peers to read (simulate them with cutemk.world.simulate_world(g, {world}, "
                "...), or run the cute backend on each rank)"
            )
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
        check_env(self.graph, env)  # before the cache: 5.0 or True must not find T=5 or T=1
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
            dump_stage(
                self.plan(env),
                "schedule",
                lambda: {"queues": [[int(t) for t in q] for q in sched.queues]},
            )
            self._schedules[key] = sched
        return self._schedules[key]

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor):
        env, leaves = bind(self.graph, args, kwargs)
        plan = self.plan(env)
        device = next(iter(leaves.values())).device
        tensors: dict[str, torch.Tensor] = dict(leaves)
        for v in self.graph.values:
            if v.kind == "intermediate" and v.alias_of is not None:  # an input updated in place
                tensors[v.name] = tensors[v.alias_of.name]
            elif v.kind == "intermediate":
                t = torch.empty(plan.shapes[v.name], dtype=v.dtype, device=device)
                tensors[v.name] = fresh_(t, v)
        sched = self.schedule(env) if self.scheduler.mode is SchedulingMode.STATIC else None
        sim = _Simulation(
            plan, tensors, self.num_sms, random.Random(self.seed + self.launches), self.check_races
        )
        self.launches += 1
        if sched is not None:
            sim.run_static(sched)
        else:
            sim.run_dynamic(checked_initial_order(self.scheduler, plan))
        self.last_report = sim.report(self.scheduler.name)
        for v in self.graph.values:  # an op's own counters: the GPU keeps them across launches
            if v.kind == "intermediate" and v.is_own_counter and bool(tensors[v.name].any()):
                raise CuteMKError(
                    f"{v.producer.op.name} left its counter {v.name} non-zero: the next launch "
                    "on the GPU would start from it (TileOp.zeroed_outputs)"
                )
        outs = tuple(tensors[v.name] for v in self.graph.outputs)
        return outs[0] if len(outs) == 1 else outs


class TileTensors(dict):
    """A node's tensors by argument name, as its tiles' ``exists`` / ``reads`` / ``reference``
    see them. A reference writes into them in place: one that rebinds a name
    (``t["out"] = ...``) would leave the graph's buffer unwritten (NaN) and hand the new tensor
    to the node's later tiles, so it is refused, as is a name the op does not have."""

    def __init__(self, op_name: str, tensors: dict[str, Any]) -> None:
        super().__init__(tensors)
        self.op_name = op_name

    def __setitem__(self, key: str, value: Any) -> None:
        raise CuteMKError(
            f"{self.op_name}: a tile assigned t[{key!r}]; write into the graph's tensor in "
            f"place instead (t[{key!r}][...] = ...)"
        )

    def __missing__(self, key: str) -> Any:
        raise KeyError(f"{self.op_name} has no tensor {key!r}; its tensors are {sorted(self)}")


PRESET = -2
"""Writer mark of elements holding the caller's data (an input updated in place)."""


class _Simulation:
    def __init__(
        self,
        plan: Plan,
        tensors: dict[str, torch.Tensor],
        num_sms: int,
        rng: random.Random,
        check_races: bool,
        peers: dict[str, PeerTable] | None = None,
    ) -> None:
        self.plan, self.tensors, self.num_sms, self.rng = plan, tensors, num_sms, rng
        self.check_races = check_races
        # the simulations of every rank, indexed by rank, and the id of this rank's task 0 among
        # all ranks' tasks (set by cutemk.world for W > 1): happens-before crosses ranks
        self.world_sims: list[_Simulation] | None = None
        self.base = 0
        self.counter = [0] * plan.num_events
        self.done = [False] * plan.num_tasks
        self.skipped = 0
        self.inflight: list[int | None] = [None] * num_sms
        # happens-before: bitset of tasks (by id among all ranks' tasks: ``base`` + t) ordered
        # before each task / each event's completion
        self.anc = [0] * plan.num_tasks
        self.ev_anc = [0] * plan.num_events
        # each element's writer (``base`` + t of its rank); -1: not written yet; PRESET: the
        # caller's data (an input updated in place)
        self.writer = (
            {
                v.name: np.full(plan.shapes[v.name], -1 if v.alias_of is None else PRESET, np.int32)
                for v in plan.graph.values
                if v.kind == "intermediate"
            }
            if check_races
            else {}
        )
        # in-place values: which task read an element while it still held the caller's data
        # (readers must come after the update: a later write there means a missing event)
        self.preset_reader = {
            v.name: np.full(plan.shapes[v.name], -1, np.int32)
            for v in plan.graph.values
            if check_races and v.alias_of is not None
        }
        self.views = []
        rank = plan.env.get("RANK", 0)
        for node in plan.graph.nodes:
            view: dict[str, Any] = {a: tensors[v.name] for a, v in node.args.items()}
            view.update({o: tensors[v.name] for o, v in node.results.items()})
            for a in node.op.peer_values:
                v = node.args.get(a) or node.results[a]
                view[peer_key(a)] = (peers or {}).get(v.name) or PeerTable(rank, [tensors[v.name]])
            self.views.append(TileTensors(node.op.name, view))
        # cost-model clock
        self.sm_clock = [0.0] * num_sms
        self.ev_time = [0.0] * plan.num_events
        self.start_time = [0.0] * plan.num_tasks
        self.per_sm: list[list[tuple[str, float, float]]] = [[] for _ in range(num_sms)]

    # -- shared steps ---------------------------------------------------------------------
    def _complete(self, e: int) -> bool:
        return self.counter[e] >= self.plan.event_count[e]

    def _remote_ok(self, t: int) -> bool:
        """Task t's events on other ranks are complete (the SM spins on them before running)."""
        sims = self.world_sims
        return not self.plan.remote_waits[t] or all(
            sims[r]._complete(e) for r, e in self.plan.remote_waits[t]
        )

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
        for r, e in plan.remote_waits[t]:  # complete now (see actions)
            self.anc[t] |= self.world_sims[r].ev_anc[e]
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
        mine = self.anc[t] | (1 << (self.base + t))
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
            v = node.args[arg] if arg in node.args else node.results[arg]  # own outputs too
            if v.kind != "intermediate" or box_is_empty(box):
                continue
            for sim in self._copies(node, arg):
                w = sim.writer[v.name][box_slices(box)]
                where = self._where(sim)
                if (w == -1).any():
                    idx = tuple(int(i) for i in np.argwhere(w == -1)[0] + [lo for lo, _ in box])
                    raise RaceError(
                        f"{self._where(self)}task {task.label} reads {where}{v.name}{list(idx)} "
                        f"(box {list(box)}) which no task has written: a dependency is missing"
                    )
                if sim is self and v.name in self.preset_reader:
                    self.preset_reader[v.name][box_slices(box)][w == PRESET] = t
                for wt in np.unique(w).tolist():
                    if wt != PRESET and not (self.anc[t] >> wt) & 1:
                        raise RaceError(
                            f"{self._where(self)}task {task.label} reads {where}{v.name} (box "
                            f"{list(box)}) written by {self._task_label(wt)}, which no event "
                            "it waits on orders before it: a dependency is missing"
                        )

    def _copies(self, node: Any, arg: str) -> list[_Simulation]:
        """The ranks whose copy of ``node``'s value ``arg`` its regions cover: every rank's
        for a peer value (``TileOp.peer_values``: the op reads or writes its declared region
        on each rank, as all-gather pushes and reduce-scatter pulls), else this rank's."""
        if self.world_sims and arg in node.op.peer_values:
            return self.world_sims
        return [self]

    def _where(self, sim: _Simulation) -> str:
        return f"rank {sim.plan.env['RANK']}: " if self.world_sims else ""

    def _task_label(self, gid: int) -> str:
        """Task ``gid`` (an id among all ranks' tasks) by rank and label."""
        for sim in self.world_sims or [self]:
            if sim.base <= gid < sim.base + sim.plan.num_tasks:
                return f"{self._where(sim)}task {sim.plan.tasks[gid - sim.base].label}"
        return f"task {gid}"

    def _record_writes(self, t: int) -> None:
        task = self.plan.tasks[t]
        node = task.node
        writes = node_regions(node, "writes", task.coord, self.plan.env, self.views[node.index])
        me = self.base + t
        for out, box in ((o, b) for o, r in writes.items() for b in r):
            v = node.results.get(out)
            if v is None or box_is_empty(box):
                continue
            for sim in self._copies(node, out):
                w = sim.writer[v.name][box_slices(box)]
                if sim is self and v.name in self.preset_reader:
                    early = self.preset_reader[v.name][box_slices(box)]
                    early = early[(early >= 0) & (early != t) & (w == PRESET)]
                    if early.size:
                        raise RaceError(
                            f"task {self.plan.tasks[int(early[0])].label} read {v.name} (box "
                            f"{list(box)}) before {task.label} updated it in place: a "
                            "dependency is missing"
                        )
                for wt in np.unique(w[(w >= 0) & (w != me)]).tolist():  # PRESET < 0: no writer
                    if not (self.anc[t] >> wt) & 1:
                        raise RaceError(
                            f"{self._task_label(wt)} and {self._task_label(me)} both write "
                            f"{self._where(sim)}{v.name} (box {list(box)}) and no event orders "
                            "them"
                        )
                w[...] = me

    # -- static -------------------------------------------------------------------------------
    def run_static(self, sched: StaticSchedule) -> None:
        self.begin_static(sched)
        self.run_until_stuck()
        self.check_finished()

    def run_until_stuck(self) -> None:
        while True:
            actions = self.actions()
            if not actions:
                return
            self.apply(self.rng.choice(actions))

    def begin_static(self, sched: StaticSchedule) -> None:
        self.queues = [deque(q) for q in sched.queues]
        self.queues += [deque() for _ in range(self.num_sms - len(self.queues))]
        self.dynamic = False

    def actions(self) -> list[tuple[int, Any]]:
        """What can happen next: ``(sm, None)`` finishes the SM's task (its remote waits are
        met), ``(sm, t)`` starts task t (static) / pops the ready queue's head (dynamic)."""
        plan, out = self.plan, []
        for sm in range(self.num_sms):
            t = self.inflight[sm]
            if t is not None:
                if self._remote_ok(t):
                    out.append((sm, None))
            elif self.dynamic:
                if self.ready:
                    out.append((sm, self.ready[0]))
            elif self.queues[sm] and all(self._complete(e) for e in plan.waits[self.queues[sm][0]]):
                out.append((sm, self.queues[sm][0]))
        return out

    def apply(self, action: tuple[int, Any]) -> None:
        sm, t = action
        if t is not None:
            (self.ready if self.dynamic else self.queues[sm]).popleft()
            self._start(sm, t)
            return
        completed = self._finish(sm)
        if self.dynamic:
            newly = []
            for e in completed:
                for c in self.consumers[e]:
                    self.remaining[c] -= 1
                    if self.remaining[c] == 0:
                        newly.append(c)
            self._push(newly)

    def check_finished(self) -> None:
        if self.dynamic:
            stuck = [t for t in range(self.plan.num_tasks) if not self.done[t]]
            if stuck:
                self._raise_deadlock(stuck, {})
            return
        stuck = [(sm, q[0]) for sm, q in enumerate(self.queues) if q]
        stuck += [(sm, t) for sm, t in enumerate(self.inflight) if t is not None]
        if stuck:
            self._raise_deadlock([t for _, t in stuck], {t: sm for sm, t in stuck})

    # -- dynamic ------------------------------------------------------------------------------
    def run_dynamic(self, initial: list[int]) -> None:
        self.begin_dynamic(initial)
        self.run_until_stuck()
        self.check_finished()

    def begin_dynamic(self, initial: list[int]) -> None:
        plan = self.plan
        self.dynamic = True
        self.consumers = plan.consumers()
        self.remaining = [
            sum(1 for e in plan.waits[t] if plan.event_count[e] > 0) for t in range(plan.num_tasks)
        ]
        self.ready: deque[int] = deque()
        self._push([t for t in initial if self.remaining[t] == 0])

    def _push(self, ts: list[int]) -> None:
        # a task that does not exist is never queued: its pusher completes it in place
        work = list(ts)
        while work:
            t = work.pop(0)
            if self._exists(t):
                self.ready.append(t)
                continue
            self._start_skip(t)
            for e in self._notify(t, self.start_time[t]):
                for c in self.consumers[e]:
                    self.remaining[c] -= 1
                    if self.remaining[c] == 0:
                        work.append(c)

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
        rank = f"rank {plan.env['RANK']}: " if self.world_sims else ""
        for t in stuck:
            where = f" on SM {sm_of[t]}" if t in sm_of else ""
            waits = [(None, e, self) for e in plan.waits[t]]
            waits += [(r, e, self.world_sims[r]) for r, e in plan.remote_waits[t]]
            for r, e, sim in waits:
                if not sim._complete(e):
                    of = "" if r is None else f" of rank {r}"
                    lines.append(
                        f"{rank}task {plan.tasks[t].label}{where} waits on event "
                        f"{plan.event_label[e]}{of}: expected count {plan.event_count[e]}, "
                        f"seen {sim.counter[e]}"
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
