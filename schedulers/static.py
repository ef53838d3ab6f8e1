"""Static scheduling: per-SM task queues built ahead of the launch.

List scheduling in the HEFT style: tasks are taken in order of decreasing upward rank (cost of
the longest path from the task to the end of the graph) among those whose predecessors are all
placed, and each goes to the SM where the cost model says it can start earliest (an SM is free
when its last task ends; a dependency on another SM adds one notify -> wait hop). Because tasks
are placed in one topological order, every queue is consistent with that order, so the schedule
can never hold a cross-SM wait cycle; ``check_static_schedule`` verifies it anyway.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from cutemk.costmodel import H200, Hardware
from cutemk.plan import Plan
from cutemk.scheduling import (
    SchedulingMode,
    StaticSchedule,
    check_static_schedule,
    topological_order,
)


@dataclass(frozen=True)
class StaticScheduler:
    hw: Hardware = H200
    mode: SchedulingMode = SchedulingMode.STATIC
    name: str = "static"

    def build(self, plan: Plan, num_sms: int) -> StaticSchedule:
        if num_sms < 1:
            raise ValueError(f"num_sms must be >= 1, got {num_sms}")
        preds = plan.preds(mirror_remote=True)
        order = topological_order(plan, preds)
        succs: list[list[int]] = [[] for _ in range(plan.num_tasks)]
        for t, ps in enumerate(preds):
            for p in ps:
                succs[p].append(t)
        rank = [0.0] * plan.num_tasks
        for t in reversed(order):
            rank[t] = plan.cost[t] + max((rank[s] for s in succs[t]), default=0.0)

        sm_free = np.zeros(num_sms)
        finish = [0.0] * plan.num_tasks
        sm_of = [-1] * plan.num_tasks
        queues: list[list[int]] = [[] for _ in range(num_sms)]
        missing = [len(p) for p in preds]
        # ties: node order, then the op's preferred tile order (grid order by default)
        key = [plan.task_key(t) for t in range(plan.num_tasks)]
        heap = [(-rank[t], key[t], t) for t in range(plan.num_tasks) if missing[t] == 0]
        heapq.heapify(heap)
        hop = self.hw.hop_us
        while heap:
            _, _, t = heapq.heappop(heap)
            ready = np.zeros(num_sms)
            if preds[t]:
                far = max(finish[p] for p in preds[t]) + hop
                ready[:] = far
                by_sm: dict[int, list[float]] = {}
                for p in preds[t]:
                    by_sm.setdefault(sm_of[p], []).append(finish[p])
                for sm in by_sm:
                    others = [finish[p] + hop for p in preds[t] if sm_of[p] != sm]
                    ready[sm] = max(max(by_sm[sm]), max(others, default=0.0))
            start = np.maximum(ready, sm_free)
            sm = int(np.argmin(start))
            finish[t] = float(start[sm]) + plan.cost[t]
            sm_free[sm] = finish[t]
            sm_of[t] = sm
            queues[sm].append(t)
            for s in succs[t]:
                missing[s] -= 1
                if missing[s] == 0:
                    heapq.heappush(heap, (-rank[s], key[s], s))
        sched = StaticSchedule(tuple(tuple(q) for q in queues))
        check_static_schedule(plan, sched)
        return sched
