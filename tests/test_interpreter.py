"""The interpreter backend: MoE and MLP graphs vs plain torch, deadlock and race detection."""

import dataclasses

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.layers import MoeConfig, mlp_graph, mlp_reference, moe_graph, moe_reference
from cutemk.tileop import TensorSpec

CFG = MoeConfig(hidden=64, intermediate=32, num_experts=8, top_k=2, block_m=16, block_n=32)


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def moe_weights(cfg, gen):
    e, h, i = cfg.num_experts, cfg.hidden, cfg.intermediate
    return dict(
        w_router=torch.randn(e, h, generator=gen),
        w_gate_up=torch.randn(e, 2 * i, h, generator=gen) / h**0.5,
        w_down=torch.randn(e, h, i, generator=gen) / i**0.5,
    )


@pytest.fixture(scope="module")
def moe():
    T = mk.sym("T", max=512)
    return moe_graph(T, CFG)


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_moe_built_once_runs_every_token_count(moe, scheduler):
    gen = torch.Generator().manual_seed(1)
    w = moe_weights(CFG, gen)
    c = moe.compile("interpret", num_sms=8, scheduler=scheduler, seed=3)
    for t in (1, 7, 64, 300):
        x = torch.randn(t, CFG.hidden, generator=gen)
        y = c(x, **w)
        assert y.shape == (t, CFG.hidden)
        assert rel_err(y, moe_reference(x, **w, top_k=CFG.top_k)) < 1e-5
        # grouped tiles that do not exist at this routing are skipped: per missing row tile, its
        # permute tile, the gate/up column blocks (I / block_n) and the down ones (H / block_n)
        ids = torch.topk(x @ w["w_router"].T, CFG.top_k, dim=-1).indices
        counts = torch.bincount(ids.flatten(), minlength=CFG.num_experts)
        tiles = int(((counts + CFG.block_m - 1) // CFG.block_m).sum())
        max_tiles = (t * CFG.top_k) // CFG.block_m + min(CFG.num_experts, t * CFG.top_k)
        per_tile = 1 + -(-CFG.intermediate // CFG.block_n) + -(-CFG.hidden // CFG.block_n)
        assert c.last_report.skipped == per_tile * (max_tiles - tiles)
    assert len(c._plans) == 4  # one instantiation per token count, one graph


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_all_tokens_to_one_expert_and_an_empty_expert(scheduler, top_k):
    cfg = MoeConfig(hidden=64, intermediate=32, num_experts=8, top_k=top_k, block_m=16, block_n=32)
    g = moe_graph(mk.sym("T", max=512), cfg)
    gen = torch.Generator().manual_seed(2)
    w = moe_weights(cfg, gen)
    # column 0 of x is a constant 4: it pushes every token to expert 3 and away from expert 5
    w["w_router"][:, 0] = 0.0
    w["w_router"][3, 0] = 25.0
    w["w_router"][5, 0] = -25.0
    c = g.compile("interpret", num_sms=5, scheduler=scheduler)
    for t in (7, 64, 300):
        x = torch.randn(t, cfg.hidden, generator=gen)
        x[:, 0] = 4.0
        ids = torch.topk(x @ w["w_router"].T, top_k, dim=-1).indices
        assert bool((ids[:, 0] == 3).all()) and not bool((ids == 5).any())
        y = c(x, **w)
        assert rel_err(y, moe_reference(x, **w, top_k=top_k)) < 1e-5


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("fuse", [False, True])
def test_mlp_matches_torch(scheduler, fuse):
    g = mlp_graph(
        mk.sym("T", max=256), hidden=64, intermediate=48, block_m=8, block_n=16, fuse_silu=fuse
    )
    c = g.compile("interpret", num_sms=4, scheduler=scheduler)
    gen = torch.Generator().manual_seed(4)
    wgu, wd = torch.randn(96, 64, generator=gen) / 8, torch.randn(64, 48, generator=gen) / 7
    for t in (1, 13, 200):
        x = torch.randn(t, 64, generator=gen)
        assert rel_err(c(x, wgu, wd), mlp_reference(x, wgu, wd)) < 1e-5


def _mlp_compiled(scheduler, t=24):
    g = mlp_graph(mk.sym("T", max=64), hidden=32, intermediate=24, block_m=8, block_n=16)
    c = g.compile("interpret", num_sms=3, scheduler=scheduler, seed=5)
    args = (torch.randn(t, 32), torch.randn(48, 32), torch.randn(32, 24))
    return c, c.plan({"T": t}), args


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_deleted_wait_is_caught_as_race(scheduler):
    c, plan, args = _mlp_compiled(scheduler)
    silu1 = plan.node_tasks[1][1]
    plan.waits[silu1].clear()  # silu_mul0[1] no longer waits for the gate_up tiles of row 1
    with pytest.raises(mk.RaceError, match=r"task silu_mul0\[1, 0\] reads gemm0.c"):
        c(*args)


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_deleted_notify_is_caught_as_deadlock(scheduler):
    c, plan, args = _mlp_compiled(scheduler)
    producer = plan.node_tasks[0][4]  # gemm0[1, 1]
    e = plan.notifies[producer].pop()
    with pytest.raises(
        mk.DeadlockError,
        match=r"task silu_mul0\[1, 0\].* waits on event gemm0->silu_mul0#1: "
        r"expected count 3, seen 2",
    ):
        c(*args)
    assert plan.event_label[e] == "gemm0->silu_mul0#1"


def test_schedule_report():
    c, plan, args = _mlp_compiled("static")
    c(*args)
    rep = c.last_report
    assert rep.num_tasks == plan.num_tasks
    assert sum(len(q) for q in rep.per_sm) == plan.num_tasks
    assert rep.makespan_us >= rep.critical_path_us > 0
    assert rep.critical_path[0].startswith("gemm0") and rep.critical_path[-1].startswith("gemm1")
    assert "static scheduler on 3 SMs" in rep.summary()


def test_random_interleavings_agree():
    g = moe_graph(mk.sym("T", max=128), CFG)
    gen = torch.Generator().manual_seed(9)
    w = moe_weights(CFG, gen)
    x = torch.randn(50, CFG.hidden, generator=gen)
    outs = [
        g.compile("interpret", num_sms=n, scheduler=s, seed=seed)(x, **w)
        for n, s, seed in ((1, "static", 0), (7, "dynamic", 1), (13, "dynamic", 2))
    ]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=0)


def test_expert_ids_out_of_range_are_a_clear_error():
    """Expert ids from a graph input outside [0, E): the interpreter names the id and where it
    is (it used to fail inside torch.bincount or with a raw IndexError)."""
    T = mk.sym("T", max=64)
    g = mk.Graph("route")
    ids = g.input("ids", (T, 2), torch.int32)
    tile_info, _, _, _ = g.call(ops.moe_route, ids, num_experts=8, block_m=4)
    g.output(tile_info, "tile_info")
    c = g.compile("interpret", num_sms=2)
    good = torch.stack([torch.randperm(8)[:2] for _ in range(5)]).to(torch.int32)
    c(good)
    for bad_value in (8, -2):
        bad = good.clone()
        bad[3, 1] = bad_value
        with pytest.raises(mk.DataError, match=rf"expert id {bad_value} at ids\[3, 1\]"):
            c(bad)
    # a token that names one expert twice breaks the op's distinct-ids precondition
    dup = good.clone()
    dup[2] = 5
    with pytest.raises(mk.DataError, match="token 2 names an expert twice"):
        c(dup)


def test_no_expert_ids_get_no_row():
    """-1 is top-k's "no expert" (a row with fewer than k usable logits): no row, slot -1."""
    g = mk.Graph("route")
    ids = g.input("ids", (mk.sym("T", max=64), 2), torch.int32)
    tile_info, row_token, slot_row, indptr = g.call(ops.moe_route, ids, num_experts=8, block_m=4)
    g.output(tile_info, "tile_info")
    g.output(slot_row, "slot_row")
    g.output(indptr, "indptr")
    c = g.compile("interpret", num_sms=2)
    ids_in = torch.tensor([[3, -1], [3, 5], [-1, -1]], dtype=torch.int32)
    tile_info, slot_row, indptr = c(ids_in)
    assert slot_row.tolist() == [[0, -1], [1, 4], [-1, -1]]  # expert 3: rows 0-1; 5: tile 1
    assert indptr.tolist() == [0, 0, 0, 0, 2, 2, 3, 3, 3]
    assert tile_info[:2].tolist() == [[3, 2], [5, 1]] and (tile_info[2:, 0] == -1).all()


def test_a_dependency_missing_from_the_events_is_a_race_even_within_one_op():
    """Synthetic DAG tiles read other tiles' results of the same op; those reads are declared,
    so an event map that drops one dependency is a RaceError (it used to run unchecked and give
    wrong results in most interleavings)."""
    deps = [[], [0], [0, 1], [2], [1, 3]]
    dropped = [[], [0], [0], [2], [1, 3]]  # task 2 no longer waits for task 1
    N, M = mk.sym("N", max=64), mk.sym("M", max=256)
    full = ops.dag_inputs(deps)
    ok = ops.dag_graph(deps, N, M).compile("interpret", num_sms=3, scheduler="dynamic")
    ok(*full)
    bad = ops.dag_graph(dropped, N, M)
    with pytest.raises(mk.RaceError, match=r"synthetic_dag\w*\[2\] reads"):
        for seed in range(20):
            bad.compile("interpret", num_sms=3, scheduler="dynamic", seed=seed)(*full)


def test_nan_router_rows_give_nan_tokens_and_leave_the_rest_exact():
    """A token whose router logits are NaN (a NaN in its hidden state reaches every logit; top-k
    then finds no expert: ids -1, no rows) comes out NaN, as in HF/torch; the others are exact."""
    gen = torch.Generator().manual_seed(4)
    w = moe_weights(CFG, gen)
    c = moe_graph(mk.sym("T", max=64), CFG).compile("interpret", num_sms=4, seed=2)
    x = torch.randn(9, CFG.hidden, generator=gen)
    x[4, 7] = float("nan")
    y = c(x, **w)
    assert torch.isnan(y[4]).all()
    keep = torch.arange(9) != 4
    ref = moe_reference(x[keep], **w, top_k=CFG.top_k)
    assert rel_err(y[keep], ref) < 1e-5


def test_top_k_never_picks_a_nan_logit():
    """One NaN logit: never picked, the token's weights NaN (softmax over a NaN row)."""
    op = ops.topk_softmax(TensorSpec((mk.sym("T", max=8), 6), torch.float32), k=3)
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [[1.0, 2.0, nan, 2.0, -inf, 0.0], [nan] * 6, [1.0, nan, nan, nan, nan, -inf]]
    )
    t = {
        "logits": logits,
        "weights": torch.zeros(3, 3),
        "ids": torch.zeros(3, 3, dtype=torch.int32),
    }
    op.reference((0,), {"T": 3}, t)
    assert t["ids"].tolist() == [[1, 3, 0], [-1, -1, -1], [0, 5, -1]]
    assert torch.isnan(t["weights"]).all()


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("case", range(6))
def test_random_dags_with_one_dependency_dropped(scheduler, case):
    """Random DAGs whose task graph drops one dependency the data still has: a RaceError
    unless the dropped edge is implied through other dependencies, in which case the launch
    is race-free and exact."""
    import random

    from cutemk.interpret import RaceError

    rng = random.Random(100 + case)
    n = rng.randint(6, 24)
    deps = [sorted(rng.sample(range(t), min(t, rng.randint(0, 3)))) for t in range(n)]
    victim = rng.choice([t for t in range(n) if deps[t]])
    gone = rng.choice(deps[victim])
    dropped = [list(d) for d in deps]
    dropped[victim].remove(gone)
    ancestors: list[set[int]] = []  # of each task, through the dropped graph's edges
    for t in range(n):
        ancestors.append(set(dropped[t]).union(*(ancestors[d] for d in dropped[t])))
    implied = gone in ancestors[victim]
    N, M = mk.sym("N", max=64), mk.sym("M", max=256)
    full = ops.dag_inputs(deps)
    expected = ops.dag_graph(deps, N, M).compile("interpret", num_sms=3)(*full)
    bad = ops.dag_graph(dropped, N, M)
    raised = None
    for seed in range(20):
        try:
            out = bad.compile("interpret", num_sms=3, scheduler=scheduler, seed=seed)(*full)
        except RaceError as e:
            raised = e
            break
        assert torch.equal(out, expected)
    if implied:
        assert raised is None
    else:
        assert raised is not None and f"[{victim}] reads" in str(raised)


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("router_dtype", [torch.float32, None], ids=["fp32", "model-dtype"])
def test_moe_router_split_along_k(scheduler, router_dtype):
    """The router as split-K partials summed by the top-k (no reduce phase): the same routing
    and output as whole rows, with the sums rounded to bf16 where the logits are bf16."""
    cfg = MoeConfig(
        hidden=256,
        intermediate=32,
        num_experts=8,
        top_k=2,
        block_m=16,
        block_n=32,
        router_split=4,
        router_dtype=router_dtype,
    )
    dtype = torch.bfloat16 if router_dtype is None else torch.float32
    g = moe_graph(mk.sym("T", max=64), cfg, dtype)
    names = [n.op.name for n in g.nodes]
    assert names[:2] == ["gemm_partial", "topk_softmax"], names
    gen = torch.Generator().manual_seed(21)
    w = {n: v.to(dtype) for n, v in moe_weights(cfg, gen).items()}
    c = g.compile("interpret", num_sms=8, scheduler=scheduler, seed=5)
    for t in (1, 5, 64):
        x = torch.randn(t, cfg.hidden, generator=gen).to(dtype)
        y = c(x, **w)
        ref = moe_reference(x, **w, top_k=cfg.top_k, router_dtype=router_dtype)
        assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_topk_over_partials_sums_then_rounds():
    """Summed in split order in fp32 and rounded to ``logits_dtype``: the picks follow the
    rounded sums (two experts whose fp32 sums differ but round to one bf16 tie to the lower id)."""
    T = mk.sym("T", max=8)
    op = ops.topk_softmax(
        TensorSpec((3, T, 4), torch.float32), k=2, block_m=8, logits_dtype=torch.bfloat16
    )
    part = torch.zeros(3, 2, 4)
    part[:, 0] = torch.tensor([[0.5, 1.0, 0.25, 0.0], [0.5, 1.0, 0.25, 0.0], [0.0, 0.0, 1.5, 2.0]])
    part[0, 1] = torch.tensor([1.0, 1.0 + 2**-10, -1.0, 0.0])  # 1 + 2^-10 rounds to 1 in bf16
    t = {
        "logits": part,
        "weights": torch.full((2, 2), float("nan")),
        "ids": torch.full((2, 2), -7, dtype=torch.int32),
    }
    op.reference((0,), {"T": 2}, t)
    # token 0: sums [1, 2, 2, 2] -> ties at 2 go to the lower ids 1, 2
    assert t["ids"][0].tolist() == [1, 2]
    assert t["ids"][1].tolist() == [0, 1]  # rounded to a tie: the lower id first
    assert torch.allclose(t["weights"][1], torch.tensor([0.5, 0.5]))
    assert op.reads((0,), {"T": 2})["logits"] == ((0, 3), (0, 2), (0, 4))


def test_topk_partials_are_checked():
    T = mk.sym("T", max=8)
    with pytest.raises(TypeError, match="partial logits must have dtype"):
        ops.topk_softmax(TensorSpec((2, T, 8), torch.bfloat16), k=2)
    with pytest.raises(ValueError, match="logits_dtype"):
        ops.topk_softmax(TensorSpec((T, 8), torch.float32), k=2, logits_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="logits_dtype"):
        ops.topk_softmax(TensorSpec((2, T, 8), torch.float32), k=2, logits_dtype=torch.int32)


@pytest.mark.parametrize("fused", [False, True], ids=["combine", "fused_combine"])
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("max_t", [1, 2])
def test_moe_slot_layout_matches_torch(scheduler, max_t, fused):
    """``MoeConfig.slots``: the grouped GEMMs on the top-k's ids (no route, no permute): the
    same output as the reference, one tile per (token, pick), and a NaN logit row (fewer usable
    experts than picks: id -1) only makes that token NaN. ``fused_combine``: no combine node,
    the down tiles of every pick exist (a pick without an expert contributes NaN) and the last
    of a token's picks sums them."""
    cfg = MoeConfig(
        hidden=64,
        intermediate=32,
        num_experts=8,
        top_k=2,
        block_m=16,
        block_n=32,
        slots=True,
        fused_combine=fused,
    )
    g = moe_graph(mk.sym("T", max=max_t), cfg)
    names = [n.op.name for n in g.nodes]
    assert "moe_route" not in names and "moe_permute" not in names, names
    assert ("moe_combine" in names) != fused, names
    gen = torch.Generator().manual_seed(23)
    w = moe_weights(cfg, gen)
    c = g.compile("interpret", num_sms=5, scheduler=scheduler, seed=4)
    for t in range(1, max_t + 1):
        x = torch.randn(t, cfg.hidden, generator=gen)
        y = c(x, **w)
        assert rel_err(y, moe_reference(x, **w, top_k=cfg.top_k)) < 1e-5
        assert c.last_report.skipped == 0
    # every logit NaN but expert 0's: each token's second pick is "no expert" (-1), its tiles
    # do not exist and the token's output is NaN
    w["w_router"][1:, 0] = float("nan")
    y = c(torch.randn(max_t, cfg.hidden, generator=gen), **w)
    assert torch.isnan(y).all()
    per_tile = -(-cfg.intermediate // cfg.block_n) + -(-cfg.hidden // cfg.block_n) * (not fused)
    assert c.last_report.skipped == per_tile * max_t  # one pick of each token has no expert
    y = c(torch.randn(max_t, cfg.hidden, generator=gen), **moe_weights(cfg, gen))
    assert not torch.isnan(y).any()  # the counters were left at zero: good data is right again


def test_moe_slot_layout_refuses_too_many_tokens():
    cfg = MoeConfig(64, 32, 8, 2, block_m=16, block_n=32, slots=True)
    with pytest.raises(mk.ShapeError, match="expert_rows"):
        moe_graph(mk.sym("T", max=17), cfg)


def test_moe_slot_gemm_refuses_ids_of_another_expert_count():
    g = mk.Graph("slot_mismatch")
    x = g.input("x", (mk.sym("T", max=1), 64))
    logits = g.call(ops.gemm, x, g.weight("wr", (8, 64)), block_m=16, block_n=8)
    _, ids = g.call(ops.topk_softmax, logits, k=2)
    w = g.weight("w_gate_up", (4, 64, 64))  # 4 experts, the top-k picks among 8
    act = g.call(ops.moe_slot_gemm, x, w, ids, block_m=16, block_n=32, epilogue="silu_mul")
    g.output(act, "act")
    with pytest.raises(mk.GraphError, match="top-k over 8"):
        g.validate()


def test_moe_combine_refuses_a_slot_layout_it_does_not_match():
    """The combine's slot rows must be its grouped GEMM's: the same block_m and experts (a
    larger block_m would read past the rows, other experts would read tiles that never ran)."""
    T = mk.sym("T", max=2)
    rows = TensorSpec((T * 2 * 16, 64), torch.float32)
    weights, ids = TensorSpec((T, 2), torch.float32), TensorSpec((T, 2), torch.int32)
    with pytest.raises(mk.ShapeError, match="slot_block_m"):
        ops.moe_combine(rows, weights, ids, slot_block_m=32, num_experts=8)
    g = moe_graph(T, MoeConfig(64, 32, 8, 2, block_m=16, block_n=32, slots=True))
    comb = g.nodes[-1]
    gemm = comb.args["rows"].producer.op
    bad = dataclasses.replace(comb.op, num_experts=4)
    with pytest.raises(mk.GraphError, match="over 4 experts"):
        bad.check_producers({"rows": gemm})


def _scale_graph(op_cls, t_max=16):
    """x (T, 8) -> op_cls (an ``ops.AddTile`` variant, planned through its per-tile methods
    unless it keeps ``region_arrays``) -> an add that reads its output."""
    T = mk.sym("T", max=t_max)
    g = mk.Graph("custom")
    x = g.input("x", (T, 8))
    y = g.call(op_cls(x.spec, x.spec), x, x)
    g.output(g.call(ops.add, y, x), "z")
    return g


def _variant(**methods):
    """An ``ops.AddTile`` subclass overriding ``methods`` (per-tile planning: no arrays)."""
    cls = type("Variant", (ops.AddTile,), {"region_arrays": lambda *a: None, **methods})
    return dataclasses.dataclass(frozen=True)(cls)


def test_a_custom_ops_regions_grid_and_costs_are_checked():
    """A box outside its tensor (numpy would clip it, or wrap a negative bound, and the race
    checker would look at the wrong elements), a backwards box, a grid that is no tuple, a
    reads() that returns None, region arrays of floats and costs that are NaN, negative or one
    short are GraphErrors naming the op, not a silent run or an AttributeError inside."""
    import numpy as np

    def box(lo, hi, cols=8):  # tile 0's rows (lo, hi); the next tiles' follow
        return lambda self, coord, env, data=None: {
            "out": ((lo + 4 * coord[0], hi + 4 * coord[0]), (0, cols))
        }

    def rows(lo, hi):
        return lambda self, coord, env, data=None: {"a": ((lo, hi), (0, 8)), "b": ((0, 1), (0, 8))}

    cases = [
        (_variant(writes=box(0, 4, cols=11)), r"writes\(\) of out: the box .* dim 1 \[0, 11\)"),
        (_variant(reads=rows(-4, 5)), r"reads\(\) of a: the box .* dim 0 \[-4, 5\)"),
        (_variant(reads=rows(0, 104)), r"dim 0 \[0, 104\), not inside \[0, 5\]"),
        (_variant(writes=box(4, 0)), r"dim 0 \[4, 0\)"),
        (_variant(writes=box(0, mk.sym("T", max=16))), "bounds must be ints"),
        (_variant(reads=lambda self, coord, env, data=None: None), r"reads\(\) must return a dict"),
        (_variant(grid=lambda self: 2), r"grid\(\) \(node add0\) must be a tuple"),
        (_variant(grid=lambda self: (2.0,)), r"must be a tuple of ints and symbolic dims"),
        (_variant(cost=lambda self, coord, env: float("nan")), r"add.cost\(\) .* cost nan"),
        (_variant(cost=lambda self, coord, env: -1.0), r"task 0 the cost -1.0"),
        (_variant(cost=lambda self, coord, env: None), r"task 0 the cost None"),
        (
            _variant(cost_array=lambda self, env, coords: np.ones(len(coords) - 1)),
            r"cost_array\(\) \(node add0\) gave 1 costs for 2 tasks",
        ),
        (
            _variant(
                region_arrays=lambda self, which, env, coords: {
                    "out": np.zeros((len(coords), 2, 2))
                }
            ),
            r"region_arrays\('writes'\) gives out float64, not an int numpy array",
        ),
    ]
    for cls, msg in cases:
        c = _scale_graph(cls).compile("interpret", num_sms=2)
        with pytest.raises(mk.GraphError, match=msg):
            c(torch.randn(5, 8))


def test_a_reference_that_rebinds_a_tensor_is_refused():
    """``t["out"] = ...`` in a reference used to leave the graph's buffer NaN (and hand the new
    tensor to the node's later tiles) without an error; a name the op lacks says which it has."""

    def rebinds(self, coord, env, t):
        t["out"] = t["a"] + t["b"]

    def misnamed(self, coord, env, t):
        t["outt"][:] = 0

    c = _scale_graph(_variant(reference=rebinds)).compile("interpret", num_sms=2)
    with pytest.raises(mk.CuteMKError, match=r"add: a tile assigned t\['out'\]; write .* in place"):
        c(torch.randn(5, 8))
    c = _scale_graph(_variant(reference=misnamed)).compile("interpret", num_sms=2)
    with pytest.raises(KeyError, match=r"add has no tensor 'outt'; its tensors are \['a', 'b'"):
        c(torch.randn(5, 8))
    ok = _scale_graph(_variant()).compile("interpret", num_sms=2)
    x = torch.randn(5, 8)
    torch.testing.assert_close(ok(x), 3 * x)


def test_plan_dims_are_checked_before_the_cache():
    """``plan({"T": 5.0})`` found the cached T=5 plan once T=5 had run (and ``True`` T=1's); a
    list of pairs gave a raw AttributeError."""
    import cutemk as mk
    from cutemk.layers import mlp_graph

    g = mlp_graph(mk.sym("T", max=64), 32, 48, block_m=8, block_n=16)
    c = g.compile("interpret")
    c.plan({"T": 5})
    with pytest.raises(mk.ShapeError, match="must be an int"):
        c.plan({"T": 5.0})
    with pytest.raises(mk.ShapeError, match="must be an int"):
        c.plan({"T": True})
    with pytest.raises(TypeError, match="a dict of sym name"):
        c.plan([("T", 5)])


def test_a_launch_summary_needs_its_sm_count():
    from cutemk.trace import launch_summary

    for bad in (0, -1, None, 2.0):
        with pytest.raises(ValueError, match="num_sms must be a positive int"):
            launch_summary([], [], bad)


def _grouped_gemm_graph(expert_rows, distinct=True, tokens=16):
    g = mk.Graph("expert_rows")
    t = mk.sym("T", max=tokens)
    x = g.input("x", (t, 32))
    ids = g.input("ids", (t, 2), torch.int32)
    tile_info, row_token, _, _ = g.call(
        ops.moe_route, ids, num_experts=4, block_m=16, distinct_ids=distinct
    )
    return _experts_on(g, x, tile_info, row_token, expert_rows)


def _experts_on(g, x, tile_info, row_token, expert_rows):
    """``g`` with x permuted into a route's layout and one grouped GEMM over 4 experts (16-row
    tiles) as its output."""
    xp = g.call(ops.moe_permute, x, tile_info, row_token, block_m=16)
    w = g.weight("w", (4, 32, 32))
    kw = dict(block_m=16, block_n=32, expert_rows=expert_rows)
    g.output(g.call(ops.moe_grouped_gemm, xp, w, tile_info, **kw), "y")
    return g


def test_grouped_gemm_refuses_expert_rows_below_what_routing_can_give():
    """Below block_m the Hopper tile's A box holds expert_rows rows: fewer than the tokens (or
    tokens x top-k for ids that may repeat) would drop rows silently."""
    _grouped_gemm_graph(16).validate()
    with pytest.raises(mk.GraphError, match="expert_rows=8 is below the 16 rows"):
        _grouped_gemm_graph(8).validate()
    _grouped_gemm_graph(4, tokens=4).validate()
    with pytest.raises(mk.GraphError, match="below the 8 rows .* x top-k"):
        _grouped_gemm_graph(4, distinct=False, tokens=4).validate()


def test_grouped_gemm_interpreter_refuses_more_rows_than_expert_rows():
    """A split route takes ids that repeat; an expert given more rows than the grouped GEMM's
    expert_rows is a DataError in the interpreter, not rows the device would not load."""
    g = mk.Graph("split_rows")
    t = mk.sym("T", max=4)
    x = g.input("x", (t, 32))
    ids = g.input("ids", (t, 2), torch.int32)
    counts = g.call(ops.moe_route_count, ids, num_experts=4, chunk=64)
    tile_info, _, base = g.call(
        ops.moe_route_layout, counts, num_experts=4, block_m=16, tokens=t, top_k=2
    )
    row_token, _ = g.call(
        ops.moe_route_place, ids, base, tile_info, num_experts=4, block_m=16, chunk=64
    )
    c = _experts_on(g, x, tile_info, row_token, 4).compile("interpret", num_sms=2)
    w = torch.randn(4, 32, 32)
    ok = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=torch.int32)
    c(torch.randn(4, 32), ok, w)
    same = torch.tensor([[1, 1], [1, 1], [1, 1], [2, 1]], dtype=torch.int32)  # 7 rows of expert 1
    with pytest.raises(mk.DataError, match="holds 7 rows, more than expert_rows=4"):
        c(torch.randn(4, 32), same, w)
