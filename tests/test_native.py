"""The C passes of the static scheduler (``cutemk.native``) give the Python passes' results:
the same queues (task for task) on random DAGs, layer graphs and plans with repeated or dead
events; a cyclic plan still fails with the Python pass's message; the deadlock check rejects
what the Python check rejects. CPU only; skipped where no C compiler builds the library."""

import random

import pytest
import torch
from cutemk.schedulers import StaticScheduler

import cutemk as mk
from cutemk import native, ops
from cutemk.errors import GraphError, ScheduleError
from cutemk.layers import MoeConfig, mlp_graph, moe_graph
from cutemk.plan import instantiate
from cutemk.regimes import moe_regime_graph
from cutemk.scheduling import StaticSchedule, check_static_schedule

pytestmark = pytest.mark.skipif(native.lib() is None, reason="no C compiler built cutemk.native")


def _python_queues(plan, num_sms, monkeypatch, ties="index"):
    with monkeypatch.context() as m:
        m.setattr(native, "lib", lambda: None)
        return StaticScheduler(ties=ties).build(plan, num_sms).queues


def _dag_plan(rng, n):
    deps = []
    for t in range(n):
        k = rng.randint(0, min(6, t))
        deps.append(sorted(rng.sample(range(max(0, t - 30), t), min(k, t - max(0, t - 30)))))
    g = ops.dag_graph(deps, mk.sym("N", max=1 << 16), mk.sym("M", max=1 << 20))
    return instantiate(g, {"N": n, "M": max(1, sum(map(len, deps)))})


def _plans():
    rng = random.Random(7)
    T = mk.sym("T", max=1024)
    yield from (_dag_plan(rng, n) for n in (1, 2, 50, 400))
    yield instantiate(moe_graph(T, MoeConfig(128, 64, 8, 2)), {"T": 77})
    yield instantiate(mlp_graph(T, 64, 48, block_m=8, block_n=16), {"T": 40})
    g = moe_regime_graph(
        hidden=2048,
        intermediate=768,
        num_experts=128,
        top_k=8,
        norm_topk_prob=True,
        regime="prefill",
        dtype=torch.bfloat16,
        max_tokens=4096,
    )
    yield instantiate(g, {"T": 1000})


@pytest.mark.parametrize("ties", ["index", "idle"])
@pytest.mark.parametrize("num_sms", [1, 7, 132])
def test_same_queues_as_the_python_passes(num_sms, ties, monkeypatch):
    for plan in _plans():
        sched = StaticScheduler(ties=ties).build(plan, num_sms)
        assert sched.native is not None  # the C path ran
        assert sched.queues == _python_queues(plan, num_sms, monkeypatch, ties)
        check_static_schedule(plan, sched, num_sms)


def test_repeated_and_dead_events(monkeypatch):
    """Lists holding an event twice, events nobody notifies or nobody waits on: dropped as
    the Python dependency graph drops them."""
    plan = instantiate(mlp_graph(mk.sym("T", max=256), 64, 48, block_m=8, block_n=16), {"T": 40})
    last = plan.num_tasks - 1
    plan.waits[last].append(plan.waits[last][0])  # a repeat
    plan.notifies[0].append(plan.notifies[0][0])
    dead_wait = plan.new_event("nobody notifies", 1)
    plan.waits[3].append(dead_wait)
    dead_notify = plan.new_event("nobody waits", 1)
    plan.notifies[5].append(dead_notify)
    for num_sms in (1, 4, 132):
        assert StaticScheduler().build(plan, num_sms).queues == _python_queues(
            plan, num_sms, monkeypatch
        )


def test_cycle_is_named_by_the_python_pass():
    plan = instantiate(mlp_graph(mk.sym("T", max=256), 64, 48, block_m=8, block_n=16), {"T": 8})
    first, last = 0, plan.num_tasks - 1
    back = plan.new_event("back edge", 1)
    plan.notifies[last].append(back)
    plan.waits[first].append(back)
    with pytest.raises(GraphError, match="cycle"):
        StaticScheduler().build(plan, 4)


def test_check_rejects_what_the_python_check_rejects():
    plan = instantiate(mlp_graph(mk.sym("T", max=256), 64, 48, block_m=8, block_n=16), {"T": 8})
    ids = tuple(range(plan.num_tasks))
    with pytest.raises(ScheduleError, match="queued behind"):
        check_static_schedule(plan, StaticSchedule((tuple(reversed(ids)),)))
    with pytest.raises(ScheduleError, match="in no queue"):
        check_static_schedule(plan, StaticSchedule((ids[:-1],)))
    with pytest.raises(ScheduleError, match="queued twice"):
        check_static_schedule(plan, StaticSchedule((ids, ids[:1])))
    with pytest.raises(ScheduleError, match="outside"):
        check_static_schedule(plan, StaticSchedule(((*ids, 10**6),)))
    check_static_schedule(plan, StaticSchedule((ids,)))  # one SM in task order: valid


def test_ids_out_of_range_take_the_python_passes():
    """A plan edited by hand with an event id past the plan's events: the C passes are not
    handed it (they index unchecked); the Python pass raises as it always did."""
    plan = instantiate(mlp_graph(mk.sym("T", max=256), 64, 48, block_m=8, block_n=16), {"T": 8})
    plan.waits[1].append(plan.num_events + 5)
    arrays = native.PlanArrays(plan.waits, plan.notifies, plan.num_events, plan.cost)
    assert not arrays.valid
    with pytest.raises(IndexError):
        StaticScheduler().build(plan, 4)
    plan.waits[1].pop()
    plan.cost = plan.cost[:-1]  # one cost short
    assert not native.PlanArrays(plan.waits, plan.notifies, plan.num_events, plan.cost).valid


def test_cell_sources_match_the_cell_walk():
    """The writers of boxes of cells of a tiling, in C, against the Python walk over cells:
    1 to 3 dims, holes in the grid, empty and single-cell boxes."""
    import numpy as np

    from cutemk.plan import _WriteIndex

    rng = np.random.default_rng(3)
    for ndim in (1, 2, 3):
        shape = tuple(int(x) for x in rng.integers(1, 7, size=ndim))
        size = int(np.prod(shape))
        grid = np.where(rng.random(size) < 0.2, -1, rng.permutation(size) + 100).astype(np.int32)
        ix = _WriteIndex("v", [])
        ix.flat, ix.grid, ix._shape = grid.tolist(), grid, shape
        lo = np.stack([rng.integers(0, n, 40) for n in shape], axis=1)
        hi = np.stack([rng.integers(0, n + 1, 40) for n in shape], axis=1)
        ranges = np.stack([lo, hi], axis=2)
        got = native.cell_sources(shape, grid, ranges)
        want = [tuple(sorted(ix.in_cells(tuple(map(tuple, r))))) for r in ranges.tolist()]
        assert got == want


def test_with_the_caches_off_the_library_leaves_no_directory_behind(tmp_path):
    """``CUTEMK_CACHE_DIR=""``: the library is built in a directory of the process's own,
    which goes once the library is loaded."""
    import os
    import subprocess
    import sys

    code = (
        "import glob, os, tempfile\n"
        "from cutemk import native\n"
        "assert native.lib() is not None\n"
        "print(len(glob.glob(os.path.join(tempfile.gettempdir(), 'cutemk-native-*'))))\n"
    )
    env = dict(os.environ, CUTEMK_CACHE_DIR="", TMPDIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
