"""Event derivation: automatic (from tile regions) and explicit (declared by the user)."""

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.layers import mlp_graph
from cutemk.plan import instantiate


def _labels(plan, tids):
    return sorted(plan.tasks[t].label for t in tids)


def test_gemm_to_silu_gets_one_event_per_row_block():
    T = mk.sym("T", max=64)
    g = mlp_graph(T, hidden=32, intermediate=24, block_m=8, block_n=16)
    plan = instantiate(g, {"T": 20})
    gemm_up, silu, down = (plan.node_tasks[i] for i in range(3))
    assert len(gemm_up) == 3 * 3 and len(silu) == 3 and len(down) == 3 * 2
    preds = plan.preds()
    # silu row block 1 waits for exactly the 3 gate_up tiles of row block 1, through one event
    s1 = silu[1]
    assert _labels(plan, preds[s1]) == ["gemm0[1, 0]", "gemm0[1, 1]", "gemm0[1, 2]"]
    assert len(plan.waits[s1]) == 1 and plan.event_count[plan.waits[s1][0]] == 3
    # both down tiles of row block 2 share the one event silu[2] notifies
    d = [t for t in down if plan.tasks[t].coord[0] == 2]
    assert plan.waits[d[0]] == plan.waits[d[1]]
    assert _labels(plan, preds[d[0]]) == ["silu_mul0[2, 0]"]
    assert plan.notifies[silu[2]] == plan.waits[d[0]]


def test_mismatched_block_sizes_still_cover_exact_producers():
    T = mk.sym("T", max=64)
    g = mk.Graph()
    x = g.input("x", (T, 16))
    w = g.weight("w", (16, 16))
    h = g.call(ops.gemm, x, w, block_m=8, block_n=16)
    y = g.call(ops.rmsnorm, h, g.weight("nw", (16,)), block_m=3)
    g.output(y)
    plan = instantiate(g, {"T": 16})
    preds = plan.preds()
    norm = plan.node_tasks[1]
    # rows [6, 9) straddle gemm row blocks 0 and 1
    assert _labels(plan, preds[norm[2]]) == ["gemm0[0, 0]", "gemm0[1, 0]"]
    assert _labels(plan, preds[norm[0]]) == ["gemm0[0, 0]"]


def _two_gemms():
    T = mk.sym("T", max=32)
    g = mk.Graph("explicit")
    x = g.input("x", (T, 8))
    h = g.call(ops.gemm, x, g.weight("w1", (16, 8)), block_m=4, block_n=8)
    y = g.call(ops.gemm, h, g.weight("w2", (8, 16)), block_m=4, block_n=8)
    g.output(y)
    return g, T, h, y


def test_explicit_event_adds_to_automatic_wiring():
    g, T, h, y = _two_gemms()
    ev = g.event(
        (mk.cdiv(T, 4),),
        count=2,
        name="rows",
        notify=[(h, lambda m, n: (m,))],
        wait=[(y, lambda m, n: (m,))],
    )
    assert isinstance(ev, mk.EventTensor)
    plan = instantiate(g, {"T": 12})
    explicit = [e for e in range(plan.num_events) if plan.event_label[e].startswith("rows")]
    assert len(explicit) == 3 and all(plan.event_count[e] == 2 for e in explicit)
    # the automatic events derived from the regions are still there
    assert plan.num_events > 3
    x, w1, w2 = torch.randn(12, 8), torch.randn(16, 8), torch.randn(8, 16)
    for sched in ("static", "dynamic"):
        out = g.compile("interpret", num_sms=3, scheduler=sched)(x, w1, w2)
        torch.testing.assert_close(out, (x @ w1.T) @ w2.T, rtol=1e-5, atol=1e-5)


def test_an_ordering_event_cannot_drop_a_data_dependency():
    """An explicit event on a producer -> consumer pair that orders only part of what the
    consumer reads: the automatic events still order the rest (it used to replace them, and
    the consumer then raced its producer)."""
    g, T, h, y = _two_gemms()
    g.event(
        (1,),
        name="first_tile",
        notify=[(h, lambda m, n: [(0,)] if (m, n) == (0, 0) else [])],
        wait=[(y, lambda m, n: [(0,)])],
    )
    plan = instantiate(g, {"T": 12})
    preds = plan.preds()
    h_tasks = set(plan.node_tasks[0])
    for t in plan.node_tasks[1]:  # each y tile still waits for every h tile of its rows
        m = plan.tasks[t].coord[0]
        rows = {u for u in h_tasks if plan.tasks[u].coord[0] == m}
        assert rows <= preds[t]
    x, w1, w2 = torch.randn(12, 8), torch.randn(16, 8), torch.randn(8, 16)
    for seed in range(5):
        out = g.compile("interpret", num_sms=4, scheduler="dynamic", seed=seed)(x, w1, w2)
        torch.testing.assert_close(out, (x @ w1.T) @ w2.T, rtol=1e-5, atol=1e-5)


def test_explicit_event_count_is_checked():
    g, T, h, y = _two_gemms()
    g.event(
        (mk.cdiv(T, 4),),
        count=3,
        name="rows",
        notify=[(h, lambda m, n: (m,))],
        wait=[(y, lambda m, n: (m,))],
    )
    with pytest.raises(
        mk.GraphError, match="waits for count 3 but 2 tasks notify it: would deadlock"
    ):
        instantiate(g, {"T": 12})


def test_explicit_event_out_of_range_index():
    g, T, h, y = _two_gemms()
    g.event(
        (mk.cdiv(T, 8),),
        name="rows",
        notify=[(h, lambda m, n: (m,))],
        wait=[(y, lambda m, n: (m // 2,))],
    )
    with pytest.raises(mk.GraphError, match="outside shape"):
        instantiate(g, {"T": 12})


def test_explicit_derived_count_and_env_map():
    g, T, h, y = _two_gemms()
    g.event((1,), name="all", notify=[(h, lambda m, n, env: (0,))], wait=[(y, lambda m, n: [(0,)])])
    plan = instantiate(g, {"T": 9})
    assert plan.event_label[0].startswith("all") and plan.event_count[0] == 3 * 2


def test_two_box_reads_wait_only_for_gate_and_up_columns():
    T = mk.sym("T", max=64)
    g = mk.Graph()
    x = g.input("x", (T, 16))
    h = g.call(ops.gemm, x, g.weight("w", (64, 16)), block_m=8, block_n=8)  # [gate | up], 32 each
    g.output(g.call(ops.silu_mul, h, block_m=8, block_n=8))
    plan = instantiate(g, {"T": 8})
    silu = plan.node_tasks[1]
    assert len(silu) == 4  # one row block x four column blocks
    preds = plan.preds()
    # column block 1 of the output needs gate columns [8, 16) and up columns [40, 48)
    assert _labels(plan, preds[silu[1]]) == ["gemm0[0, 1]", "gemm0[0, 5]"]


def test_count_zero_event_holds_nobody_back():
    """An element nobody notifies has a derived count of 0: complete from the start, so its
    waiter runs at once under both schedulers (and is an initial task of the dynamic queue)."""
    from cutemk.schedulers import DynamicScheduler

    N, M = mk.sym("N", max=64), mk.sym("M", max=64)
    g = mk.Graph("zero")
    ptr = g.input("deps_ptr", (N + 1,), torch.int32)
    idx = g.input("deps_idx", (M,), torch.int32)
    work = g.input("work", (N,), torch.int32)
    out = g.call(ops.synthetic_dag, ptr, idx, work)
    g.event(
        (N,),
        name="v",
        notify=[(out, lambda t: (t,) if t else None)],
        wait=[(out, lambda t: [(0,)] if t == 1 else [])],
    )
    g.output(out)
    deps = [[], [], []]
    plan = instantiate(g, {"N": 3, "M": 1})
    assert plan.event_count[plan.waits[1][0]] == 0
    assert DynamicScheduler().initial_order(plan) == [0, 1, 2]
    for sched in ("static", "dynamic"):
        res = g.compile("interpret", num_sms=2, scheduler=sched)(*ops.dag_inputs(deps))
        assert res.tolist() == [t * 7919 + 13 for t in range(3)]
