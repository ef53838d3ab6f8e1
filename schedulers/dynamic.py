"""Dynamic scheduling: an on-GPU ready queue.

Semantics (the interpreter simulates them; the GPU backend lowers them to an atomic
multi-producer/multi-consumer queue): tasks that wait on nothing are pushed at launch in
``initial_order``; when a task notifies an event and the event reaches its count, every consumer
whose events are now all complete is pushed; an idle SM pops the oldest entry. A task of a
data-dependent grid that does not exist is never pushed: whoever would push it completes its
notifies instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from cutemk.plan import Plan
from cutemk.registry import register_scheduler
from cutemk.scheduling import SchedulingMode


@register_scheduler
@dataclass(frozen=True)
class DynamicScheduler:
    mode: SchedulingMode = SchedulingMode.DYNAMIC
    name: str = "dynamic"

    def initial_order(self, plan: Plan) -> list[int]:
        # an explicit event of count 0 is complete from the start: it holds nobody back
        ready = [
            t for t in range(plan.num_tasks) if all(plan.event_count[e] == 0 for e in plan.waits[t])
        ]
        return sorted(ready, key=plan.ready_key)
