"""The token count as device data: one CUDA-graph capture that replays at every count.

CPU: the ladder of planned counts, the packed table (each count maps to the smallest plan that
covers it; each plan's program and state where its row says), the graphs that cannot run so,
and the live kernel compiled for sm_90a. GPU: a MegaMLP captured once and replayed at counts
in random order across all its regimes against an fp32 reference, with the output poisoned
before each replay; a live graph with the watchdog at random counts; counts out of range.
"""

import os
import random
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import cutemk as mk
from cutemk.codegen.layout import LH, LIVE_ROW, LR
from cutemk.errors import CuteMKError, GraphError, LayoutError
from cutemk.kernels import compile_offline, live_dims
from cutemk.layers import MoeConfig, mlp_graph, moe_graph
from cutemk.live import live_counts, pack_live
from cutemk.plan import instantiate
from cutemk.regimes import mlp_regime_graph
from cutemk.runtime import CuteGraph
from cutemk.scheduling import resolve_scheduler

BF = torch.bfloat16
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_live_counts_cover_the_range_with_tile_sized_steps():
    assert live_counts(1, 1) == [1]
    assert live_counts(2, 16) == [2, 4, 8, 16]
    assert live_counts(17, 128) == [32, 64, 128]
    assert live_counts(129, 1000) == [*range(256, 1000, 128), 1000]
    assert live_counts(1, 300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    with pytest.raises(ValueError):
        live_counts(5, 4)


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_pack_live_maps_each_count_to_the_smallest_plan_covering_it(scheduler):
    g = mlp_regime_graph(1024, 1536, "prefill", BF, 1000)
    holder = SimpleNamespace(
        scheduler=resolve_scheduler(scheduler),
        num_sms=132,
        dynamic=scheduler == "dynamic",
    )
    counts = live_counts(129, 1000)
    plans = [instantiate(g, {"T": c}) for c in counts]
    built = [CuteGraph._plan_arrays(holder, p) for p in plans]
    table, prog, dev, prog_off, dev_off = pack_live(built, counts, 129, 1000)
    assert table[LH["max"]] == 1000 and table[LH["num_plans"]] == len(counts)
    lookup = table[table[LH["lookup"]] : table[LH["lookup"]] + 1001]
    rows = table[table[LH["rows"]] :].reshape(len(counts), len(LIVE_ROW))
    assert (lookup[:129] == -1).all()  # served by another regime's kernel (or nothing, at 0)
    for t in range(129, 1001):
        k = lookup[t]
        assert rows[k, LR["tokens"]] >= t and (k == 0 or rows[k - 1, LR["tokens"]] < t)
    for k, (low, prog_np, dev_np, _) in enumerate(built):
        r = rows[k]
        assert r[LR["prog_off"]] % 32 == 0 and r[LR["dev_off"]] % 32 == 0  # 128-byte aligned
        assert (prog[r[LR["prog_off"]] : r[LR["prog_off"]] + r[LR["prog_len"]]] == prog_np).all()
        assert (dev[r[LR["dev_off"]] : r[LR["dev_off"]] + r[LR["dev_len"]]] == dev_np).all()
        assert r[LR["num_tasks"]] == low.num_tasks == plans[k].num_tasks
        assert r[LR["num_init"]] == low.num_init and r[LR["max_epoch"]] == low.max_launches()
    assert prog_off == list(rows[:, LR["prog_off"]]) and dev_off == list(rows[:, LR["dev_off"]])
    # the programs do not overlap
    ends = rows[:, LR["prog_off"]] + rows[:, LR["prog_len"]]
    assert (ends[:-1] <= rows[1:, LR["prog_off"]]).all()


def test_live_dims_and_the_graphs_that_cannot_take_a_live_count():
    g = mlp_regime_graph(4096, 12288, "decode", BF, 1000)
    pairs = live_dims(g, "T")
    names = {g.values[i].name: d for i, d in pairs}
    assert names == {"x": 0, "gate_up.c": 0, "down.part": 1, "y": 0}
    cfg = MoeConfig(64, 32, 8, 2, block_m=16, block_n=32)
    with pytest.raises(GraphError, match="row-wise"):
        live_dims(moe_graph(mk.sym("T", max=64), cfg), "T")
    two = mk.Graph("two_dims")
    w = two.weight("w", (64,), torch.float32)
    for name, dim in (("a", "T"), ("b", "U")):
        x = two.input(name, (mk.sym(dim, max=8), 64), torch.float32)
        two.output(two.call(mk.ops.rmsnorm, x, w), f"y_{name}")
    with pytest.raises(GraphError, match="U"):
        live_dims(two, "T")


@pytest.mark.parametrize("regime,scheduler", [("gemv1", "static"), ("prefill", "dynamic")])
def test_live_kernel_compiles_for_sm90a(regime, scheduler):
    g = mlp_regime_graph(1024, 1536, regime, BF, 1000)
    with tempfile.TemporaryDirectory() as d:
        compile_offline(g, scheduler, options=f"--keep-ptx --dump-dir={d}", live="T")
        (path,) = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx")]
        ptx = Path(path).read_text()
    assert len(re.findall(r"\.entry\s+cutemk_megakernel", ptx)) == 1
    assert "wgmma.mma_async" in ptx
    assert re.search(r"ld\.acquire\.gpu", ptx)
    # the launches with a count out of range are counted with an atomic add on the table
    assert re.search(r"(red|atom)\.(relaxed\.gpu\.)?global\.add", ptx)


# -- GPU ------------------------------------------------------------------------------------
def reference(x, w_gate_up, w_down):
    xf, wgu, wd = x.float(), w_gate_up.float(), w_down.float()
    h = xf @ wgu.T
    i = wgu.shape[0] // 2
    return (torch.nn.functional.silu(h[:, :i]) * h[:, i:]) @ wd.T


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN (unwritten poisoned rows) in the output"
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@requires_cuda
def test_one_capture_replays_every_count_across_regimes():
    torch.manual_seed(11)
    # Qwen3-8B's sizes: the regimes split their GEMMs along K here, so the split reduces read
    # partial buffers allocated for more rows than the plan binds
    h, inter, max_tokens = 4096, 12288, 300
    wg = (torch.randn(inter, h, device="cuda") / h**0.5).to(BF)
    wu = (torch.randn(inter, h, device="cuda") / h**0.5).to(BF)
    wd = (torch.randn(h, inter, device="cuda") / inter**0.5).to(BF)
    mlp = mk.nn.MegaMLP(wg, wu, wd, max_tokens=max_tokens)
    x = torch.randn(max_tokens, h, device="cuda").to(BF)
    n = torch.full((1,), max_tokens, dtype=torch.int32, device="cuda")
    # nothing built yet: a clear error, not a CUDA one from inside the capture
    with (
        pytest.raises(CuteMKError, match="before capturing"),
        torch.cuda.graph(torch.cuda.CUDAGraph()),
    ):
        mlp(x, num_tokens=n)
    # every regime's live kernel compiled and launched once, every count planned: the capture
    # follows at once, as a server's would
    mk.warmup(mlp, live=True, progress=False)
    compiles = mk.runtime.compile_count
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mlp(x, num_tokens=n)
    counts = [1, 37, 300, 5, 129, 16, 128, 17, 2, 255, 257, 0, 64, 299, 1]
    rng = random.Random(5)
    rng.shuffle(counts)
    for t in counts:
        x.copy_(torch.randn(max_tokens, h, device="cuda").to(BF))
        n.fill_(t)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if t == 0:
            assert torch.isnan(y).all()  # nothing ran
            continue
        assert rel_err(y[:t], reference(x[:t], mlp.w_gate_up, mlp.w_down)) < 1e-2, f"T={t}"
    mlp.check_live()
    assert mk.runtime.compile_count == compiles  # no count compiled anything
    for bad in (max_tokens + 1, -1):
        n.fill_(bad)
        graph.replay()
        with pytest.raises(CuteMKError, match=f"the last: {bad}"):
            mlp.check_live()
    mlp.check_live()  # the tally was taken


@pytest.mark.gpu
@requires_cuda
def test_live_graph_with_the_watchdog_and_counts_out_of_range():
    torch.manual_seed(12)
    h, inter, max_tokens = 256, 384, 520
    g = mlp_graph(mk.sym("T", max=max_tokens), h, inter, BF, 128, 128, fuse_silu=True)
    c = g.compile("cute", scheduler="dynamic", watchdog=True, poison_outputs=True)
    live = c.live()
    assert live.counts == [1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 520]
    wgu = (torch.randn(2 * inter, h, device="cuda") / h**0.5).to(BF)
    wd = (torch.randn(h, inter, device="cuda") / inter**0.5).to(BF)
    x = torch.randn(max_tokens, h, device="cuda").to(BF)
    n = torch.zeros(1, dtype=torch.int32, device="cuda")
    for t in random.Random(3).sample(range(1, max_tokens + 1), 12) + [max_tokens, 1]:
        n.fill_(t)
        y = live(x, wgu, wd, num_tokens=n)
        assert rel_err(y[:t], reference(x[:t], wgu, wd)) < 1e-2, f"T={t}"
    for bad in (max_tokens + 1, -3):
        n.fill_(bad)
        with pytest.raises(CuteMKError, match=f"the last: {bad}"):
            live(x, wgu, wd, num_tokens=n)
    n.fill_(0)
    y = live(x, wgu, wd, num_tokens=n)  # nothing to do, nothing wrong
    assert torch.isnan(y).all()
    with pytest.raises(TypeError, match="int32"):
        live(x, wgu, wd, num_tokens=n.long())
    with pytest.raises(LayoutError, match="maximum"):
        live(x[:100], wgu, wd, num_tokens=n)
    np.testing.assert_array_equal(live.table[: LH["last_bad"] + 1].cpu().numpy()[1:], [0, -3])
