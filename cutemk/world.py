"""Every rank of a distributed graph simulated in one process (the interpreter, W ranks).

Each rank gets its own plan (``RANK``/``WORLD`` bound), tensors and simulated SMs; symmetric
values are shared through :class:`cutemk.comm.PeerTable` (rank q's reference reads or writes
rank r's tensor directly, as the device does over NVLink). One seeded random interleaving runs
all ranks' SMs together, and a task that waits on another rank's event cannot finish before
that event completes there. It checks what a multi-GPU run would only show as a hang or as wrong
numbers:

- **deadlock across ranks**: static queues whose cross-rank waits form a cycle, or a rank whose
  tiles wait on events no rank will complete; the error names the rank, the task and the event;
- **results** against single-process references (``cutemk.tp``), with no GPU.

- **races across ranks**: happens-before follows cross-rank waits, and an op's peer values
  (``TileOp.peer_values``) are read or written in their declared region on every rank's copy
  (all-gather pushes its block into each rank's output, reduce-scatter sums each rank's
  partial), so a read of a peer's data that no remote wait orders after its writer is a
  ``RaceError`` naming both ranks' tasks, as a local one is.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .binding import bind, fresh_
from .comm import PeerTable, different_plans_error, plan_digest, symmetric_values
from .errors import CuteMKError, GraphError
from .graph import Graph
from .interpret import _Simulation
from .plan import Plan, instantiate
from .scheduling import (
    SchedulingMode,
    check_static_schedule,
    checked_initial_order,
    resolve_scheduler,
)
from .tileop import expect_positive_int


def simulate_world(
    graph: Graph,
    world: int,
    inputs: Sequence[Mapping[str, torch.Tensor]],
    scheduler: Any = "static",
    num_sms: int = 8,
    seed: int = 0,
    check_races: bool = True,
) -> tuple[list[tuple[torch.Tensor, ...]], list[Plan]]:
    """Run ``graph`` on ``world`` simulated ranks; ``inputs[r]`` are rank r's leaves by name.
    Returns every rank's outputs and plans.

    ``world`` is an int >= 1 (TypeError / ValueError otherwise); a graph whose communicating ops
    were built for another number of ranks is a :class:`GraphError` naming both, raised before
    anything is bound or run."""
    if isinstance(world, bool) or not isinstance(world, int):
        raise TypeError(f"simulate_world: world must be an int, got {world!r}")
    if world < 1:
        raise ValueError(f"simulate_world: world must be at least 1 rank, got {world}")
    expect_positive_int(num_sms, "simulate_world: num_sms")
    graph.validate()
    built = graph.world_size()
    if built is not None and built != world:
        node = next(n for n in graph.nodes if n.op.peer_values)
        raise GraphError(
            f"simulate_world: graph {graph.name!r} was built for {built} ranks but "
            f"world={world} ({node.name} reaches {built} ranks' values): simulate {built} "
            f"ranks or build the graph for {world}"
        )
    if len(inputs) != world:
        raise ValueError(f"simulate_world: {len(inputs)} input sets for {world} ranks")
    policy = resolve_scheduler(scheduler)
    rng = random.Random(seed)
    plans, tensors = [], []
    for r in range(world):
        env, leaves = bind(graph, (), dict(inputs[r]))
        env.update(RANK=r, WORLD=world)
        plan = instantiate(graph, env)
        plan.check_distributed(policy.mode is SchedulingMode.DYNAMIC)
        t: dict[str, torch.Tensor] = dict(leaves)
        for v in graph.values:
            if v.kind == "intermediate" and v.alias_of is not None:  # an input updated in place
                t[v.name] = t[v.alias_of.name]
            elif v.kind == "intermediate":
                t[v.name] = fresh_(torch.empty(plan.shapes[v.name], dtype=v.dtype), v)
        plans.append(plan)
        tensors.append(t)
    digests = [plan_digest(p) for p in plans]
    for r, d in enumerate(digests):
        if d != digests[0]:  # what the device ranks' check raises (CuteGraph's first call)
            first = {k: v for k, v in plans[0].env.items() if k != "RANK"}
            raise CuteMKError(different_plans_error(r, plans[r].env) + f" (rank 0: {first})")
    shared = symmetric_values(graph)
    sims = []
    for r in range(world):
        peers = {n: PeerTable(r, [tensors[q][n] for q in range(world)]) for n in shared}
        sims.append(_Simulation(plans[r], tensors[r], num_sms, rng, check_races, peers))
    base = 0
    for r, sim in enumerate(sims):
        sim.world_sims, sim.base = sims, base
        base += plans[r].num_tasks
        if policy.mode is SchedulingMode.STATIC:
            sched = policy.build(plans[r], num_sms)
            check_static_schedule(plans[r], sched, num_sms)
            sim.begin_static(sched)
        else:
            sim.begin_dynamic(checked_initial_order(policy, plans[r]))
    while True:
        actions = [(r, a) for r, sim in enumerate(sims) for a in sim.actions()]
        if not actions:
            break
        r, a = rng.choice(actions)
        sims[r].apply(a)
    for sim in sims:
        sim.check_finished()
    outs = [tuple(tensors[r][v.name] for v in graph.outputs) for r in range(world)]
    return outs, plans
