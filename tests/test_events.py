"""Event derivation: automatic (from tile regions) and explicit (declared by the user)."""

import re

import numpy as np
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


@pytest.mark.parametrize(
    "wait_map",
    [
        lambda m, n: np.int64(m),  # one 1-d index as a numpy scalar
        lambda m, n: (np.int32(m),),  # an index tuple of numpy ints
        lambda m, n: [np.array([m])],  # a list of index arrays
        lambda m, n: np.array([[m]]),  # an array of indices, one per row
        lambda m, n, env: np.unravel_index(m, (env["T"] // 4,)),  # numpy's own index tuple
    ],
    ids=["scalar", "tuple", "list_of_arrays", "array", "unravel_index"],
)
def test_index_maps_may_compute_with_numpy(wait_map):
    """numpy integers are ints to an index map (they raised a TypeError naming no event)."""
    g, T, h, y = _two_gemms()
    g.event(
        (mk.cdiv(T, 4),),
        name="rows",
        notify=[(h, lambda m, n: (np.int64(m),))],
        wait=[(y, wait_map)],
    )
    plan = instantiate(g, {"T": 12})
    for t in plan.node_tasks[1]:  # each y tile waits on its row's event, notified by 2 h tiles
        m = plan.tasks[t].coord[0]
        (e,) = [e for e in plan.waits[t] if plan.event_label[e].startswith("rows")]
        assert plan.event_label[e] == f"rows[{m}]" and plan.event_count[e] == 2


def test_a_tuple_of_index_tuples_is_several_indices():
    """``IndexMap`` allows any iterable of indices, a tuple of tuples included (it was
    refused once a tuple had to be one index)."""
    from cutemk.events import apply_map

    assert apply_map(lambda m: ((m,), (m + 1,)), (3,), {}) == [(3,), (4,)]
    assert apply_map(lambda m: ((0, m), (np.int64(1), m)), (3,), {}) == [(0, 3), (1, 3)]
    assert apply_map(lambda m: (m, np.int32(2)), (3,), {}) == [(3, 2)]
    assert apply_map(lambda m: (), (3,), {}) == [()]


def test_rank_maps_may_return_numpy_ranks():
    from cutemk.events import apply_rank_map

    env = {"RANK": 0, "WORLD": 2}
    assert apply_rank_map(lambda i: (np.int64(1), (np.int32(i),)), (3,), env) == [(1, (3,))]
    assert apply_rank_map(lambda i: [(np.int64(1), np.int64(i))], (3,), env) == [(1, (3,))]
    with pytest.raises(mk.GraphError, match=r"event e: the remote_wait map of x\[3\] returned"):
        apply_rank_map(lambda i: [(1.0, (i,))], (3,), env, "event e: the remote_wait map of x[3]")


@pytest.mark.parametrize(
    "wait_map, got",
    [(lambda m, n: (m / 1,), r"\(0\.0,\)"), (lambda m, n: [("0",)], r"\[\('0',\)\]")],
    ids=["float", "str"],
)
def test_index_map_returning_non_ints_is_named(wait_map, got):
    """A float index was truncated or raised a bare TypeError; the error names the event, the
    map, the task and what the map returned."""
    g, T, h, y = _two_gemms()
    g.event((mk.cdiv(T, 4),), name="rows", notify=[(h, lambda m, n: (m,))], wait=[(y, wait_map)])
    with pytest.raises(
        mk.GraphError, match=rf"event rows: the wait map of gemm1\[0, 0\] returned {got}"
    ):
        instantiate(g, {"T": 12})


@pytest.mark.parametrize("count", [2, np.int64(2), lambda idx, env: np.int32(2)])
def test_event_counts_may_be_numpy_ints(count):
    g, T, h, y = _two_gemms()
    g.event(
        (mk.cdiv(T, 4),),
        count=count,
        name="rows",
        notify=[(h, lambda m, n: (m,))],
        wait=[(y, lambda m, n: (m,))],
    )
    plan = instantiate(g, {"T": 12})
    rows = [e for e in range(plan.num_events) if plan.event_label[e].startswith("rows")]
    assert [plan.event_count[e] for e in rows] == [2, 2, 2]


@pytest.mark.parametrize("bad", [2.5, 2.0, "2", True])
def test_fractional_or_non_int_counts_are_refused_by_event(bad):
    """A count function's 2.5 was truncated to 2 (and "2" parsed): counts are ints (numpy ints
    too); floats are refused even when integral, as a constant ``count=2.0`` always was."""
    g, T, h, y = _two_gemms()
    g.event(
        (mk.cdiv(T, 4),),
        count=lambda idx, env: bad,
        name="rows",
        notify=[(h, lambda m, n: (m,))],
        wait=[(y, lambda m, n: (m,))],
    )
    with pytest.raises(
        mk.GraphError,
        match=rf"event rows: count at \[0\] must be an int .*, got {re.escape(repr(bad))}$",
    ):
        instantiate(g, {"T": 12})
    with pytest.raises(TypeError, match="event rows: count must be an int"):
        mk.EventTensor((4,), bad, "rows")


def test_an_events_declaration_is_checked_where_it_is_made():
    """Bad entries, maps and shapes failed deep inside planning (``cannot unpack``, ``'tuple'
    object is not callable``, ZeroDivisionError) or not at all (a negative dim, a sym no input
    declares); they are named at ``g.event``."""
    g, T, h, y = _two_gemms()
    rows = lambda m, n: (m,)  # noqa: E731
    bad = [
        (dict(shape=(2,), notify=(h, rows), wait=[(y, rows)]), "each notify entry is a"),
        (dict(shape=(2,), notify=[(h, (0,))], wait=[(y, rows)]), "notify map of gemm0 must be a"),
        (dict(shape=(2,), notify=[(h, lambda m: (m,))], wait=[(y, rows)]), "must take 2 arg"),
        (dict(shape=(2,), notify=[(h, rows)], wait=[(y, rows)], count=lambda i: 1), "count"),
        (dict(shape=3, notify=[(h, rows)], wait=[(y, rows)]), "shape must be a tuple"),
        (dict(shape=(3.0,), notify=[(h, rows)], wait=[(y, rows)]), r"shape\[0\] must be an int"),
        (dict(shape=(-1,), notify=[(h, rows)], wait=[(y, rows)]), "must not be negative"),
        (dict(shape=(True,), notify=[(h, rows)], wait=[(y, rows)]), r"shape\[0\] must be an int"),
        (dict(shape=(2,), notify=[(h, rows)], wait=[(y, rows)], name=""), "non-empty str"),
    ]
    for kwargs, match in bad:
        with pytest.raises(mk.GraphError, match=match):
            g.event(**kwargs)
    x = g.values[0]  # an input: no node produced it
    with pytest.raises(mk.GraphError, match="event ord: a notify entry: expected a value produced"):
        g.event((2,), name="ord", notify=[(x, rows)], wait=[(y, rows)])
    with pytest.raises(ZeroDivisionError, match="by 0"):
        T // 0
    with pytest.raises(ZeroDivisionError, match="cdiv of 5 by 0"):
        mk.cdiv(5, 0)


def test_an_event_shape_uses_the_graphs_own_syms():
    g, T, h, y = _two_gemms()
    g.event((mk.sym("Q", max=4),), notify=[(h, lambda m, n: 0)], wait=[(y, lambda m, n: 0)])
    with pytest.raises(mk.GraphError, match="uses sym Q, which no input or weight"):
        g.validate()
    g2, T2, h2, y2 = _two_gemms()
    other_t = mk.sym("T", max=8)  # the graph's name, other bounds
    g2.event((other_t,), notify=[(h2, lambda m, n: 0)], wait=[(y2, lambda m, n: 0)])
    with pytest.raises(mk.GraphError, match=r"uses sym T \(max 8\).*with those bounds"):
        g2.validate()


def test_a_map_cannot_change_the_plans_dims():
    """The maps got the plan's own dict: a write changed the dims of a cached plan (NaN
    output, no error)."""
    g, T, h, y = _two_gemms()

    def writes(m, n, env):
        env["T"] = 4
        return (0,)

    g.event((1,), notify=[(h, writes)], wait=[(y, lambda m, n: (0,))])
    with pytest.raises(TypeError, match="does not support item assignment"):
        instantiate(g, {"T": 8})


def test_a_dim_bound_to_a_float_or_a_string_is_refused():
    T = mk.sym("T", max=64)
    for v in (2.7, "3", True):
        with pytest.raises(mk.ShapeError, match="is bound to"):
            (T + 1).eval({"T": v})
    assert (T + 1).eval({"T": np.int64(3)}) == 4
