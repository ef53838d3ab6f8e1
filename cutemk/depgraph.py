"""A plan's task dependencies as tasks and events, never expanded into task-to-task edges.

A task depends on every task that notifies an event it waits on. Expanded, that is one edge per
(producer, consumer) pair: an all-to-all step (the MoE combine, a down projection reading every
gate/up tile) makes it quadratic, 21 million edges for the Qwen3-MoE layer at 4096 tokens. Kept
as a bipartite graph (task -> the events it notifies -> the tasks that wait on them) it is
linear in the plan, and every whole-graph pass (topological order, longest paths, list
scheduling, the static deadlock check) walks it in O(tasks + waits + notifies).

Besides events a task may have explicit predecessors (``extra``): the distributed schedulers'
mirrored dependencies (see :meth:`cutemk.plan.Plan.preds`), expanded as they are: cross-rank
waiters x shared-event producers entries, which for a GEMM + reduce-scatter layer is the one
quadratic term left.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .errors import GraphError
from .plan import Plan, tasks_by_event


@dataclass(frozen=True)
class DepGraph:
    num_tasks: int
    waits: tuple[tuple[int, ...], ...]  # task -> events it waits on that some task notifies
    notifiers: tuple[tuple[int, ...], ...]  # event -> tasks notifying it
    consumers: tuple[tuple[int, ...], ...]  # event -> tasks waiting on it
    notifies: tuple[tuple[int, ...], ...]  # task -> events it notifies that some task waits on
    extra: tuple[tuple[int, ...], ...]  # task -> explicit predecessors
    extra_succ: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(plan: Plan, mirror_remote: bool = False) -> "DepGraph":
        """The dependencies of ``plan``: the same relation as ``plan.preds(mirror_remote)``."""
        n = plan.num_tasks
        # repeats dropped first (inline: most lists have one or two entries); the per-event
        # lists built from them then hold each task once, in task order
        waits = tuple(tuple(w) if len(w) < 2 else tuple(dict.fromkeys(w)) for w in plan.waits)
        notifies = tuple(
            tuple(ns) if len(ns) < 2 else tuple(dict.fromkeys(ns)) for ns in plan.notifies
        )
        prod = tasks_by_event(notifies, plan.num_events)
        cons = tasks_by_event(waits, plan.num_events)
        live = [bool(p) and bool(c) for p, c in zip(prod, cons)]
        if not all(live):  # events nobody notifies or nobody waits on are dropped
            waits = tuple(tuple(e for e in w if live[e]) for w in waits)
            notifies = tuple(tuple(e for e in ns if live[e]) for ns in notifies)
        none: tuple[tuple[int, ...], ...] = ((),) * n
        extra, extra_succ = none, none
        if mirror_remote and plan.shared_events:
            shared = list(
                dict.fromkeys(itertools.chain.from_iterable(prod[e] for e in plan.shared_events))
            )
            ex: list[tuple[int, ...]] = [()] * n
            for t, rw in enumerate(plan.remote_waits):
                if rw:
                    ex[t] = tuple(p for p in shared if p != t)
            succ: list[list[int]] = [[] for _ in range(n)]
            for t, ps in enumerate(ex):
                for p in ps:
                    succ[p].append(t)
            extra, extra_succ = tuple(ex), tuple(tuple(x) for x in succ)
        return DepGraph(
            n, waits, tuple(map(tuple, prod)), tuple(map(tuple, cons)), notifies, extra, extra_succ
        )

    def topological_order(self, plan: Plan) -> list[int]:
        """Task ids in dependency order; GraphError naming tasks on a cycle if there is one."""
        order, pending = self.kahn()
        if len(order) != self.num_tasks:
            stuck = [plan.tasks[t].label for t in range(self.num_tasks) if pending[t] > 0][:8]
            raise GraphError(f"the task graph has a dependency cycle through {', '.join(stuck)}")
        return order

    def kahn(self, queue_next: list[int] | None = None) -> tuple[list[int], list[int]]:
        """Kahn's algorithm over tasks and events: (the tasks it could order, each task's
        count of unmet predecessors: events, explicit ones and, with ``queue_next``
        (task -> the task queued right behind it, or -1), the task queued ahead)."""
        n = self.num_tasks
        ev_left = [len(p) for p in self.notifiers]
        pending = [len(self.waits[t]) + len(self.extra[t]) for t in range(n)]
        if queue_next is not None:
            for t in queue_next:
                if t >= 0:
                    pending[t] += 1
        order = [t for t in range(n) if pending[t] == 0]
        i = 0
        while i < len(order):
            t = order[i]
            i += 1
            for e in self.notifies[t]:
                ev_left[e] -= 1
                if ev_left[e] == 0:
                    for c in self.consumers[e]:
                        pending[c] -= 1
                        if pending[c] == 0:
                            order.append(c)
            for s in self.extra_succ[t]:
                pending[s] -= 1
                if pending[s] == 0:
                    order.append(s)
            if queue_next is not None and queue_next[t] >= 0:
                s = queue_next[t]
                pending[s] -= 1
                if pending[s] == 0:
                    order.append(s)
        return order, pending

    def upward_rank(self, order: list[int], cost: list[float]) -> list[float]:
        """Per task: its cost plus the costliest path from it to the end of the graph."""
        rank = [0.0] * self.num_tasks
        ev_rank = [0.0] * len(self.notifiers)
        notifies, extra_succ, waits = self.notifies, self.extra_succ, self.waits
        for t in reversed(order):
            nt = notifies[t]
            r = ev_rank[nt[0]] if nt else 0.0
            for e in nt:
                if ev_rank[e] > r:
                    r = ev_rank[e]
            for s in extra_succ[t]:
                if rank[s] > r:
                    r = rank[s]
            rt = rank[t] = cost[t] + r
            for e in waits[t]:
                if rt > ev_rank[e]:
                    ev_rank[e] = rt
        return rank
