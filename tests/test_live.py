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
from cutemk.codegen.layout import live_row_width
from cutemk.kernels import compile_offline, kernel_spec, live_dims
from cutemk.layers import MoeConfig, mlp_graph, moe_graph
from cutemk.live import LiveGraph, live_counts, pack_live
from cutemk.plan import instantiate
from cutemk.regimes import mlp_regime_graph, moe_regime_graph
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
    assert table[LH["first"]] == 129  # below it: another kernel's, known from the header
    # the kernel reads each served count's own copy of its plan's row
    width = len(LIVE_ROW) + 1
    by_count = table[table[LH["count_rows"]] :].reshape(1000 - 129 + 1, width)
    whole = table[table[LH["rows"]] : table[LH["count_rows"]]].reshape(len(counts), width)
    for t in (129, 130, 255, 256, 257, 1000):
        assert (by_count[t - 129] == whole[table[table[LH["lookup"]] + t]]).all()
    lookup = table[table[LH["lookup"]] : table[LH["lookup"]] + 1001]
    rows = table[table[LH["rows"]] : table[LH["count_rows"]]].reshape(
        len(counts), len(LIVE_ROW) + 1
    )
    assert (rows[:, len(LIVE_ROW)] == counts).all()  # the one extent, the count itself
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
    pairs, extents = live_dims(g, "T")
    names = {g.values[i].name: (d, j) for i, d, j in pairs}
    assert names == {"x": (0, 0), "gate_up.c": (0, 0), "down.part": (1, 0), "y": (0, 0)}
    assert extents == (g.values[0].shape[0],)
    # an MoE block's ops keep tokens apart too; its slot buffers' dims are expressions of T
    moe = moe_graph(mk.sym("T", max=64), MoeConfig(64, 32, 8, 2, block_m=16, block_n=32))
    pairs, extents = live_dims(moe, "T")
    assert str(extents[0]) == "T" and len(extents) > 1
    topk = next(n for n in moe.nodes if n.op.name == "topk_softmax")
    for i, d, j in pairs:
        if j < 0:  # bound to the live count: the top-k's logits alone (its live_rows_inputs)
            assert moe.values[i] is topk.args["logits"] and str(moe.values[i].shape[d]) == "T"
        else:
            assert moe.values[i].shape[d] == extents[j]
    assert sum(j < 0 for _, _, j in pairs) == 1
    # an op that does not keep tokens apart
    mixed = mk.Graph("mixed")
    x = mixed.input("x", (mk.sym("T", max=8), 64), torch.float32)
    mixed.output(mixed.call(mk.ops.rmsnorm, x), "y")
    object.__setattr__(mixed.nodes[0].op, "token_local", False)  # as the op's class would
    with pytest.raises(GraphError, match="independent"):
        live_dims(mixed, "T")
    two = mk.Graph("two_dims")
    w = two.weight("w", (64,), torch.float32)
    for name, dim in (("a", "T"), ("b", "U")):
        x = two.input(name, (mk.sym(dim, max=8), 64), torch.float32)
        two.output(two.call(mk.ops.rmsnorm, x, w), f"y_{name}")
    with pytest.raises(GraphError, match="U"):
        live_dims(two, "T")


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_live_table_carries_each_plans_slot_extents(scheduler):
    """The MoE prefill graph's live table: per plan, the value at its count of every
    token-dependent dim (tile counts, slot rows, routing chunks), none above its value at the
    maximum, where the buffers are allocated."""
    g = moe_regime_graph(256, 128, 16, 4, True, "prefill", BF, 700)
    cg = SimpleNamespace(
        graph=g,
        scheduler=resolve_scheduler(scheduler),
        num_sms=132,
        dynamic=scheduler == "dynamic",
    )
    live = LiveGraph.__new__(LiveGraph)
    live.cg, live.tokens, live.max_tokens, live.fixed = cg, "T", 700, {}
    live.counts = live_counts(17, 700)
    _, exprs = live_dims(g, "T")
    extents = live._extents()
    assert len(exprs) >= 3 and [row[0] for row in extents] == live.counts
    for c, row in zip(live.counts, extents):
        assert row == [e.eval({"T": c}) for e in exprs]
    built = [CuteGraph._plan_arrays(cg, instantiate(g, {"T": c})) for c in live.counts]
    table, *_ = pack_live(built, live.counts, 17, 700, extents=extents)
    # what the kernel reads: its row width from the spec, each bound dim's word of the row
    spec_live = kernel_spec(g, scheduler == "dynamic", live="T").live
    width = live_row_width(spec_live)
    assert width == len(LIVE_ROW) + len(exprs)
    for n in (17, 18, 100, 128, 129, 640, 641, 699, 700):
        plan = table[table[LH["lookup"]] + n]
        row = table[LH["count_rows"]] + width * (n - table[LH["first"]])
        c = table[row + LR["tokens"]]
        assert c == live.counts[plan] and c >= n
        for i, d, j in spec_live:
            want = n if j < 0 else g.values[i].shape[d].eval({"T": int(c)})
            got = n if j < 0 else table[row + len(LIVE_ROW) + j]
            assert got == want, (g.values[i].name, d, n)


@pytest.mark.parametrize(
    "layer,regime,scheduler",
    [
        ("mlp", "gemv1", "static"),
        ("mlp", "prefill", "dynamic"),
        ("moe", "slots", "static"),
        ("moe", "gemv", "dynamic"),
        ("moe", "prefill", "static"),
    ],
)
def test_live_kernel_compiles_for_sm90a(layer, regime, scheduler, spill_stores):
    if layer == "mlp":
        g = mlp_regime_graph(1024, 1536, regime, BF, 1000)
    else:  # Qwen3-30B-A3B's block
        g = moe_regime_graph(2048, 768, 128, 8, True, regime, BF, 4096)
    with tempfile.TemporaryDirectory() as d:
        compile_offline(g, scheduler, options=f"--keep-ptx --dump-dir={d}", live="T")
        (path,) = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx")]
        ptx = Path(path).read_text()
        spills = spill_stores(path)
    assert len(re.findall(r"\.entry\s+cutemk_megakernel", ptx)) == 1
    assert "wgmma.mma_async" in ptx
    assert re.search(r"ld\.acquire\.gpu", ptx)
    # the launches with a count out of range are counted with an atomic add on the table
    assert re.search(r"(red|atom)\.(relaxed\.gpu\.)?global\.add", ptx)
    assert spills == 0


def test_live_kernel_with_programmatic_dependent_launch(monkeypatch):
    """``CUTEMK_LIVE_PDL=1``: a live kernel waits for the kernel ahead of it on the stream
    (``griddepcontrol.wait``) before its first read of memory (the count), then lets the next
    one launch; the switch is part of the spec (a cache key of its own) and only a live kernel
    takes it."""
    g = mlp_regime_graph(1024, 1536, "gemv1", BF, 1000)
    monkeypatch.setenv("CUTEMK_LIVE_PDL", "1")
    assert kernel_spec(g, False, live="T").live_pdl
    assert not kernel_spec(g, False).live_pdl
    with tempfile.TemporaryDirectory() as d:
        compile_offline(g, "static", options=f"--keep-ptx --dump-dir={d}", live="T")
        (path,) = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx")]
        ptx = Path(path).read_text()
    body = ptx[ptx.index(".entry") :]
    wait = body.index("griddepcontrol.wait")
    assert body.index("griddepcontrol.launch_dependents") > wait
    # no memory access of any kind before the wait; and no non-coherent loads at all, which
    # the assembler may hoist above it
    access = r"\b((ld|st|prefetch)\.global|(atom|red)\.\S*global|cp\.async)"
    assert not re.search(access, body[:wait])
    assert ".nc." not in body
    monkeypatch.delenv("CUTEMK_LIVE_PDL")
    assert not kernel_spec(g, False, live="T").live_pdl


# -- GPU ------------------------------------------------------------------------------------
def reference(x, w_gate_up, w_down):
    xf, wgu, wd = x.float(), w_gate_up.float(), w_down.float()
    h = xf @ wgu.T
    i = wgu.shape[0] // 2
    return (torch.nn.functional.silu(h[:, :i]) * h[:, i:]) @ wd.T


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN (unwritten poisoned rows) in the output"
    return ((out.float() - ref).norm() / ref.norm()).item()


def replays(graph, x, n, y, counts, seed, fill=lambda x, t: x):
    """Replay a graph captured on ``x``, ``n`` and ``y`` at each count in random order: fresh
    random ``x`` (``fill(x, t)`` may change its rows past the count), ``y`` poisoned first.
    Yields each count that ran; at 0 nothing may run (``y`` stays NaN)."""
    counts = list(counts)
    random.Random(seed).shuffle(counts)
    for t in counts:
        x.copy_(fill(torch.randn(x.shape, device="cuda").to(x.dtype), t))
        n.fill_(t)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if t == 0:
            assert torch.isnan(y).all()  # nothing ran
            continue
        yield t


def mlp_weights(h: int, inter: int) -> tuple[torch.Tensor, ...]:
    """Random bf16 gate, up and down weights of a gated MLP on the GPU, scaled by fan-in."""
    wg = (torch.randn(inter, h, device="cuda") / h**0.5).to(BF)
    wu = (torch.randn(inter, h, device="cuda") / h**0.5).to(BF)
    wd = (torch.randn(h, inter, device="cuda") / inter**0.5).to(BF)
    return wg, wu, wd


@pytest.mark.gpu
@requires_cuda
def test_one_capture_replays_every_count_across_regimes():
    torch.manual_seed(11)
    # Qwen3-8B's sizes: the regimes split their GEMMs along K here, so the split reduces read
    # partial buffers allocated for more rows than the plan binds
    h, inter, max_tokens = 4096, 12288, 300
    wg, wu, wd = mlp_weights(h, inter)
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
    for t in replays(graph, x, n, y, counts, seed=5):
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


def garbage_rows(x, n):
    """Rows of ``x`` at and past ``n`` as a buffer may hold them: NaN, inf, huge values (the
    live MoE block routes those tokens too; they must not touch a live token's output)."""
    fill = (float("nan"), float("inf"), float("-inf"), 3e38, -1e4)
    for k in range(n, min(x.shape[0], n + 64)):
        x[k, (7 * k) % x.shape[1]] = fill[k % len(fill)]
    return x


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_moe_block_captured_once_replays_every_count(scheduler):
    """Qwen3-30B-A3B's sparse block (E=128, top-8, H=2048, I=768), max 600 tokens: all four
    regimes (slots, gemv, decode, prefill) in one capture, replayed at counts in random order
    with garbage tokens past the count, against an fp32 reference routing on the same bf16
    logits and against an eager launch planned for that count."""
    from cutemk.layers import moe_reference

    torch.manual_seed(21)
    e, k, h, inter, max_tokens = 128, 8, 2048, 768, 600
    w_router = (torch.randn(e, h, device="cuda") / h**0.5).to(BF)
    w_gu = (torch.randn(e, 2 * inter, h, device="cuda") / h**0.5).to(BF)
    w_down = (torch.randn(e, h, inter, device="cuda") / inter**0.5).to(BF)
    moe = mk.nn.MegaMoE(w_router, w_gu, w_down, k, max_tokens=max_tokens, scheduler=scheduler)
    assert moe.regimes() == ("slots", "gemv", "decode", "prefill")
    x = torch.randn(max_tokens, h, device="cuda").to(BF)
    n = torch.full((1,), max_tokens, dtype=torch.int32, device="cuda")
    mk.warmup(moe, live=True, progress=False)
    compiles = mk.runtime.compile_count
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe(x, num_tokens=n)
    counts = [1, 2, 3, 16, 17, 37, 512, 513, 600, 0, 129, 5, 300, 1]
    for t in replays(graph, x, n, y, counts, seed=6, fill=garbage_rows):
        ref = moe_reference(x[:t], w_router, w_gu, w_down, k, True, router_dtype=BF)
        assert rel_err(y[:t], ref) < 1e-2, f"T={t}"
        eager = moe(x[:t].clone())
        assert rel_err(y[:t], eager.float()) < 1e-2, f"T={t} vs the eager launch"
    moe.check_live()
    assert mk.runtime.compile_count == compiles  # no count compiled anything
    n.fill_(max_tokens + 1)
    graph.replay()
    with pytest.raises(CuteMKError, match=f"the last: {max_tokens + 1}"):
        moe.check_live()


@pytest.mark.gpu
@requires_cuda
def test_live_pdl_capture_replays_every_count(monkeypatch):
    """The live kernels launched with programmatic dependent launch (``CUTEMK_LIVE_PDL=1``):
    one capture of an MLP over its regimes replays at counts in random order, each right
    against the fp32 reference and identical to the same module without the switch."""
    torch.manual_seed(13)
    h, inter, max_tokens = 1024, 1536, 300
    wg, wu, wd = mlp_weights(h, inter)
    plain = mk.nn.MegaMLP(wg, wu, wd, max_tokens=max_tokens)
    mk.warmup(plain, live=True, progress=False)
    # the same key as ``plain``: one set of compiled graphs; the switch gets live graphs of its
    # own while it is on (they are looked up by it), the capture takes them
    monkeypatch.setenv("CUTEMK_LIVE_PDL", "1")
    mlp = mk.nn.MegaMLP(wg, wu, wd, max_tokens=max_tokens)
    mk.warmup(mlp, live=True, progress=False)
    lives = mlp.live_graphs(build=False)
    assert lives and all(live.spec.live_pdl for _, live in lives)
    x = torch.randn(max_tokens, h, device="cuda").to(BF)
    n = torch.full((1,), max_tokens, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mlp(x, num_tokens=n)
    monkeypatch.delenv("CUTEMK_LIVE_PDL")
    assert not any(live.spec.live_pdl for _, live in plain.live_graphs(build=False))
    counts = [1, 300, 37, 2, 129, 16, 0, 255, 1]
    for t in replays(graph, x, n, y, counts, seed=8):
        assert rel_err(y[:t], reference(x[:t], mlp.w_gate_up, mlp.w_down)) < 1e-2, f"T={t}"
        want = plain(x, num_tokens=n)
        assert torch.equal(y[:t], want[:t]), f"T={t}: not the launch without the switch"
    mlp.check_live()


def test_live_graphs_are_kept_per_pdl_switch(monkeypatch):
    """A compiled graph keeps one live graph per setting of ``CUTEMK_LIVE_PDL`` (another
    kernel): a module sharing the compiled graphs of one built with the switch off gets live
    kernels with it when it is on, not the kept ones."""
    monkeypatch.delenv("CUTEMK_LIVE_PDL", raising=False)
    off = CuteGraph._live_key(1, None, 300, None)
    monkeypatch.setenv("CUTEMK_LIVE_PDL", "1")
    assert CuteGraph._live_key(1, None, 300, None) != off
    monkeypatch.setenv("CUTEMK_LIVE_PDL", "0")
    assert CuteGraph._live_key(1, None, 300, None) == off
