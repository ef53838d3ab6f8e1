"""Distributed graphs: GEMM + reduce-scatter and all-gather + GEMM.

CPU: every rank simulated in one process (``cutemk.world``) against fp32 references, cross-rank
deadlocks caught, bad shapes refused, the distributed megakernels compiled for sm_90a.
GPU (one H200): the world-size-1 path of the real runtime (symmetric-memory peer tables,
system-scope events, the per-launch rank barrier). Multi-GPU: ``tests/dist_worker.py`` under
``torchrun`` on every GPU of the machine.
"""

import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.errors import DeadlockError, GraphError, ShapeError
from cutemk.scheduling import SchedulingMode, StaticSchedule
from cutemk.tp import ag_gemm_graph, ag_gemm_reference, gemm_rs_graph, gemm_rs_reference
from cutemk.world import simulate_world

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rs_case(world, t=64, k=48, n=96, dtype=torch.float32, seed=0):
    g = gemm_rs_graph(mk.sym("T", max=1024), k, n, world, dtype, 32, 32, 16, 64)
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(t, k, generator=gen).to(dtype) for _ in range(world)]
    w = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for _ in range(world)]
    return g, [{"a": a[r], "w": w[r]} for r in range(world)], gemm_rs_reference(a, w)


def ag_case(world, s=24, k=64, n=40, dtype=torch.float32, seed=0):
    g = ag_gemm_graph(mk.sym("S", max=1024), k, n, world, dtype, 32, 16, 8)
    gen = torch.Generator().manual_seed(seed)
    x = [torch.randn(s, k, generator=gen).to(dtype) for _ in range(world)]
    w = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for _ in range(world)]
    return g, [{"x": x[r], "w": w[r]} for r in range(world)], ag_gemm_reference(x, w)


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    return ((out.float() - ref).norm() / ref.norm()).item()


# -- CPU: all ranks in one process ---------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("case", [rs_case, ag_case], ids=["gemm_rs", "ag_gemm"])
def test_world_simulation_matches_reference(world, scheduler, case):
    g, inputs, refs = case(world)
    for seed in range(3):  # different interleavings of all ranks' SMs
        outs, plans = simulate_world(g, world, inputs, scheduler, num_sms=5, seed=seed)
        for r in range(world):
            assert rel_err(outs[r][0], refs[r]) < 1e-6, f"rank {r}"
        assert any(plans[0].remote_waits), "no cross-rank waits: the test would not test them"


@pytest.mark.parametrize("case", [rs_case, ag_case], ids=["gemm_rs", "ag_gemm"])
def test_world_size_one_graphs_run_on_the_interpreter(case):
    g, inputs, refs = case(1)
    out = g.compile("interpret", num_sms=4, scheduler="dynamic")(**inputs[0])
    assert rel_err(out, refs[0]) < 1e-6


def test_remote_waits_are_tile_to_tile():
    """A reduce-scatter tile waits for exactly the GEMM tiles of its block, on every rank."""
    g, _, _ = rs_case(4)
    plan = mk.instantiate(g, {"T": 64, "RANK": 2, "WORLD": 4})
    rs = [t for t in plan.tasks if t.node.op.name == "reduce_scatter"]
    # rank 2's rows are 32..48: gemm row tile 1 (32-row tiles); rs col tile 0 = gemm cols 0, 1
    first = rs[0].tid
    assert sorted({r for r, _ in plan.remote_waits[first]}) == [0, 1, 3]
    labels = {plan.event_label[e] for _, e in plan.remote_waits[first]}
    assert labels == {"gemm_done[1, 0]", "gemm_done[1, 1]"}
    assert len(plan.remote_waits[first]) == 3 * 2
    gemm_tiles = [t for t in plan.tasks if t.node.op.name == "gemm"]
    assert all(not plan.remote_waits[t.tid] for t in gemm_tiles)


def test_cross_rank_wait_cycle_is_caught():
    """Each rank's one SM runs its own reduce-scatter before the GEMM tiles the other rank
    needs: no cycle within a rank (the static check passes) but one across ranks."""

    class OwnChunkFirst:
        mode = SchedulingMode.STATIC
        name = "own-chunk-first"

        def build(self, plan, num_sms):
            gemm = [t.tid for t in plan.tasks if t.node.op.name == "gemm"]
            rs = [t.tid for t in plan.tasks if t.node.op.name == "reduce_scatter"]
            mine = [t for t in gemm if any(t in plan.preds()[x] for x in rs)]
            rest = [t for t in gemm if t not in mine]
            return StaticSchedule((tuple(mine + rs + rest),))

    g, inputs, _ = rs_case(2)
    with pytest.raises(DeadlockError, match=r"rank \d: task reduce_scatter0.* of rank \d"):
        simulate_world(g, 2, inputs, OwnChunkFirst(), num_sms=1)


def test_default_static_schedule_never_deadlocks_across_ranks():
    """Cheap GEMM tiles (small K slice) next to reduce-scatter tiles: a scheduler that orders
    each rank by its own costs queued its reduce-scatter tiles in front of GEMM tiles the other
    ranks wait for (a cross-rank cycle). Shared-event producers now come first everywhere."""
    _, inputs, refs = rs_case(4, t=1024, k=32, n=512)
    g = gemm_rs_graph(mk.sym("T", max=1024), 32, 512, 4, torch.float32, 64, 64)
    outs, _ = simulate_world(g, 4, inputs, "static", num_sms=32)
    for r in range(4):
        assert rel_err(outs[r][0], refs[r]) < 1e-6


def test_dynamic_mode_refuses_cross_rank_producers_that_wait():
    """A popped task spins on its cross-rank waits while holding its SM, so the producers other
    ranks wait on must all be at the front of the ready queue (tasks that wait on nothing)."""
    g = mk.Graph("two_gemms_rs")
    a = g.input("a", (mk.sym("T", max=256), 32))
    w1, w2 = g.weight("w1", (32, 32)), g.weight("w2", (64, 32))
    h = g.call(ops.gemm, a, w1, block_m=32, block_n=32)
    partial = g.call(ops.gemm, h, w2, block_m=32, block_n=32)
    out = g.call(ops.reduce_scatter, partial, world=2, block_m=32, block_n=32)
    g.event(
        (mk.cdiv(mk.sym("T", max=256), 32), 2),
        name="gemm_done",
        notify=[(partial, lambda i, j: (i, j))],
        remote_wait=[
            (out, lambda i, j, env: [(r, (env["RANK"] * env["T"] // 64 + i, j)) for r in range(2)])
        ],
    )
    g.output(out, "out")
    inputs = [{"a": torch.randn(64, 32), "w1": torch.randn(32, 32), "w2": torch.randn(64, 32)}] * 2
    with pytest.raises(GraphError, match="cross-rank producers must wait on nothing"):
        simulate_world(g, 2, inputs, "dynamic")
    simulate_world(g, 2, inputs, "static")  # the static queues order it safely


def test_bad_distributed_inputs():
    g, inputs, _ = rs_case(4, t=66)  # 66 tokens do not split over 4 ranks
    with pytest.raises(ShapeError, match="do not split over 4 ranks"):
        simulate_world(g, 4, inputs)
    g, _, _ = rs_case(2)
    with pytest.raises(GraphError, match="outside the world of 1 ranks"):
        mk.instantiate(g, {"T": 64})  # a 2-rank graph instantiated without WORLD
    with pytest.raises(ValueError, match="3 input sets for 2 ranks"):
        simulate_world(g, 2, [{}] * 3)


@pytest.mark.parametrize(
    "case, built, world",
    [(rs_case, 4, 2), (rs_case, 2, 4), (ag_case, 2, 4), (ag_case, 1, 2)],
    ids=["gemm_rs_4_on_2", "gemm_rs_2_on_4", "ag_gemm_2_on_4", "ag_gemm_1_on_2"],
)
def test_graph_built_for_another_world_is_refused_before_running(case, built, world):
    """A graph's all-gather / reduce-scatter tiles were built for a fixed number of ranks: run
    on another world they failed deep in a reference with a raw torch error (or a wait outside
    the world); the simulator names both sizes before it binds or runs anything."""
    g, _, _ = case(built)
    _, inputs, _ = case(world)
    with pytest.raises(GraphError, match=rf"was built for {built} ranks but world={world}"):
        simulate_world(g, world, inputs)


def test_ops_built_for_different_worlds_are_refused_by_validate():
    g = mk.Graph("mixed_worlds")
    x = g.input("x", (mk.sym("S", max=256), 32))
    gathered = g.call(ops.all_gather, x, world=2, block_m=16, block_n=32)
    partial = g.call(ops.gemm, gathered, g.weight("w", (32, 32)), block_m=16, block_n=32)
    g.output(g.call(ops.reduce_scatter, partial, world=4, block_m=16, block_n=32), "out")
    with pytest.raises(GraphError, match="all_gather0 is built for 2 ranks, reduce_scatter0 for 4"):
        g.validate()


@pytest.mark.parametrize(
    "world, err, msg",
    [
        (0, ValueError, "world must be at least 1 rank, got 0"),
        (-2, ValueError, "world must be at least 1 rank, got -2"),
        (2.0, TypeError, "world must be an int, got 2.0"),
        (True, TypeError, "world must be an int, got True"),
    ],
)
def test_world_must_be_a_positive_int(world, err, msg):
    g, _, _ = rs_case(2)
    with pytest.raises(err, match=msg):
        simulate_world(g, world, [])  # world=0 used to return two empty lists


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_distributed_megakernels_compile_with_system_scope_events(scheduler):
    from cutemk.runtime import compile_offline

    g = gemm_rs_graph(mk.sym("T", max=8192), 512, 4096, 8, torch.bfloat16)
    with tempfile.TemporaryDirectory() as d:
        compile_offline(g, scheduler, options=f"--keep-ptx --dump-dir={d}")
        ptx = Path(sorted(glob.glob(f"{d}/*.ptx"), key=os.path.getmtime)[-1]).read_text()
    assert "ld.acquire.sys.global" in ptx  # remote waits and the rank barrier
    assert "red.release.sys.global" in ptx  # notifies other GPUs observe
    assert "wgmma.mma_async" in ptx  # the GEMM tiles are the Hopper ones


def test_distributed_watchdog_bounds_the_rank_barrier_and_tells_the_peers():
    """With the watchdog, an aborted launch sets the peers' abort word (a system-scope CAS)
    and the rank barrier's wait is bounded (a second ``%globaltimer`` deadline loop)."""
    from cutemk.runtime import compile_offline

    g = gemm_rs_graph(mk.sym("T", max=8192), 512, 4096, 8, torch.bfloat16)
    ptx = {}
    for watchdog in (False, True):
        with tempfile.TemporaryDirectory() as d:
            compile_offline(g, "static", watchdog=watchdog, options=f"--keep-ptx --dump-dir={d}")
            ptx[watchdog] = Path(
                sorted(glob.glob(f"{d}/*.ptx"), key=os.path.getmtime)[-1]
            ).read_text()
    assert "atom.global.sys.release.cas" in ptx[True]
    assert "atom.global.sys.release.cas" not in ptx[False]


# -- GPU: the world-size-1 path of the runtime -------------------------------------------
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("pattern", ["gemm_rs", "ag_gemm"])
def test_world_size_one_on_gpu(scheduler, pattern):
    torch.manual_seed(0)
    h, n = 512, 384
    if pattern == "gemm_rs":
        g = gemm_rs_graph(mk.sym("T", max=1024), h, n, 1, torch.bfloat16, 128, 128, 64, 256)
    else:
        g = ag_gemm_graph(mk.sym("S", max=1024), h, n, 1, torch.bfloat16, 128, 128, 32)
    c = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
    w = (torch.randn(n, h, device="cuda") / h**0.5).bfloat16()
    for t in (256, 64, 1000, 256):  # token counts change; launches repeat (epoch counting)
        x = torch.randn(t, h, device="cuda").bfloat16()
        y = c(x, w)
        ref = x.float() @ w.float().T
        assert rel_err(y, ref) < 1e-2, f"T={t}"


@pytest.mark.multigpu
@requires_cuda
def test_all_gpus_under_torchrun():
    n = torch.cuda.device_count()
    worker = Path(__file__).with_name("dist_worker.py")
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", str(worker)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert res.stdout.count("dist_worker: ok") == n, res.stdout[-4000:]


def test_dynamic_queue_puts_cross_rank_waiters_behind_everything_else():
    """Cross-rank waiters that wait on nothing locally are initial tasks too: queued ahead of
    the producers other ranks need (node order), they filled every SM and spun forever."""
    T = mk.sym("T", max=64)
    g = mk.Graph("waiters_first")
    x = g.input("x", (T, 32))
    w = g.weight("w", (32, 32))
    first = g.call(ops.gemm, x, w, block_m=16, block_n=32, name="waiter")  # node 0
    second = g.call(ops.gemm, x, w, block_m=16, block_n=32, name="producer")  # node 1
    g.event(
        (mk.cdiv(T, 16),),
        name="peer_done",
        notify=[(second, lambda i, j: (i,))],
        remote_wait=[(first, lambda i, j, env: [((env["RANK"] + 1) % env["WORLD"], (i,))])],
    )
    g.output(first, "a")
    g.output(second, "b")
    gen = torch.Generator().manual_seed(0)
    inputs = [
        {"x": torch.randn(64, 32, generator=gen), "w": torch.randn(32, 32, generator=gen)}
        for _ in range(2)
    ]
    outs, plans = simulate_world(g, 2, inputs, "dynamic", num_sms=2)
    for r in range(2):
        want = inputs[r]["x"] @ inputs[r]["w"].T
        assert rel_err(outs[r][0], want) < 1e-6 and rel_err(outs[r][1], want) < 1e-6
    init = mk.resolve_scheduler("dynamic").initial_order(plans[0])
    waiters = [t for t in init if plans[0].remote_waits[t]]
    assert init[-len(waiters) :] == waiters  # behind every producer


def test_ranks_that_bind_different_dims_are_refused_by_name():
    """Two ranks calling with different token counts would wait on each other's events by ids
    of different plans: the simulated world refuses it as the device ranks do, by name."""
    g, inputs, _ = rs_case(2)
    inputs[1] = {"a": inputs[1]["a"][:32], "w": inputs[1]["w"]}
    with pytest.raises(mk.CuteMKError, match=r"rank 1: the ranks built different plans"):
        simulate_world(g, 2, inputs, "static", num_sms=4)


def test_a_graph_of_several_ranks_is_not_interpreted_as_one():
    """The interpreter ran a world-2 all-gather in one process: 640 NaNs, no error; a plan for
    WORLD=3 of a graph built for 2, or RANK past the world, or RANK=1.0, were taken."""
    S = mk.sym("S", max=256)
    g = ag_gemm_graph(S, 32, 40, 2, torch.float32, 16, 8, 8)
    with pytest.raises(GraphError, match="built for 2 ranks.*simulate_world"):
        g.compile("interpret", num_sms=2)
    with pytest.raises(ShapeError, match=r"WORLD=3: expected 2"):
        mk.instantiate(g, {"S": 20, "RANK": 0, "WORLD": 3})
    with pytest.raises(ShapeError, match="RANK=2 is outside the world of 2"):
        mk.instantiate(g, {"S": 20, "RANK": 2, "WORLD": 2})
    with pytest.raises(ShapeError, match="RANK must be an int"):
        mk.instantiate(g, {"S": 20, "RANK": 1.0, "WORLD": 2})
    with pytest.raises(ValueError, match="num_sms must be a positive int"):
        simulate_world(g, 2, [{"x": torch.randn(20, 32), "w": torch.randn(40, 32)}] * 2, num_sms=0)


def test_ranks_with_other_widths_or_dtypes_build_different_plans():
    """The digest held only the dims and the shared events: ranks whose graphs differ in a fixed
    width or a dtype agreed, and would read each other's buffers wrongly."""
    from cutemk.comm import plan_digest

    S = mk.sym("S", max=256)
    env = {"S": 24, "WORLD": 2}
    a = mk.instantiate(ag_gemm_graph(S, 64, 40, 2, torch.float32), {**env, "RANK": 0})
    b = mk.instantiate(ag_gemm_graph(S, 32, 40, 2, torch.float32), {**env, "RANK": 1})
    c = mk.instantiate(ag_gemm_graph(S, 64, 40, 2, torch.bfloat16), {**env, "RANK": 1})
    same = mk.instantiate(ag_gemm_graph(S, 64, 40, 2, torch.float32), {**env, "RANK": 1})
    assert plan_digest(a) != plan_digest(b) and plan_digest(a) != plan_digest(c)
    assert plan_digest(a) == plan_digest(same)


def test_a_value_other_ranks_reach_is_produced_in_the_graph_and_kept_inside():
    """The simulator ran what the device refuses (or fails on with a KeyError): the gathered
    rows as a graph output, and a reduce-scatter of a graph input (peer tables exist for
    intermediates only)."""
    S = mk.sym("S", max=256)
    g = mk.Graph("ag_out")
    g.output(g.call(ops.all_gather, g.input("x", (S, 32)), world=2, block_m=16, block_n=32), "y")
    with pytest.raises(GraphError, match="cannot be a graph output"):
        g.validate()
    g2 = mk.Graph("rs_in")
    p = g2.input("partial", (S, 32))
    g2.output(g2.call(ops.reduce_scatter, p, world=2, block_m=16, block_n=32), "y")
    with pytest.raises(GraphError, match=r"reached by other ranks.*not pass it as an input"):
        g2.validate()


@pytest.mark.parametrize("case", [rs_case, ag_case], ids=["gemm_rs", "ag_gemm"])
def test_a_peer_read_no_remote_wait_orders_is_a_race(monkeypatch, case):
    """The world simulator checks reads of other ranks' data as the interpreter checks local
    ones: with the cross-rank waits cut down to the rank's own producers, reduce-scatter's
    read of a peer's partial (or the GEMM's read of rows a peer's all-gather pushed) is a
    RaceError naming the ranks (and the writer's task if it ran), in every interleaving, where before it ran unchecked
    (right or wrong by the order the SMs happened to take)."""
    event = mk.Graph.event

    def own_rank_only(self, *args, remote_wait=(), **kw):
        def cut(f):
            def m(i, j, env):
                return [(r, t) for r, t in f(i, j, env) if r == env["RANK"]]

            return m

        return event(self, *args, remote_wait=[(v, cut(f)) for v, f in remote_wait], **kw)

    g, inputs, _ = case(2)
    simulate_world(g, 2, inputs, num_sms=5)  # the graph as built passes
    monkeypatch.setattr(mk.Graph, "event", own_rank_only)
    g, inputs, _ = case(2)
    for scheduler in ("static", "dynamic"):
        for seed in range(3):
            with pytest.raises(mk.RaceError, match=r"rank \d: task .*(rank \d: task|no task has)"):
                simulate_world(g, 2, inputs, scheduler, num_sms=5, seed=seed)
