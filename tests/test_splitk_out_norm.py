"""The split projection's reduce that also writes the norm of the rows it stores
(``ops.gemm_split_reduce(out_norm=...)``, ``linear(out_norm=...)``): its refusals, the
interpreter against the norm of the stored rows, the sm_90a compile and the GPU."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch
from test_splitk import BF, proj_reference, rel_err, requires_cuda

import cutemk as mk
from cutemk import ops
from cutemk.errors import ShapeError
from cutemk.layers import linear
from cutemk.runtime import compile_offline
from cutemk.tileop import TensorSpec


def out_norm_graph(k: int, n: int, dtype, max_t: int = 16):
    """h = a @ w^T + r through a split projection whose reduce also writes y = rmsnorm(h) * g
    (``linear(out_norm=...)``)."""
    g = mk.Graph("out_norm")
    t = mk.sym("T", max_t)
    a = g.input("a", (t, k), dtype)
    r = g.input("r", (t, n), dtype)
    w = g.weight("w", (n, k), dtype)
    gamma = g.weight("gamma", (n,), dtype)
    h, y = linear(g, a, w, r, block_m=64, block_n=64, split_k=2, out_norm=gamma, out_norm_eps=1e-6)
    assert y is not None
    g.output(h, "h")
    g.output(y, "y")
    return g


def out_norm_reference(h, gamma):
    """``ops.rmsnorm``'s arithmetic on the stored rows h."""
    hf = h.float()
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.float()


def check_out_norm(run, k, n, dtype, gen, device, tol):
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    gamma = (1 + 0.1 * torch.randn(n, generator=gen, device=device)).to(dtype)
    for t in (1, 3, 16):
        a = torch.randn(t, k, generator=gen, device=device).to(dtype)
        r = (3 * torch.randn(t, n, generator=gen, device=device)).to(dtype)
        h, y = run(a, r, w, gamma)
        want_h = proj_reference(a, w, r, "residual")
        assert rel_err(h, want_h) < tol, f"T={t}: h"
        # y against the norm of the h the kernel stored (its rounding is the reduce's)
        assert rel_err(y, out_norm_reference(h, gamma)) < tol, f"T={t}: y"
        assert not torch.isnan(y).any()


def test_out_norm_refuses_what_it_cannot_hold():
    part = TensorSpec((2, mk.sym("T", 8), 256), torch.float32)
    r = TensorSpec((mk.sym("T", 8), 256), BF)
    with pytest.raises(ShapeError, match="whole rows"):
        ops.gemm_split_reduce(
            part, r, block_n=128, out_norm=TensorSpec((256,), BF), out_norm_eps=1e-6
        )
    with pytest.raises(TypeError, match="out_norm must be"):
        ops.gemm_split_reduce(
            part, r, out_norm=TensorSpec((256,), torch.float32), out_norm_eps=1e-6
        )
    with pytest.raises(ValueError, match="go together"):
        ops.gemm_split_reduce(part, r, out_norm=TensorSpec((256,), BF))
    wide = TensorSpec((2, 4, 4096), torch.float32)
    with pytest.raises(ShapeError, match="vectors a thread"):
        ops.gemm_split_reduce(wide, out_norm=TensorSpec((4096,), BF), out_norm_eps=1e-6)
    assert not ops.out_norm_fits(4096, BF) and ops.out_norm_fits(2048, BF)
    # every range's partials of a thread's vectors are in registers at once: 4 vectors of 8
    # ranges (the Qwen3-30B-A3B o_proj) fit, of 16 they would spill; 2 vectors of 16 fit
    assert ops.out_norm_fits(2048, BF, split=8) and not ops.out_norm_fits(2048, BF, split=16)
    assert ops.out_norm_fits(1024, BF, split=16) and not ops.out_norm_fits(1024, BF, split=32)
    deep = TensorSpec((16, 4, 2048), torch.float32)
    with pytest.raises(ShapeError, match="fp32 partials a thread"):
        ops.gemm_split_reduce(deep, out_norm=TensorSpec((2048,), BF), out_norm_eps=1e-6)
    op = ops.gemm_split_reduce(part, r, out_norm=TensorSpec((256,), BF), out_norm_eps=1e-6)
    assert op.block_n == 256 and op.outputs == ("c", "y")


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("n", [320, 2048])
def test_out_norm_on_the_interpreter(scheduler, n):
    """h and its norm from one reduce node: 320 columns (80 vectors: 48 of the 128 threads
    hold none), 2048 (four vectors a thread, the most); the norm matches ``ops.rmsnorm``'s
    reference on h."""
    g = out_norm_graph(256, n, torch.float32)
    assert [nd.op.name for nd in g.nodes] == ["gemm_partial", "gemm_split_reduce"]
    c = g.compile("interpret", num_sms=5, scheduler=scheduler)
    check_out_norm(c, 256, n, torch.float32, torch.Generator().manual_seed(3), "cpu", 1e-5)


def test_out_norm_compiles_for_hopper(tmp_path):
    """Both device forms compile for sm_90a: every thread's vectors live (2048 columns: no
    store guards) and a ragged width (320), each with its block sum's warp shuffles."""
    for n in (320, 2048):
        d = tmp_path / str(n)
        d.mkdir()
        compile_offline(out_norm_graph(256, n, BF), "static", options=f"--keep-ptx --dump-dir={d}")
        (ptx_file,) = d.glob("*.ptx")
        ptx = ptx_file.read_text()
        assert "shfl.sync.bfly" in ptx and "rsqrt" in ptx


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("n", [320, 2048])
def test_out_norm_on_the_gpu(scheduler, n):
    """The reduce with the norm on the GPU, bf16, outputs poisoned before each run."""
    g = out_norm_graph(256, n, BF)
    c = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
    check_out_norm(c, 256, n, BF, torch.Generator(device="cuda").manual_seed(4), "cuda", 1e-2)


def test_linear_keeps_the_norm_phase_where_out_norm_does_not_fit():
    """A reduce that cannot hold the norm (N past 2048 here) gives (y, None), its reduce as
    asked (in the partial tiles where ``fuse_reduce`` and the Hopper tile allow), so the caller
    adds the norm; bad eps or dtype are errors, not a quiet fallback."""
    for n, fuse, want in ((4096, True, "gemm_split"), (4096, False, "gemm_split_reduce")):
        g = mk.Graph("wide")
        t = mk.sym("T", 16)
        a, r = g.input("a", (t, 256), BF), g.input("r", (t, n), BF)
        w, gamma = g.weight("w", (n, 256), BF), g.weight("gamma", (n,), BF)
        kw = dict(block_m=64, block_n=64, split_k=2, fuse_reduce=fuse, out_norm=gamma)
        h, y = linear(g, a, w, r, **kw, out_norm_eps=1e-6)
        assert y is None and h.producer.op.name == want
        with pytest.raises(ValueError, match="out_norm_eps"):
            linear(g, a, w, r, **kw)
    # a width that fits, split too deep for the partials in registers: the norm phase again
    g = mk.Graph("deep")
    t = mk.sym("T", 16)
    a, r = g.input("a", (t, 2048), BF), g.input("r", (t, 2048), BF)
    w, gamma = g.weight("w", (2048, 2048), BF), g.weight("gamma", (2048,), BF)
    kw = dict(block_m=64, block_n=64, fuse_reduce=False, out_norm=gamma, out_norm_eps=1e-6)
    h, y = linear(g, a, w, r, split_k=16, **kw)
    assert y is None and h.producer.op.name == "gemm_split_reduce"
    h, y = linear(g, a, w, r, split_k=8, **kw)
    assert y is not None and y.producer is h.producer
    g = mk.Graph("narrow")
    t = mk.sym("T", 16)
    a, r = g.input("a", (t, 256), BF), g.input("r", (t, 512), BF)
    w, gamma = g.weight("w", (512, 256), BF), g.weight("gamma", (512,), torch.float32)
    with pytest.raises(TypeError, match="out_norm must be"):
        linear(g, a, w, r, block_m=64, block_n=64, split_k=2, out_norm=gamma, out_norm_eps=1e-6)
