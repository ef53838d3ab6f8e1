"""The Hopper GEMM tile (TMA + wgmma, ``ops/gemm_sm90.py``): when it applies, what it compiles
to, and its results against an fp32 torch reference, alone and inside the megakernel."""

import os
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch
from cutemk.ops import GemmTile
from cutemk.ops.gemm_sm90 import sm90_config

import cutemk as mk
from cutemk.device.harness import compile_tile, concrete_grid
from cutemk.layers import mlp_graph, mlp_reference
from cutemk.tileop import TensorSpec

from test_device_ops import fake_tensors, run_and_check

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
T, N = mk.sym("T", 4096), mk.sym("N", 8192)


def op_for(dtype, k, block, epilogue=None) -> GemmTile:
    rows_b = 2 * N if epilogue == "silu_mul" else N
    return GemmTile(TensorSpec((T, k), dtype), TensorSpec((rows_b, k), dtype), *block, epilogue)


# -- CPU ------------------------------------------------------------------------------------
def test_hopper_path_applies_only_where_it_can():
    bf = torch.bfloat16
    assert op_for(bf, 4096, (128, 128)).sm90() is not None
    assert op_for(torch.float16, 64, (64, 64), "silu_mul").sm90() is not None
    assert op_for(bf, 4096, (128, 128), "silu_mul").sm90() is None  # 2x128x128 accumulators
    assert op_for(torch.float32, 4096, (128, 128)).sm90() is None  # fp32 keeps SIMT FMA
    assert op_for(bf, 4100, (128, 128)).sm90() is None  # rows not 16-byte aligned for TMA
    assert op_for(bf, mk.sym("K", 4096), (128, 128)).sm90() is None  # alignment unknowable
    assert op_for(bf, 4096, (16, 32)).sm90() is None  # below wgmma's 64-row atom
    cfg = sm90_config(bf, 128, 128, 4096, False)
    assert cfg.stages >= 3 and cfg.smem_bytes() <= 227 * 1024


@pytest.mark.parametrize(
    "dtype,block,epilogue",
    [
        (torch.bfloat16, (128, 128), None),
        (torch.bfloat16, (128, 64), "silu_mul"),
        (torch.float16, (64, 256), None),
    ],
    ids=["bf16-128x128", "bf16-128x64-silu_mul", "fp16-64x256"],
)
def test_hopper_tile_compiles_to_tma_and_wgmma(dtype, block, epilogue):
    op = op_for(dtype, 2048, block, epilogue)
    with tempfile.TemporaryDirectory() as dump:
        compiled = compile_tile(op, fake_tensors(op), options=f"--keep-ptx --dump-dir={dump}")
        ptx = compiled.ptx if "\n" in (compiled.ptx or "") else open(compiled.ptx).read()
    cfg = op.sm90()
    k_steps = 64 // 16
    assert ptx.count("wgmma.mma_async") == k_steps * (cfg.bm // 64) * cfg.n_b
    assert "cp.async.bulk.tensor.2d" in ptx
    assert "mbarrier.try_wait" in ptx
    assert "fence.proxy.async" in ptx


# -- GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "dtype,block,epilogue",
    [
        (torch.bfloat16, (128, 128), None),
        (torch.bfloat16, (64, 64), None),
        (torch.bfloat16, (128, 64), "silu_mul"),
        (torch.float16, (64, 128), "silu_mul"),
        (torch.bfloat16, (64, 256), None),
    ],
    ids=["bf16-128x128", "bf16-64x64", "bf16-128x64-silu", "fp16-64x128-silu", "bf16-64x256"],
)
@pytest.mark.parametrize("k", [64, 520, 4096])
def test_hopper_tile_matches_reference(dtype, block, epilogue, k):
    torch.manual_seed(k)
    op = op_for(dtype, k, block, epilogue)
    assert op.sm90() is not None
    nb = 2 if epilogue == "silu_mul" else 1
    for m, n in ((1, 200), (100, 1024), (300, 136)):
        a = torch.randn(m, k, device="cuda").to(dtype)
        b = (torch.randn(nb * n, k, device="cuda") / k**0.5).to(dtype)
        run_and_check(op, {"T": m, "N": n}, {"a": a, "b": b}, dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_megakernel_mlp_with_hopper_tiles(scheduler, fuse):
    """A Qwen3-1.7B-sized MLP: TMA tiles read the activations other SMs wrote in the same launch."""
    torch.manual_seed(1)
    H, I = 2048, 6144
    g = mlp_graph(mk.sym("T", max=1024), H, I, torch.bfloat16, 128, 64 if fuse else 128, fuse)
    assert all(n.op.sm90() is not None for n in g.nodes if isinstance(n.op, GemmTile))
    c = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
    wgu = (torch.randn(2 * I, H, device="cuda") / H**0.5).bfloat16()
    wd = (torch.randn(H, I, device="cuda") / I**0.5).bfloat16()
    for t in (1, 77, 1024):
        x = torch.randn(t, H, device="cuda").bfloat16()
        y = c(x, wgu, wd)
        ref = mlp_reference(x, wgu, wd)
        assert not torch.isnan(y).any()
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"T={t}: rel err {err:.2e}"


def test_concrete_grid_of_hopper_op():  # the harness grid follows block_m/block_n
    op = op_for(torch.bfloat16, 512, (128, 64))
    assert concrete_grid(op, {"T": 300, "N": 1000}) == (3, 16)
