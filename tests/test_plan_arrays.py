"""Planning with the ops' array forms (``TileOp.region_arrays`` / ``cost_array``) gives the
same plan as the per-tile methods: every op's arrays equal its per-tile boxes and costs, and
the instantiated plans have the same waits, notifies, event counts and labels, over the MLP and
MoE graphs at several token counts and tile shapes. It also has to be faster."""

import time

import numpy as np
import pytest
import torch

import cutemk as mk
import cutemk.plan as plan_mod
from cutemk import ops
from cutemk.layers import MoeConfig, mlp_graph, moe_graph
from cutemk.plan import instantiate, no_gc
from cutemk.regions import grid_coords as _grid_coords
from cutemk.regions import node_regions


def _graphs():
    t = mk.sym("T", max=4096)
    yield "mlp", mlp_graph(t, 256, 512, torch.bfloat16, block_m=64, block_n=64)
    yield "mlp_fused", mlp_graph(t, 256, 512, torch.bfloat16, 128, 64, fuse_silu=True)
    for chunk in (None, 64):
        cfg = MoeConfig(512, 256, 16, 4, block_m=64, block_n=64, route_chunk=chunk)
        yield f"moe_chunk{chunk}", moe_graph(t, cfg, torch.bfloat16)
    cfg = MoeConfig(64, 32, 8, 2, block_m=16, block_n=32, combine_block_m=3)
    yield "moe_small", moe_graph(t, cfg)
    g = mk.Graph("norm_gemm_residual")
    x = g.input("x", (t, 256), torch.bfloat16)
    w = g.weight("w", (256, 256), torch.bfloat16)
    nw = g.weight("nw", (256,), torch.bfloat16)
    y = g.call(ops.rmsnorm, x, nw, block_m=8)
    g.output(g.call(ops.gemm, y, w, x, block_m=64, block_n=128), "out")
    yield "norm_gemm_residual", g


CASES = list(_graphs())


@pytest.mark.parametrize("name,graph", CASES, ids=[n for n, _ in CASES])
@pytest.mark.parametrize("tokens", [1, 37, 1000])
def test_op_arrays_equal_per_tile_regions(name, graph, tokens):
    env = {"T": tokens}
    for node in graph.nodes:
        op = node.op
        grid = tuple(int(d if isinstance(d, int) else d.eval(env)) for d in op.grid())
        coords = _grid_coords(grid)
        costs = op.cost_array(env, coords)
        if costs is not None:
            want = [op.cost(tuple(c), env) for c in coords.tolist()]
            assert np.allclose(costs, want), f"{name} {node.name}: costs"
        for which in ("reads", "writes"):
            arrays = op.region_arrays(which, env, coords)
            if arrays is None:
                continue
            for i, c in enumerate(coords.tolist()):
                regions = node_regions(node, which, tuple(c), env)
                assert set(regions) == set(arrays), f"{name} {node.name} {which}: names"
                for arg, bxs in regions.items():
                    got = tuple(map(tuple, arrays[arg][i].tolist()))
                    assert bxs == [got], f"{name} {node.name} {which} {arg} at {c}: {bxs} {got}"


def _plan(graph, env, per_tile: bool):
    old = plan_mod.PER_TILE
    plan_mod.PER_TILE = per_tile
    try:
        t0 = time.perf_counter()
        p = instantiate(graph, env)
        return p, time.perf_counter() - t0
    finally:
        plan_mod.PER_TILE = old


@pytest.mark.parametrize("name,graph", CASES, ids=[n for n, _ in CASES])
@pytest.mark.parametrize("tokens", [1, 129, 4096])
def test_array_plan_equals_per_tile_plan(name, graph, tokens):
    env = {"T": tokens}
    ref, _ = _plan(graph, env, per_tile=True)
    got, _ = _plan(graph, env, per_tile=False)
    assert got.waits == ref.waits
    assert got.notifies == ref.notifies
    assert got.event_count == ref.event_count
    assert got.event_label == ref.event_label
    assert got.cost == pytest.approx(ref.cost)


def test_array_plan_is_faster():
    """The MoE block at Qwen3-30B-A3B size with MegaMoE's prefill tiles, T=4096 (13K tiles)."""
    from cutemk.nn import MOE_TILES

    cfg = MoeConfig(2048, 768, 128, 8, router_dtype=None, **MOE_TILES[("cute", "prefill")])
    g = moe_graph(mk.sym("T", max=4096), cfg, torch.bfloat16)
    env = {"T": 4096}
    # best of 3, the collector off: a full collection of a large test session's heap (~0.25 s)
    # landing in one of the timed calls says nothing about either path
    with no_gc():
        per_tile = min(_plan(g, env, per_tile=True)[1] for _ in range(3))
        arrays = min(_plan(g, env, per_tile=False)[1] for _ in range(3))
    assert arrays < 0.5 * per_tile, (arrays, per_tile)


def test_tasks_are_made_on_access_like_a_list():
    """``plan.tasks`` makes each task when asked for: indexing (negative too), slices and
    iteration give the tasks a list of them would, nodes with no tasks included."""
    from cutemk.plan import Task

    plan = instantiate(moe_graph(mk.sym("T", max=64), MoeConfig(128, 64, 8, 2)), {"T": 3})
    listed = [
        Task(t, node, tuple(c))
        for node, ts in zip(plan.graph.nodes, plan.node_tasks)
        for t, c in zip(ts, plan.coords_of(node.index).tolist())
    ]
    assert list(plan.tasks) == listed and len(plan.tasks) == len(listed)
    assert [plan.tasks[t] for t in range(len(listed))] == listed
    assert plan.tasks[-1] == listed[-1] and plan.tasks[2:7] == listed[2:7]
    with pytest.raises(IndexError):
        plan.tasks[len(listed)]
