"""Split-K GEMM (``ops/gemm_splitk.py``): partial tiles over K ranges and the event-ordered
reduction, through ``cutemk.layers.linear``; on the CPU interpreter, compiled for sm_90a, and
on the GPU against an fp32 torch reference."""

import os
import re
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.errors import ShapeError
from cutemk.layers import linear, mlp_graph, mlp_reference
from cutemk.runtime import compile_offline
from cutemk.tileop import TensorSpec

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF = torch.bfloat16


def rel_err(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


def proj_graph(
    k, n, dtype, epilogue=None, split_k=2, max_t=16, block=(64, 64), norm_eps=None, fuse=False
):
    """One projection through ``linear``: x (T, k) @ w^T with the epilogue (``norm_eps``:
    rmsnorm(x) @ w^T, the norm's weight folded into w; ``fuse``: the reduce in the partial
    tiles where it applies)."""
    g = mk.Graph("proj")
    t = mk.sym("T", max_t)
    x = g.input("x", (t, k), dtype)
    w = g.weight("w", (2 * n if epilogue == "silu_mul" else n, k), dtype)
    r = g.input("r", (t, n), dtype) if epilogue == "residual" else None
    y = linear(
        g,
        x,
        w,
        r,
        block_m=block[0],
        block_n=block[1],
        epilogue=epilogue,
        split_k=split_k,
        norm_eps=norm_eps,
        fuse_reduce=fuse,
    )
    g.output(y, "y")
    return g


def proj_reference(x, w, r, epilogue, norm_eps=None):
    x = x.float()
    if norm_eps is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps)
    y = x @ w.float().T
    if epilogue == "silu_mul":
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    if r is not None:
        y = y + r.float()
    return y


# -- CPU ------------------------------------------------------------------------------------
def test_split_choice_spreads_decode_weights_over_every_sm():
    # Qwen3-8B at one token, 64 x 256 partial tiles: gate/up has 96 column blocks, down 16
    assert ops.choose_split_k(1, 24576, 4096, 64, 256) == 4  # 384 tiles: 2.9 per SM
    assert ops.choose_split_k(1, 4096, 12288, 64, 256) == 8  # 128 tiles
    assert ops.choose_split_k(1, 4096, 4096, 64, 256) == 8
    # K that is not a whole number of slices, or too short to split, is not split
    assert ops.choose_split_k(1, 4096, 4000, 64, 256) == 1
    assert ops.choose_split_k(1, 4096, 64, 64, 256) == 1


def test_split_width_fills_the_waves():
    """With the partial tile width free (256, 192 or 128 columns) the busiest SM streams
    fewer weight columns: Qwen3-8B's QKV at 64 rows is 24 tiles of 256 (4 ranges: 96 SMs busy)
    or 32 of 192 (128 SMs); its gate/up 2 ranges of 128 tiles of 192 instead of 4 of 96 tiles;
    down and o_proj 4 ranges of 32 tiles of 128. An unsplit GEMM competes where it may (no
    folded norm needs the reduce)."""
    assert ops.choose_split(64, 6144, 4096, 64) == (4, 192)
    assert ops.choose_split(16, 24576, 4096, 64) == (2, 192)
    assert ops.choose_split(16, 4096, 12288, 64) == (4, 128)
    assert ops.choose_split(16, 4096, 4096, 64) == (4, 128)
    # Qwen3-8B's gate/up at 128 rows of 128-row tiles: one wave of 192-row tiles, unsplit
    assert ops.choose_split(128, 24576, 4096, 128, unsplit_width=192) == (1, 192)
    assert ops.choose_split(1, 4096, 4000, 64) == (1, 256)  # K not whole slices


def test_linear_splits_only_decode_sized_inputs():
    g = mk.Graph("lin")
    x = g.input("x", (mk.sym("T", 64), 4096), BF)
    xp = g.input("xp", (mk.sym("S", 4096), 4096), BF)
    w = g.weight("w", (4096, 4096), BF)
    linear(g, x, w, block_m=64, block_n=64, split_k=None, name="dec")
    linear(g, xp, w, block_m=128, block_n=128, split_k=None, name="pre")
    ops_by_name = {n.name: n.op for n in g.nodes}
    assert ops_by_name["dec"].name == "gemm_partial" and ops_by_name["dec"].split_k > 1
    assert ops_by_name["dec_sum"].name == "gemm_split_reduce"
    assert ops_by_name["pre"].name == "gemm"


def test_linear_passes_the_l2_prefetch_to_every_gemm_form():
    """``linear(l2_prefetch=True)``: the unsplit GEMM, the split partials and the in-tile split
    reduce's GEMM all carry it (their Hopper tile prefetches); a reduce step has no weights;
    a value other than a bool is refused."""
    g = mk.Graph("lin")
    x = g.input("x", (mk.sym("T", 64), 4096), BF)
    xp = g.input("xp", (mk.sym("S", 4096), 4096), BF)
    w = g.weight("w", (4096, 4096), BF)
    linear(g, x, w, block_m=64, block_n=64, split_k=None, l2_prefetch=True, name="dec")
    kw = {"block_m": 64, "block_n": 64, "split_k": None, "l2_prefetch": True}
    linear(g, x, w, fuse_reduce=True, name="fused", **kw)
    linear(g, xp, w, block_m=128, block_n=128, split_k=None, l2_prefetch=True, name="pre")
    linear(g, xp, w, block_m=128, block_n=128, split_k=None, name="plain")
    by = {n.name: n.op for n in g.nodes}
    assert [by[k].name for k in ("dec", "fused", "pre")] == ["gemm_partial", "gemm_split", "gemm"]
    assert all(by[k].l2_prefetch and by[k].prefetches_l2 for k in ("dec", "fused", "pre"))
    assert not by["plain"].prefetches_l2 and not by["dec_sum"].prefetches_l2
    with pytest.raises(TypeError, match="l2_prefetch"):
        ops.gemm(x.spec, w.spec, l2_prefetch=1)


def test_partial_refuses_ranges_that_are_not_whole_slices():
    a = TensorSpec((mk.sym("T", 16), 320), BF)
    b = TensorSpec((256, 320), BF)
    with pytest.raises(ShapeError, match="multiple of split_k"):
        ops.gemm_partial(a, b, split_k=2)  # 160 per range
    with pytest.raises(ValueError, match="no epilogue"):
        ops.GemmPartialTile(a, b, 64, 64, "silu_mul", None, None, 5)


def test_split_ops_refuse_bad_configurations():
    T16 = mk.sym("T", 16)
    a = TensorSpec((T16, 512), BF)
    b = TensorSpec((256, 512), BF)
    with pytest.raises(ValueError, match="split_k must be >= 2"):
        ops.gemm_partial(a, b, split_k=1)  # one range would compile as a 2-D GEMM
    with pytest.raises(TypeError, match="fp32 partials"):
        ops.GemmPartialTile(a, b, 64, 64, None, BF, None, 2)
    part = TensorSpec((2, T16, 256), torch.float32)
    with pytest.raises(TypeError, match="out_dtype"):
        ops.gemm_split_reduce(part, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="got 2 operands"):
        ops.gemm_split_reduce(part, TensorSpec((T16, 256), BF), TensorSpec((T16, 256), BF))
    with pytest.raises(Exception, match="must have dtype"):
        ops.gemm_split_reduce(part, TensorSpec((T16, 512), torch.int32), norm_eps=1e-6)
    # x must be the partial GEMM's A: its width is the partials' K
    g = mk.Graph("bad_norm")
    x = g.input("x", (T16, 512), BF)
    other = g.input("other", (T16, 384), BF)
    w = g.weight("w", (256, 512), BF)
    p = g.call(ops.gemm_partial, x, w, split_k=2)
    y = g.call(ops.gemm_split_reduce, p, other, norm_eps=1e-6)
    g.output(y, "y")
    with pytest.raises(mk.GraphError, match="K=512"):
        g.validate()


def test_reduce_waits_only_for_its_columns_partials():
    """Event granularity: a reduce tile waits for the partial tiles of its own column block
    (every K range), not for the whole partial GEMM."""
    g = proj_graph(512, 1024, torch.float32, split_k=4, block=(16, 32))
    c = g.compile("interpret", num_sms=4)
    plan = c.plan({"T": 3})
    part_node, red_node = 0, 1
    partial_tasks = plan.node_tasks[part_node]
    producers_of: dict[int, set[int]] = {}
    for task, events in enumerate(plan.notifies):
        for e in events:
            producers_of.setdefault(e, set()).add(task)
    for task in plan.node_tasks[red_node]:
        producers = {p for e in plan.waits[task] for p in producers_of[e]}
        assert producers and producers < set(partial_tasks)
        # 512 reduce columns of 256-wide partial tiles: 2 column blocks x 4 ranges
        assert len(producers) == 8


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("split_k", [2, 4, None])
def test_split_mlp_matches_torch_on_the_interpreter(scheduler, split_k):
    g = mlp_graph(
        mk.sym("T", max=16), hidden=512, intermediate=256, block_m=8, block_n=16, split_k=split_k
    )
    names = [n.name for n in g.nodes]
    if split_k is not None:
        assert names == ["gate_up", "gate_up_sum", "down", "down_sum"]
    c = g.compile("interpret", num_sms=5, scheduler=scheduler)
    gen = torch.Generator().manual_seed(4)
    wgu, wd = torch.randn(512, 512, generator=gen) / 22, torch.randn(512, 256, generator=gen) / 16
    for t in (1, 7, 16):
        x = torch.randn(t, 512, generator=gen)
        assert rel_err(c(x, wgu, wd), mlp_reference(x, wgu, wd)) < 1e-5


@pytest.mark.parametrize("epilogue", [None, "silu_mul", "residual"])
def test_split_projection_epilogues_on_the_interpreter(epilogue):
    c = proj_graph(256, 96, torch.float32, epilogue, split_k=2, block=(8, 32)).compile(
        "interpret", num_sms=3
    )
    gen = torch.Generator().manual_seed(0)
    nb = 2 if epilogue == "silu_mul" else 1
    w = torch.randn(nb * 96, 256, generator=gen) / 16
    for t in (1, 9):
        x = torch.randn(t, 256, generator=gen)
        r = torch.randn(t, 96, generator=gen) if epilogue == "residual" else None
        args = (x, w) if r is None else (x, w, r)
        assert rel_err(c(*args), proj_reference(x, w, r, epilogue)) < 1e-5


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("epilogue", [None, "silu_mul"])
def test_folded_norm_on_the_interpreter(split_k, epilogue):
    """rmsnorm(x) * g @ W^T as x @ fold_norm(W, g)^T: split, the reduce tiles scale each row
    by x's inverse RMS (no norm node); unsplit, a weightless rmsnorm node runs first."""
    from cutemk.layers import fold_norm

    g = proj_graph(256, 96, torch.float32, epilogue, split_k, block=(8, 32), norm_eps=1e-5)
    assert any(n.op.name == "rmsnorm" for n in g.nodes) == (split_k == 1)
    c = g.compile("interpret", num_sms=3)
    gen = torch.Generator().manual_seed(7)
    nb = 2 if epilogue == "silu_mul" else 1
    w = torch.randn(nb * 96, 256, generator=gen) / 16
    gamma = 1 + 0.1 * torch.randn(256, generator=gen)
    for t in (1, 11):
        x = 3 * torch.randn(t, 256, generator=gen)
        want = proj_reference(x, w * gamma, None, epilogue, norm_eps=1e-5)
        assert rel_err(c(x, fold_norm(w, gamma)), want) < 1e-5


def norm_chain_graph(k, n, dtype, max_t=16, block=(64, 64), split2=2, fuse=False):
    """h = a @ w1^T + r (split, ``sumsq``; ``fuse``: reduced in its last partial tiles where
    the Hopper tile runs it), then rmsnorm(h) @ w2^T with SiLU-mul (``split2`` ranges, the
    norm folded into w2 and taken from h's sums of squares: by the reduce tiles, or unsplit by
    the GEMM's epilogue): the decoder layer's o_proj -> gate/up. Outputs h and y."""
    g = mk.Graph("norm_chain")
    t = mk.sym("T", max_t)
    a = g.input("a", (t, k), dtype)
    r = g.input("r", (t, k), dtype)
    w1 = g.weight("w1", (k, k), dtype)
    w2 = g.weight("w2", (2 * n, k), dtype)
    tiles = {"block_m": block[0], "block_n": block[1]}
    h, ss = linear(g, a, w1, r, **tiles, split_k=2, sumsq=True, fuse_reduce=fuse, name="o")
    y = linear(
        g,
        h,
        w2,
        **tiles,
        split_k=split2,
        norm_eps=1e-6,
        norm_sumsq=ss,
        epilogue="silu_mul",
        name="gu",
    )
    g.output(h, "h")
    g.output(y, "y")
    return g


def norm_chain_reference(a, r, w1, w2, gamma, h):
    """y from the h the graph computed (rounded as it stored it)."""
    want_h = a.float() @ w1.float().T + r.float()
    return want_h, proj_reference(h, w2.float() * gamma.float(), None, "silu_mul", 1e-6)


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_norm_from_sums_of_squares_on_the_interpreter(scheduler):
    """The second projection's reduce tiles scale rows by the norm of h that the first one's
    reduce tiles summed (three column blocks of 512 a row), reading no row of h."""
    from cutemk.layers import fold_norm

    k = 1536
    g = norm_chain_graph(k, 64, torch.float32, block=(8, 64))
    gu = next(n for n in g.nodes if n.name == "gu_sum")
    assert gu.op.norm_width == k and tuple(gu.op.x.shape)[1] == 3
    c = g.compile("interpret", num_sms=5, scheduler=scheduler)
    gen = torch.Generator().manual_seed(8)
    w1 = torch.randn(k, k, generator=gen) / k**0.5
    w2 = torch.randn(128, k, generator=gen) / k**0.5
    gamma = 1 + 0.1 * torch.randn(k, generator=gen)
    for t in (1, 9):
        a, r = torch.randn(t, k, generator=gen), torch.randn(t, k, generator=gen)
        h, y = c(a, r, w1, fold_norm(w2, gamma))
        want_h, want_y = norm_chain_reference(a, r, w1, w2, gamma, h)
        assert rel_err(h, want_h) < 1e-5 and rel_err(y, want_y) < 1e-5


@pytest.mark.parametrize("split2", [1, 2])
@pytest.mark.parametrize("fuse", [False, True], ids=["step", "in_tiles"])
def test_norm_in_the_gemm_epilogue_on_the_interpreter(fuse, split2):
    """Unsplit (``split2`` 1), a 16-bit projection scales its rows by the norm from h's sums
    of squares in its epilogue (no norm node, no reduce); split, its reduce tiles do. h's
    sums of squares come from its reduce step, or (``fuse``) from its last partial tiles
    (``gemm_split`` with ``sumsq``: 128 columns a sum)."""
    from cutemk.layers import fold_norm

    k = 1536
    g = norm_chain_graph(k, 64, BF, block=(64, 64), split2=split2, fuse=fuse)
    o = next(n for n in g.nodes if n.name == "o")
    assert o.op.name == ("gemm_split" if fuse else "gemm_partial")
    if fuse:
        assert o.op.sumsq and o.op.sm90().reduce_sumsq and o.op.ss_cols == k // 128
    gu = next(n for n in g.nodes if n.name == ("gu" if split2 == 1 else "gu_sum"))
    assert gu.op.name == ("gemm" if split2 == 1 else "gemm_split_reduce")
    assert gu.op.norm_width == k
    assert not any(n.op.name == "rmsnorm" for n in g.nodes)
    c = g.compile("interpret", num_sms=5)
    gen = torch.Generator().manual_seed(10)
    w1 = (torch.randn(k, k, generator=gen) / k**0.5).to(BF)
    w2 = (torch.randn(128, k, generator=gen) / k**0.5).to(BF)
    gamma = (1 + 0.1 * torch.randn(k, generator=gen)).to(BF)
    for t in (1, 9):
        a = torch.randn(t, k, generator=gen).to(BF)
        r = (3 * torch.randn(t, k, generator=gen)).to(BF)
        h, y = c(a, r, w1, fold_norm(w2, gamma))
        want_h, want_y = norm_chain_reference(a, r, w1, w2, gamma, h)
        assert rel_err(h, want_h) < 1e-2 and rel_err(y, want_y) < 1e-2


def split_op_graph(k, n, dtype, epilogue, split_k, max_t=16, block=(8, 32)):
    """One ``ops.gemm_split`` node (the reduce in the partial tiles), called directly."""
    g = mk.Graph("split_in_tiles")
    t = mk.sym("T", max_t)
    x = g.input("x", (t, k), dtype)
    w = g.weight("w", (2 * n if epilogue == "silu_mul" else n, k), dtype)
    res = (g.input("r", (t, n), dtype),) if epilogue == "residual" else ()
    c, _, _ = g.call(
        ops.gemm_split,
        x,
        w,
        *res,
        split_k=split_k,
        epilogue=epilogue,
        block_m=block[0],
        block_n=block[1],
    )
    g.output(c, "y")
    return g


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("epilogue", [None, "silu_mul", "residual"])
def test_reduce_in_the_partial_tiles_on_the_interpreter(scheduler, epilogue):
    """gemm_split: the last partial tile of each output block sums the ranges and applies the
    epilogue (a partial last row block: T=9 of 8-row tiles, a partial last column block: 100
    columns of 32 without silu_mul); its counters are back at zero after every launch (the
    interpreter checks), so the same graph is right launch after launch."""
    n = 96 if epilogue == "silu_mul" else 100
    c = split_op_graph(256, n, torch.float32, epilogue, 4).compile(
        "interpret", num_sms=5, scheduler=scheduler
    )
    gen = torch.Generator().manual_seed(11)
    nb = 2 if epilogue == "silu_mul" else 1
    w = torch.randn(nb * n, 256, generator=gen) / 16
    for t in (1, 9, 16, 1):
        x = torch.randn(t, 256, generator=gen)
        r = torch.randn(t, n, generator=gen) if epilogue == "residual" else None
        y = c(x, w) if r is None else c(x, w, r)
        assert rel_err(y, proj_reference(x, w, r, epilogue)) < 1e-5, f"T={t}"


def sumsq_graph(block_m):
    """One gemm_split with ``sumsq`` (+ residual; 320 columns in 128-wide blocks: a last
    block of 64, its sums one column). Outputs y and ss."""
    g = mk.Graph("split_sumsq")
    t = mk.sym("T", 16)
    x = g.input("x", (t, 256), BF)
    w = g.weight("w", (320, 256), BF)
    r = g.input("r", (t, 320), BF)
    c, _, _, ss = g.call(
        ops.gemm_split, x, w, r, split_k=2, block_m=block_m, block_n=128, sumsq=True
    )
    g.output(c, "y")
    g.output(ss, "ss")
    return g


def check_sumsq(run, gen, device, ss_tol):
    """``ss[row, j]`` is the sum of the squares of columns [128 j, 128 j + 128) of y's row as
    stored (T = 1, 9, 16)."""
    wt = (torch.randn(320, 256, generator=gen, device=device) / 16).to(BF)
    for n in (1, 9, 16):
        xt = torch.randn(n, 256, generator=gen, device=device).to(BF)
        rt = torch.randn(n, 320, generator=gen, device=device).to(BF)
        y, s = run(xt, wt, rt)
        assert rel_err(y, proj_reference(xt, wt, rt, "residual")) < 1e-2, f"T={n}"
        sq = y.float().square()
        want = torch.stack([sq[:, j : j + 128].sum(-1) for j in (0, 128, 256)], dim=1)
        assert s.shape == (n, 3) and rel_err(s, want) < ss_tol, f"T={n}"


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_sums_of_squares_from_the_partial_tiles_on_the_interpreter(scheduler):
    """gemm_split with ``sumsq``: ``ss`` as :func:`check_sumsq` says, an output a reader can
    wait for."""
    run = sumsq_graph(8).compile("interpret", num_sms=3, scheduler=scheduler)
    check_sumsq(run, torch.Generator().manual_seed(12), "cpu", 1e-5)


def test_reduce_in_the_partial_tiles_waits_for_the_whole_group():
    """A reader of gemm_split's output waits for every partial tile of its columns (any of
    them may be the one that reduces): with silu_mul its gate block's ranges and its up
    block's, and no other tile."""
    g = mk.Graph("split_reader")
    t = mk.sym("T", 16)
    x = g.input("x", (t, 256), torch.float32)
    w = g.weight("w", (256, 256), torch.float32)  # gate and up: 128 rows each, 2 blocks of 64
    w2 = g.weight("w2", (32, 128), torch.float32)
    c, _, _ = g.call(ops.gemm_split, x, w, split_k=2, epilogue="silu_mul", block_m=8, block_n=64)
    # K range s of the reader reads c's columns [64 s, 64 s + 64): output block s
    g.output(g.call(ops.gemm_partial, c, w2, split_k=2, block_m=8, block_n=32), "p")
    plan = g.compile("interpret", num_sms=4).plan({"T": 3})
    coord = {task: plan.tasks[task].coord for task in plan.node_tasks[0]}
    producers_of: dict[int, set[int]] = {}
    for task, events in enumerate(plan.notifies):
        for e in events:
            producers_of.setdefault(e, set()).add(task)
    for task in plan.node_tasks[1]:
        s = plan.tasks[task].coord[1] % 2
        producers = {p for e in plan.waits[task] for p in producers_of[e]}
        # partial column blocks s (gate) and s + 2 (up), ranges 0 and 1 of each
        assert sorted(coord[p][1] for p in producers) == [2 * s, 2 * s + 1, 4 + 2 * s, 5 + 2 * s]


def test_linear_fuses_the_reduce_only_where_the_hopper_tile_runs():
    """``fuse_reduce``: a 16-bit split projection becomes one gemm_split node; fp32 (no Hopper
    tile), a folded norm, or a silu_mul whose gate half is not a whole number of partial tiles
    keep the reduce node."""

    def ops_of(*args, **kw):
        return [n.op.name for n in proj_graph(*args, fuse=True, **kw).nodes]

    for epi in (None, "silu_mul", "residual"):
        assert ops_of(1024, 512, BF, epi, split_k=4, block=(64, 128)) == ["gemm_split"]
        assert ops_of(1024, 512, torch.float32, epi, split_k=4, block=(64, 128)) == [
            "gemm_partial",
            "gemm_split_reduce",
        ]
    # 2 x 320 gate/up rows in 256-wide partial tiles: gate block 1 would hold up rows
    assert ops_of(1024, 320, BF, "silu_mul", split_k=4) == ["gemm_partial", "gemm_split_reduce"]
    assert ops_of(1024, 512, BF, None, split_k=4, norm_eps=1e-6) == [
        "gemm_partial",
        "gemm_split_reduce",
    ]


def test_gemm_split_refuses_bad_configurations():
    x = TensorSpec((mk.sym("T", 16), 512), BF)
    with pytest.raises(ShapeError, match="multiple of block_n"):
        ops.gemm_split(x, TensorSpec((640, 512), BF), split_k=2, epilogue="silu_mul")
    with pytest.raises(ShapeError, match="multiples of 4"):
        ops.gemm_split(x, TensorSpec((254, 512), BF), split_k=2, block_n=64)
    with pytest.raises(ShapeError, match="whole number"):
        ops.gemm_split(x, TensorSpec((256, 512), BF), split_k=3)
    with pytest.raises(ValueError, match=">= 2"):
        ops.gemm_split(x, TensorSpec((256, 512), BF), split_k=1)
    with pytest.raises(ValueError, match="sumsq"):  # a silu_mul output is no norm's input
        ops.gemm_split(x, TensorSpec((512, 512), BF), split_k=2, epilogue="silu_mul", sumsq=True)
    with pytest.raises(ValueError, match="sumsq"):  # a warp's 128 columns make one sum
        ops.gemm_split(x, TensorSpec((256, 512), BF), split_k=2, block_n=64, sumsq=True)
    with pytest.raises(ValueError, match="no row norm"):
        ops.GemmSplitTile(
            x,
            TensorSpec((256, 512), BF),
            norm_ss=TensorSpec((mk.sym("T", 16), 4), torch.float32),
            norm_width=512,
            norm_eps=1e-6,
            split_k=2,
        )
    # a last block of 64 columns: its sums of squares are one column (of three)
    op = ops.gemm_split(x, TensorSpec((320, 512), BF), split_k=2, block_n=128, sumsq=True)
    assert op.outputs == ("c", "part", "counts", "ss") and op.ss_cols == 3


def test_split_mlp_with_the_reduce_in_the_tiles_compiles_for_hopper(spill_stores):
    """The Qwen3-8B MLP of one token as MegaMLP builds it under ``CUTEMK_SPLIT_REDUCE=tiles``:
    gate/up and down as gemm_split tiles (no reduce node), the counters' acq_rel adds in the
    PTX, no spills."""
    from cutemk.regimes import mlp_regime_graph

    os.environ["CUTEMK_SPLIT_REDUCE"] = "tiles"
    try:
        g = mlp_regime_graph(4096, 12288, "gemv1", BF, 1)
    finally:
        del os.environ["CUTEMK_SPLIT_REDUCE"]
    assert [n.op.name for n in g.nodes] == ["gemm_split", "gemm_split"]
    assert [n.op.sm90().reduce for n in g.nodes] == ["silu_mul", "sum"]
    with tempfile.TemporaryDirectory() as d:
        compile_offline(g, "static", options=f"--keep-ptx --dump-dir={d}")
        (path,) = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx")]
        ptx = open(path).read()
        assert "wgmma.mma_async" in ptx
        assert ptx.count("atom.global.acq_rel.add") >= 2  # one count per gemm_split node
        assert "ld.global.v4" in ptx  # the reducing tile loads 16-byte vectors of partials
        # thread 0's verdict (last tile or not) reaches the consumers through their barrier
        # (barrier.cta.red.or), not a shared word
        assert re.search(r"\bbarrier\.red\.or\.pred\s+%p\d+, 5, 256, %p\d+;", ptx)
        assert spill_stores(path) == 0


def test_split_mlp_compiles_for_hopper(spill_stores):
    """Qwen3-8B MLP, decode-sized: gate/up unsplit in one wave of 96-column fused tiles, down
    as partial tiles on the Hopper path (TMA + wgmma, stored from registers) and reduce tiles
    on the SIMT group with 16-byte loads; no spills."""
    g = mlp_graph(mk.sym("T", max=16), 4096, 12288, BF, 64, 128, fuse_silu=True, split_k=None)
    gate_up = next(n.op for n in g.nodes if n.name == "gate_up")
    assert gate_up.name == "gemm" and gate_up.block_n == 96 and gate_up.sm90() is not None
    parts = [n.op for n in g.nodes if n.op.name == "gemm_partial"]
    assert [(p.split_k, p.block_n) for p in parts] == [(4, 128)]
    assert all(p.sm90() is not None and p.sm90().epi_bytes == 0 for p in parts)
    with tempfile.TemporaryDirectory() as d:
        compile_offline(g, "static", options=f"--keep-ptx --dump-dir={d}")
        (path,) = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx")]
        ptx = open(path).read()
        assert "wgmma.mma_async" in ptx
        assert "ld.global.v4.b32" in ptx  # the reduce tiles load 16-byte vectors
        assert spill_stores(path) == 0  # a reduce pass holding too many partials spilled


# -- GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("split_k", [2, None])
@pytest.mark.parametrize("early,epi", [("0", "0"), ("1", "0"), ("1", "1")])
@pytest.mark.parametrize("fuse", [False, True], ids=["step", "in_tiles"])
def test_split_mlp_on_the_gpu(scheduler, split_k, early, epi, fuse, monkeypatch):
    """early: ``CUTEMK_EARLY_HANDOVER`` (tasks without events handed over before their
    loads); epi: ``CUTEMK_EPI_MBARRIER`` (the staging buffer released by an mbarrier); fuse:
    the reduce in the partial tiles (gemm_split) or a reduce step."""
    monkeypatch.setenv("CUTEMK_EARLY_HANDOVER", early)
    monkeypatch.setenv("CUTEMK_EPI_MBARRIER", epi)
    torch.manual_seed(3)
    H, I = 1024, 1536
    g = mlp_graph(
        mk.sym("T", max=16), H, I, BF, 64, 128, fuse_silu=True, split_k=split_k, fuse_reduce=fuse
    )
    split_op = "gemm_split" if fuse else "gemm_partial"
    assert any(n.op.name == split_op for n in g.nodes)
    c = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
    wgu = (torch.randn(2 * I, H, device="cuda") / H**0.5).to(BF)
    wd = (torch.randn(H, I, device="cuda") / I**0.5).to(BF)
    for t in (1, 5, 16):
        x = torch.randn(t, H, device="cuda").to(BF)
        y = c(x, wgu, wd)
        assert not torch.isnan(y).any()
        assert rel_err(y, mlp_reference(x, wgu, wd)) < 1e-2, f"T={t}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("split_k", [1, 4])
def test_folded_norm_on_the_gpu(split_k):
    from cutemk.layers import fold_norm

    torch.manual_seed(6)
    k, n = 1024, 512
    c = proj_graph(k, n, BF, "silu_mul", split_k, norm_eps=1e-6).compile(
        "cute", watchdog=True, poison_outputs=True
    )
    w = (torch.randn(2 * n, k, device="cuda") / k**0.5).to(BF)
    gamma = (1 + 0.1 * torch.randn(k, device="cuda")).to(BF)
    wf = fold_norm(w, gamma)
    for t in (1, 7, 16):
        x = (3 * torch.randn(t, k, device="cuda")).to(BF)
        y = c(x, wf)
        assert not torch.isnan(y).any()
        want = proj_reference(x, w.float() * gamma.float(), None, "silu_mul", norm_eps=1e-6)
        assert rel_err(y, want) < 1e-2, f"T={t}"


def test_sums_of_squares_from_the_partial_tiles_compiles_for_hopper(tmp_path):
    """The GPU case below compiles for sm_90a: the sums' warp shuffle is in the PTX."""
    from cutemk.kernels import compile_offline

    compile_offline(sumsq_graph(64), "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert "shfl.sync.bfly" in ptx_file.read_text()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_sums_of_squares_from_the_partial_tiles_on_the_gpu(scheduler):
    """The Hopper tile's in-tile reduce with sums of squares (a warp shuffle a 128-column
    group): a partial last column block (64 of 128 columns, half a tile's warps without a
    column), 64-row tiles with 1-16 live rows; fp32 summation orders differ from torch's."""
    g = sumsq_graph(64)
    assert g.nodes[0].op.sm90().reduce_sumsq
    run = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
    check_sumsq(run, torch.Generator(device="cuda").manual_seed(13), "cuda", 1e-4)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "scheduler,split2,fuse",
    [
        ("static", 2, False),
        ("dynamic", 2, False),
        ("static", 1, False),
        ("static", 1, True),
        ("dynamic", 2, True),
    ],
)
def test_norm_from_sums_of_squares_on_the_gpu(scheduler, split2, fuse):
    """split2 1: the gate/up GEMM applies the norm in its epilogue (64 x 96 fused tiles);
    ``fuse``: h and its sums of squares from the first projection's last partial tiles."""
    from cutemk.layers import fold_norm

    torch.manual_seed(9)
    k, n = 1536, 480
    g = norm_chain_graph(k, n, BF, block=(64, 96), split2=split2, fuse=fuse)
    assert (g.nodes[0].op.name == "gemm_split") == fuse
    c = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
    w1 = (torch.randn(k, k, device="cuda") / k**0.5).to(BF)
    w2 = (torch.randn(2 * n, k, device="cuda") / k**0.5).to(BF)
    gamma = (1 + 0.1 * torch.randn(k, device="cuda")).to(BF)
    for t in (1, 7, 16):
        a = torch.randn(t, k, device="cuda").to(BF)
        r = (3 * torch.randn(t, k, device="cuda")).to(BF)
        h, y = c(a, r, w1, fold_norm(w2, gamma))
        assert not torch.isnan(y).any()
        want_h, want_y = norm_chain_reference(a, r, w1, w2, gamma, h)
        assert rel_err(h, want_h) < 1e-2 and rel_err(y, want_y) < 1e-2, f"T={t}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [BF, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("epilogue", [None, "silu_mul", "residual"])
@pytest.mark.parametrize("fuse", [False, True], ids=["step", "in_tiles"])
def test_split_projection_on_the_gpu(dtype, epilogue, fuse):
    """Every epilogue; fp32 runs the portable partial tile (SIMT) and the scalar reduce; fuse:
    16-bit projections reduce in the partial tiles (256-wide: 320 columns end in a partial
    column block, T=40 in a partial block of 64 rows; silu_mul needs whole gate blocks, so
    2 x 512 rows there)."""
    torch.manual_seed(5)
    k, n = 768, 202 if dtype == torch.float32 else 320  # 202: the reduce's scalar path
    if fuse and dtype == BF and epilogue == "silu_mul":
        n = 512
    g = proj_graph(k, n, dtype, epilogue, split_k=3, max_t=40, fuse=fuse)
    assert (g.nodes[0].op.name == "gemm_split") == (fuse and dtype == BF)
    c = g.compile("cute", watchdog=True, poison_outputs=True)
    nb = 2 if epilogue == "silu_mul" else 1
    w = (torch.randn(nb * n, k, device="cuda") / k**0.5).to(dtype)
    for t in (1, 7, 40):
        x = torch.randn(t, k, device="cuda").to(dtype)
        r = torch.randn(t, n, device="cuda").to(dtype) if epilogue == "residual" else None
        y = c(x, w) if r is None else c(x, w, r)
        assert not torch.isnan(y).any()
        tol = 1e-2 if dtype == BF else 1e-5
        assert rel_err(y, proj_reference(x, w, r, epilogue)) < tol, f"T={t}"
        if fuse:  # the same bits again: the range order is fixed, the counters back at zero
            assert torch.equal(y, c(x, w) if r is None else c(x, w, r))


def test_norm_width_needs_sums_of_squares_from_a_reduce():
    """A reduce told to take its norm from sums of squares refuses an x that no ``sumsq``
    reduce wrote (it would read K-wide rows as block sums)."""
    from cutemk.errors import GraphError

    g = mk.Graph("bad_norm_source")
    t = mk.sym("T", 16)
    a = g.input("a", (t, 256), torch.float32)
    w = g.weight("w", (64, 256), torch.float32)
    ss = g.input("ss", (t, 1), torch.float32)
    part = g.call(ops.gemm_partial, a, w, split_k=2, block_m=16, block_n=64)
    g.output(g.call(ops.gemm_split_reduce, part, ss, norm_eps=1e-6, norm_width=256), "y")
    with pytest.raises(GraphError, match="sumsq"):
        g.compile("interpret", num_sms=2)


def test_the_regime_builders_name_what_is_wrong():
    """An unknown regime was a raw KeyError, ``num_sms=0`` a ZeroDivisionError (0 and -1
    otherwise passed or were replaced by 132), a bad option a raw TypeError."""
    from cutemk import regimes

    for call, err, match in [
        (lambda: regimes.mlp_regime_graph(64, 48, "decod", BF, 64), ValueError, "no MLP regime"),
        (
            lambda: regimes.moe_regime_graph(64, 48, 8, 2, True, "slot", BF, 64),
            ValueError,
            "no MoE regime",
        ),
        (lambda: regimes.moe_tiles("decode", 64, backend="cuda"), ValueError, "no MoE tiles"),
        (
            lambda: regimes.mlp_regime_graph(4096, 12288, "decode", BF, 128, num_sms=0),
            ValueError,
            "num_sms must be a positive int",
        ),
        (
            lambda: regimes.moe_tiles("decode", 64, num_sms=0, intermediate=48, top_k=2),
            ValueError,
            "num_sms must be a positive int",
        ),
        (
            lambda: regimes.moe_regime_graph(
                64, 48, 8, 2, True, "decode", BF, 64, options={"router_split": "x"}
            ),
            TypeError,
            "router_split",
        ),
        (
            lambda: regimes.moe_tiles("decode", 64, overrides={"block_q": 4}),
            ValueError,
            "unknown 'block_q'",
        ),
    ]:
        with pytest.raises(err, match=match):
            call()


def test_zero_blocks_and_string_flags_are_refused():
    """``split_block_n=0`` ran with 256, ``rs_block_m=0`` / ``ag_block_n=0`` with the defaults,
    ``fuse_silu="no"`` fused, an int for the token sym failed when planned, a one-element
    ``down_block`` was a raw unpack error."""
    from cutemk.tp import ag_gemm_graph, gemm_rs_graph

    T = mk.sym("T", max=64)
    g = mk.Graph("lin")
    x, w = g.input("x", (T, 64)), g.weight("w", (64, 64))
    for kwargs, err, match in [
        (dict(split_k=2, split_block_n=0), ValueError, "split_block_n must be a positive int"),
        (dict(block_n=0), ValueError, "block_n must be a positive int"),
        (dict(fuse_reduce="no"), TypeError, "fuse_reduce must be True or False"),
    ]:
        with pytest.raises(err, match=match):
            linear(g, x, w, **{"block_m": 16, "block_n": 64, **kwargs})
    with pytest.raises(TypeError, match="fuse_silu must be True or False"):
        mlp_graph(T, 64, 48, fuse_silu="no")
    with pytest.raises(ValueError, match="down_block must be a pair"):
        mlp_graph(T, 64, 48, down_block=(16,))
    with pytest.raises(ValueError, match="rs_block_m must be a positive int"):
        gemm_rs_graph(T, 48, 96, 2, rs_block_m=0)
    with pytest.raises(ValueError, match="ag_block_n must be a positive int"):
        ag_gemm_graph(T, 48, 96, 2, ag_block_n=0)
    with pytest.raises(TypeError, match="tokens must be a sym"):
        gemm_rs_graph(64, 48, 96, 2)
    with pytest.raises(ValueError, match="k_shard must be a positive int"):
        gemm_rs_graph(T, 0, 96, 2)
