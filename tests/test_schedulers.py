"""Scheduling policies: static queues are complete, balanced and cycle-free; bad ones rejected."""

import numpy as np
import pytest
import torch
from cutemk.schedulers import DynamicScheduler, StaticScheduler

import cutemk as mk
from cutemk.layers import mlp_graph
from cutemk.plan import instantiate


def _plan(t=40):
    T = mk.sym("T", max=256)
    g = mlp_graph(T, hidden=64, intermediate=48, block_m=8, block_n=16)
    return g, instantiate(g, {"T": t})


@pytest.mark.parametrize("num_sms", [1, 3, 16, 132])
def test_static_schedule_is_valid_and_balanced(num_sms):
    _, plan = _plan()
    sched = StaticScheduler().build(plan, num_sms)
    mk.check_static_schedule(plan, sched)
    assert sorted(t for q in sched.queues for t in q) == list(range(plan.num_tasks))
    if num_sms == 3:  # equal-cost independent first layer spreads evenly
        loads = [sum(plan.cost[t] for t in q) for q in sched.queues]
        assert max(loads) - min(loads) <= max(plan.cost)


def test_cross_sm_cycle_is_rejected_when_built():
    _, plan = _plan(t=16)
    gu, silu = plan.node_tasks[0], plan.node_tasks[1]
    g_row = {r: [t for t in gu if plan.tasks[t].coord[0] == r] for r in (0, 1)}
    # SM0 runs silu[0] then the row-1 gate_up tiles; SM1 runs silu[1] then the row-0 tiles:
    # each SM's first task waits on work queued behind the other SM's first task.
    rest = [t for t in range(plan.num_tasks) if t not in (*g_row[0], *g_row[1], silu[0], silu[1])]
    bad = mk.StaticSchedule(((silu[0], *g_row[1], *rest), (silu[1], *g_row[0])))
    with pytest.raises(
        mk.ScheduleError, match="would deadlock on the GPU.*silu_mul0\\[0, 0\\]@SM0"
    ):
        mk.check_static_schedule(plan, bad)

    class Broken(StaticScheduler):
        def build(self, plan, num_sms):
            return bad

    g, _ = _plan(t=16)
    c = g.compile("interpret", num_sms=2, scheduler=Broken())
    with pytest.raises(mk.ScheduleError, match="cycle"):
        c(torch.randn(16, 64), torch.randn(96, 64), torch.randn(64, 48))


def test_same_sm_order_inversion_is_rejected():
    _, plan = _plan(t=8)
    order = list(reversed(range(plan.num_tasks)))
    with pytest.raises(mk.ScheduleError, match="queued behind"):
        mk.check_static_schedule(plan, mk.StaticSchedule((tuple(order),)))


def test_missing_and_duplicate_tasks_are_rejected():
    _, plan = _plan(t=8)
    ids = tuple(range(plan.num_tasks))
    with pytest.raises(mk.ScheduleError, match="in no queue"):
        mk.check_static_schedule(plan, mk.StaticSchedule((ids[:-1],)))
    with pytest.raises(mk.ScheduleError, match="queued twice"):
        mk.check_static_schedule(plan, mk.StaticSchedule((ids, ids[:1])))


def test_dynamic_initial_order_is_tasks_without_waits():
    _, plan = _plan(t=8)
    first = DynamicScheduler().initial_order(plan)
    assert first == list(plan.node_tasks[0])


def test_critical_path_follows_dependencies():
    _, plan = _plan(t=8)
    us, path = mk.critical_path(plan)
    assert [plan.tasks[t].node.name for t in path] == ["gemm0", "silu_mul0", "gemm1"]
    assert us == pytest.approx(sum(plan.cost[t] for t in path))


def _expanded_list_schedule(plan, num_sms, hop):
    """Reference: the same list scheduling over expanded task-to-task edges (quadratic in an
    all-to-all layer; what the event walk must reproduce exactly)."""
    import heapq

    import numpy as np

    preds = plan.preds(mirror_remote=True)
    succs = [[] for _ in range(plan.num_tasks)]
    for t, ps in enumerate(preds):
        for p in ps:
            succs[p].append(t)
    indeg = [len(p) for p in preds]
    order = [t for t in range(plan.num_tasks) if indeg[t] == 0]
    for t in order:
        for s in succs[t]:
            indeg[s] -= 1
            if indeg[s] == 0:
                order.append(s)
    rank = [0.0] * plan.num_tasks
    for t in reversed(order):
        rank[t] = plan.cost[t] + max((rank[s] for s in succs[t]), default=0.0)
    sm_free, finish, sm_of = np.zeros(num_sms), [0.0] * plan.num_tasks, [-1] * plan.num_tasks
    queues = [[] for _ in range(num_sms)]
    missing = [len(p) for p in preds]
    heap = [(-rank[t], plan.task_key(t), t) for t in range(plan.num_tasks) if not missing[t]]
    heapq.heapify(heap)
    while heap:
        _, _, t = heapq.heappop(heap)
        ready = np.zeros(num_sms)
        if preds[t]:
            ready[:] = max(finish[p] for p in preds[t]) + hop
            for sm in {sm_of[p] for p in preds[t]}:
                others = [finish[p] + hop for p in preds[t] if sm_of[p] != sm]
                own = max(finish[p] for p in preds[t] if sm_of[p] == sm)
                ready[sm] = max(own, max(others, default=0.0))
        start = np.maximum(ready, sm_free)
        sm = int(np.argmin(start))
        finish[t] = float(start[sm]) + plan.cost[t]
        sm_free[sm], sm_of[t] = finish[t], sm
        queues[sm].append(t)
        for s in succs[t]:
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(heap, (-rank[s], plan.task_key(s), s))
    return tuple(tuple(q) for q in queues)


@pytest.mark.parametrize("num_sms", [1, 5, 132])
def test_event_walk_schedules_like_expanded_edges(num_sms):
    """The static scheduler walks events, never producer-consumer pairs; its queues equal the
    expanded-edge list schedule on layers with all-to-all steps and on distributed plans."""
    from cutemk.layers import MoeConfig, moe_graph
    from cutemk.tp import gemm_rs_graph

    T = mk.sym("T", max=1024)
    plans = [
        instantiate(moe_graph(T, MoeConfig(128, 64, 8, 2)), {"T": 77}),
        instantiate(mlp_graph(T, 64, 48, block_m=8, block_n=16), {"T": 40}),
        instantiate(
            gemm_rs_graph(T, 256, 512, 2, torch.bfloat16, 64, 64, 64, 128),
            {"T": 256, "RANK": 1, "WORLD": 2},
        ),
    ]
    for plan in plans:
        hop = StaticScheduler().hw.hop_us
        got = StaticScheduler().build(plan, num_sms).queues
        assert got == _expanded_list_schedule(plan, num_sms, hop)


def test_critical_path_through_events():
    _, plan = _plan()
    us, path = mk.critical_path(plan)
    preds = plan.preds()
    assert all(a in preds[b] for a, b in zip(path, path[1:]))
    assert us == pytest.approx(sum(plan.cost[t] for t in path))


def test_backends_and_policies_come_from_registries():
    from cutemk import registry

    assert set(registry.scheduler_classes()) >= {"static", "dynamic"}
    with pytest.raises(mk.GraphError, match="unknown backend 'tpu'"):
        _plan()[0].compile("tpu")

    from dataclasses import dataclass

    @registry.register_scheduler
    @dataclass(frozen=True)
    class Reversed(StaticScheduler):  # a custom policy, known by name once registered
        name: str = "reversed-test"

    try:
        policy = mk.resolve_scheduler("reversed-test")
        assert isinstance(policy, Reversed) and policy.name == "reversed-test"
        g, _ = _plan(8)
        out = g.compile("interpret", scheduler="reversed-test", num_sms=3)(
            torch.randn(8, 64), torch.randn(96, 64), torch.randn(64, 48)
        )
        assert out.shape == (8, 64)
    finally:
        registry._SCHEDULERS.pop("reversed-test")
    with pytest.raises(ValueError, match="scheduler must be one of"):
        mk.resolve_scheduler("nope")


def test_order_key_arrays_match_order_key():
    """Every op's vectorised tile order (the static scheduler's priority sort) is its
    per-tile ``order_key``, subclasses that override only ``order_key`` included."""
    import numpy as np

    from cutemk.layers import DecoderConfig, decoder_layer_graph, mlp_graph

    cfg = DecoderConfig(
        hidden=256,
        intermediate=512,
        heads=4,
        kv_heads=2,
        head_dim=64,
        max_pages=8,
        block_m=64,
        block_n=64,
        fold_norms=True,
    )
    graphs = [
        (decoder_layer_graph(mk.sym("B", max=64), cfg, torch.bfloat16), {"B": 40, "pages": 8}),
        (mlp_graph(mk.sym("T", max=512), 256, 512, torch.bfloat16, 64, 64, split_k=2), {"T": 300}),
        (mlp_graph(mk.sym("T", max=512), 256, 512, torch.bfloat16, 64, 64), {"T": 300}),
    ]
    for g, env in graphs:
        plan = instantiate(g, env)
        for node in g.nodes:
            coords = plan.coords_of(node.index)
            want = [node.op.order_key(tuple(c)) for c in coords.tolist()]
            got = node.op.order_key_array(coords)
            assert np.asarray(got).reshape(len(coords), -1).tolist() == [list(k) for k in want]


def test_idle_ties_put_the_small_tasks_on_the_sms_the_gemm_phases_leave_free(benchmark_script):
    """A decode step of the Qwen3-8B layer at one sequence (as ``benchmarks/schedule_view.py``
    builds it): every GEMM phase has 128 tiles on 132 SMs. Breaking ties by index leaves 4 SMs
    without a task and queues the q/k/v tail tiles in front of GEMM tiles; toward the SM free
    longest (``ties="idle"``), every SM gets work and some tail tiles go where no qkv_proj tile
    ran. Both schedules pass the check and the C and Python passes agree
    (tests/test_native.py)."""
    from cutemk.scheduling import check_static_schedule

    g, env, regime = benchmark_script("schedule_view")._decoder_graph(1)
    assert regime == "gemv_tail"
    plan = instantiate(g, env)
    nodes = [plan.tasks[t].node.name for t in range(plan.num_tasks)]
    by_index = StaticScheduler().build(plan, 132)
    idle = StaticScheduler(ties="idle").build(plan, 132)
    for sched in (by_index, idle):
        check_static_schedule(plan, sched, 132)
    assert sum(not q for q in by_index.queues) >= 4
    assert all(idle.queues)
    tail_alone = [q for q in idle.queues if q and nodes[q[0]].startswith("qk_norm_rope")]
    assert tail_alone  # a tail tile first on its SM: no qkv_proj tile before it
    with pytest.raises(ValueError, match="ties"):
        StaticScheduler(ties="random")


def test_a_policy_is_checked_whatever_way_it_comes(request):
    """A static instance with no ``build``, a registered class of mode "static" (a string), one
    that needs arguments, a nameless one: raw AttributeError / TypeError deep inside before."""
    from cutemk import registry
    from cutemk.registry import register_scheduler
    from cutemk.scheduling import SchedulingMode, resolve_scheduler

    for probe in ("probe_string_mode", "probe_needs_args"):  # registered below, gone after
        request.addfinalizer(lambda n=probe: registry._SCHEDULERS.pop(n, None))

    class NoBuild:
        mode, name = SchedulingMode.STATIC, "nobuild"

    with pytest.raises(ValueError, match=r"a static policy needs a build\(\) method"):
        resolve_scheduler(NoBuild())

    class NoOrder:
        mode, name = SchedulingMode.DYNAMIC, "noorder"

    with pytest.raises(ValueError, match=r"needs a initial_order\(\) method"):
        resolve_scheduler(NoOrder())

    @register_scheduler
    class StringMode:
        mode, name = "static", "probe_string_mode"

        def build(self, plan, num_sms):
            return StaticScheduler().build(plan, num_sms)

    with pytest.raises(ValueError, match="mode must be a SchedulingMode"):
        resolve_scheduler("probe_string_mode")

    @register_scheduler
    class NeedsArgs(StaticScheduler):
        name = "probe_needs_args"

        def __init__(self, depth):
            super().__init__()

    with pytest.raises(ValueError, match="built with no arguments"):
        resolve_scheduler("probe_needs_args")

    class Nameless:
        mode = SchedulingMode.STATIC

    with pytest.raises(TypeError, match="non-empty str"):
        register_scheduler(Nameless)


def test_schedules_of_non_int_task_ids_are_refused():
    """Float ids passed every check (the lowering truncated them); a string queue failed deep
    inside; a dynamic order of 2.9 or "3" was truncated or parsed by int()."""
    from cutemk.errors import ScheduleError
    from cutemk.scheduling import StaticSchedule, check_static_schedule, checked_initial_order

    _, p = _plan()
    good = StaticScheduler().build(p, 4)
    check_static_schedule(p, good, 4)
    floats = StaticSchedule(tuple(tuple(float(t) for t in q) for q in good.queues))
    with pytest.raises(ScheduleError, match="task ids that are float"):
        check_static_schedule(p, floats, 4)
    with pytest.raises(ScheduleError, match="sequence of task-id sequences"):
        check_static_schedule(p, StaticSchedule("abc"), 4)
    numpy_ids = StaticSchedule(tuple(tuple(np.int64(t) for t in q) for q in good.queues))
    check_static_schedule(p, numpy_ids, 4)  # numpy ints are ints

    class Floats(DynamicScheduler):
        def initial_order(self, plan):
            return [t + 0.9 for t in super().initial_order(plan)]

    with pytest.raises(ScheduleError, match="initial_order must be a list of task ids"):
        checked_initial_order(Floats(), p)


def test_a_schedule_of_numpy_queues_is_dumped(monkeypatch, tmp_path):
    """Numpy queues passed every check and ran, and failed only under ``CUTEMK_DUMP`` (numpy
    ints are not JSON)."""
    import json

    from cutemk.scheduling import StaticSchedule

    class NumpyQueues(StaticScheduler):
        def build(self, plan, num_sms):
            s = super().build(plan, num_sms)
            return StaticSchedule(tuple(np.asarray(q, dtype=np.int64) for q in s.queues))

    monkeypatch.setenv("CUTEMK_DUMP", str(tmp_path))
    g, _ = _plan()
    x = torch.randn(40, 64)
    w = {"w_gate_up": torch.randn(96, 64) / 8, "w_down": torch.randn(64, 48) / 8}
    g.compile("interpret", scheduler=NumpyQueues(), num_sms=4)(x, **w)
    (dumped,) = tmp_path.glob("*.schedule.json")
    assert sum(len(q) for q in json.loads(dumped.read_text())["queues"]) > 0
