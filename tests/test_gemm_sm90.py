"""The Hopper GEMM tile (TMA through the megakernel's ring + wgmma on two consumer warpgroups +
TMA store, ``ops/gemm_sm90.py``): when it applies, what the megakernel compiles to, and its
results against an fp32 torch reference inside the megakernel."""

import os
import re
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.codegen.megakernel import worker_shape
from cutemk.errors import GraphError
from cutemk.layers import mlp_graph, mlp_reference
from cutemk.ops import GemmTile
from cutemk.runtime import compile_offline
from cutemk.tileop import TensorSpec

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

T = mk.sym("T", 8192)


def op_for(dtype, k, n, block, epilogue=None, out_dtype=None) -> GemmTile:
    rows_b = 2 * n if epilogue == "silu_mul" else n
    return GemmTile(
        TensorSpec((T, k), dtype), TensorSpec((rows_b, k), dtype), *block, epilogue, out_dtype
    )


def gemm_graph(dtype, k, n, block, epilogue=None, out_dtype=None, max_t=8192):
    """x @ w^T with the epilogue; with "residual" the graph's third input r (T, n) is added."""
    g = mk.Graph("gemm")
    t = mk.sym("T", max_t)
    x = g.input("x", (t, k), dtype)
    w = g.weight("w", (2 * n if epilogue == "silu_mul" else n, k), dtype)
    extra = [g.input("r", (t, n), out_dtype or dtype)] if epilogue == "residual" else []
    y = g.call(
        ops.gemm,
        x,
        w,
        *extra,
        block_m=block[0],
        block_n=block[1],
        epilogue=epilogue,
        out_dtype=out_dtype,
    )
    g.output(y, "y")
    return g


# -- CPU ------------------------------------------------------------------------------------
def test_hopper_path_applies_only_where_it_can():
    bf = torch.bfloat16
    assert op_for(bf, 4096, 4096, (128, 256)).sm90() is not None
    assert op_for(bf, 4096, 4096, (128, 128), "silu_mul").sm90() is not None
    assert op_for(bf, 4096, 4096, (64, 32), "silu_mul").sm90() is not None
    assert op_for(torch.float16, 64, 64, (64, 64), "silu_mul").sm90() is not None
    assert op_for(bf, 4096, 4096, (128, 256), "silu_mul").sm90() is None  # 2x128x256 acc
    assert op_for(torch.float32, 4096, 4096, (128, 128)).sm90() is None  # fp32 keeps SIMT FMA
    assert op_for(bf, 4100, 4096, (128, 128)).sm90() is None  # rows not 16-byte aligned
    assert op_for(bf, 4096, 4100, (128, 128)).sm90() is None  # C rows not 16-byte aligned
    assert op_for(bf, mk.sym("K", 4096), 4096, (128, 128)).sm90() is None  # unknowable
    assert op_for(bf, 4096, mk.sym("N", 4096), (128, 128)).sm90() is None
    assert op_for(bf, 4096, 4096, (16, 32)).sm90() is None  # below wgmma's 64-row atom
    assert op_for(bf, 4096, 4096, (64, 8)).sm90() is None  # 4 columns a warpgroup
    cfg = op_for(bf, 4096, 4096, (128, 256)).sm90()
    assert cfg.k_tiles == 64 and cfg.stage_bytes == (128 + 256) * 64 * 2 == cfg.slot_bytes
    # a graph of at most 5 rows loads 8-row A boxes, but a slot keeps room for all 64
    small = GemmTile(
        TensorSpec((mk.sym("S", 5), 4096), bf), TensorSpec((4096, 4096), bf), 64, 32
    ).sm90()
    assert small.a_rows == 8 and small.stage_bytes == (8 + 32) * 128
    assert small.slot_bytes == (64 + 32) * 128
    # A boxes are a power of two rows: a 40-row swizzled A layout aborted the compiler
    for rows in range(1, 129):
        a = TensorSpec((mk.sym("S", rows), 4096), bf)
        got = GemmTile(a, TensorSpec((4096, 4096), bf), 64, 32).sm90().a_rows
        assert got == min(64, max(8, 1 << (rows - 1).bit_length())), rows


def test_a_graph_of_forty_rows_compiles(tmp_path):
    compile_offline(
        gemm_graph(torch.bfloat16, 768, 320, (64, 64), max_t=40),
        "static",
        options=f"--keep-ptx --dump-dir={tmp_path}",
    )
    (ptx_file,) = tmp_path.glob("*.ptx")
    ptx = ptx_file.read_text()
    # every TMA descriptor parameter (128 bytes, 64-aligned: A, B, B's up-projection slot,
    # C) is prefetched once at launch, before any task's first box
    descriptors = re.findall(r"\.param \.align 64 \.b8 \w+\[128\]", ptx)
    prefetched = re.findall(r"prefetch\.tensormap\s+\[(%rd\d+)\]", ptx)
    assert len(descriptors) == 4 and len(set(prefetched)) == len(prefetched) == 4, prefetched
    assert ptx.index("prefetch.tensormap") < ptx.index("cp.async.bulk.tensor")


def test_worker_shape_fits_shared_memory_and_counts_agree():
    bf = torch.bfloat16
    big = op_for(bf, 4096, 4096, (128, 256))
    w = worker_shape((big, op_for(bf, 4096, 4096, (128, 128), "silu_mul")))
    assert w.ring_stages >= 3 and w.slot_bytes == 48 * 1024 and w.epi_bytes == 64 * 1024
    assert w.ring_bytes + w.epi_bytes + w.scratch_bytes <= 227 * 1024
    assert w.threads == 384 and w.consumer_warps == 8
    decode = worker_shape((op_for(bf, 4096, 4096, (64, 32), "silu_mul"),))
    assert decode.ring_stages >= 8  # >= 64 KB of weight loads in flight per SM
    # a SIMT op whose scratch leaves no room for two ring slots is refused by name
    huge = op_for(bf, 4096, 4096, (128, 256))
    with pytest.raises(GraphError, match=r"fewer than 2 ring slots.*of scratch \(fat\)"):
        worker_shape((huge, _FatScratch()))


class _FatScratch:
    """Stand-in for a SIMT op with a large scratch (only the methods worker_shape reads)."""

    name = "fat"

    def ring_tile(self):
        return None

    def device_smem_bytes(self):
        return 120 * 1024


@pytest.mark.parametrize(
    "block,epilogue,scheduler",
    [((128, 256), None, "static"), ((64, 32), "silu_mul", "dynamic")],
    ids=["128x256-static", "64x32-silu-dynamic"],
)
def test_megakernel_compiles_to_the_warp_specialized_hopper_worker(block, epilogue, scheduler):
    g = gemm_graph(torch.bfloat16, 1024, 2048, block, epilogue)
    with tempfile.TemporaryDirectory() as dump:
        fn = compile_offline(g, scheduler, options=f"--keep-ptx --dump-dir={dump}")
        ptx = fn.__ptx__ if "\n" in (fn.__ptx__ or "") else open(fn.__ptx__).read()
    nb = 2 if epilogue else 1
    assert ptx.count("wgmma.mma_async") == (64 // 16) * nb  # one k-slice, unrolled
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx  # TMA loads into the ring
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx  # TMA store of the tile
    assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", ptx)  # store done before notify
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)
    assert "fence.proxy.async.global" in ptx and "fence.proxy.async.shared::cta" in ptx
    assert "mbarrier.try_wait.parity" in ptx and "mbarrier.arrive.expect_tx" in ptx
    assert "ld.acquire.gpu" in ptx
    assert "red.release.gpu" in ptx if scheduler == "static" else "atom.global.acq_rel" in ptx
    # the epilogue hand-off between the consumers and the storer warp: the staged record by
    # an mbarrier every consumer thread arrives on, the staging buffer's release by one every
    # storer lane arrives on (no named barrier 3 or 4); the whole CTA meets only at entry and
    # exit
    assert not re.search(r"\b(bar|barrier)(\.cta)?\.(arrive|sync)\s+[34],", ptx)
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)  # staging free early


# -- GPU ------------------------------------------------------------------------------------
PROBLEMS = [(384, 4096), (272, 520)]  # (N, K): N not a multiple of the tile, K of the slice
TOKENS = (1, 7, 129, 1000)  # one compiled kernel serves them all
CONFIGS = [  # (block, epilogue, out dtype, scheduler)
    ((128, 256), None, None, "static"),
    ((128, 128), None, None, "dynamic"),
    ((128, 128), "silu_mul", None, "static"),
    ((64, 32), "silu_mul", None, "dynamic"),
    ((64, 128), None, None, "static"),
    ((64, 256), None, torch.float32, "static"),
    ((128, 256), "residual", None, "dynamic"),
    ((64, 128), "residual", torch.float32, "static"),
    ((128, 96), "silu_mul", None, "static"),  # MegaMLP's wave-fitted decode widths
    ((128, 112), "silu_mul", None, "dynamic"),
    ((64, 96), "silu_mul", None, "static"),  # 48-column warpgroup halves: 32B epilogue atoms
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "block,epilogue,out_dtype,scheduler",
    CONFIGS,
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_hopper_gemm_matches_reference(block, epilogue, out_dtype, scheduler):
    """Every tile shape and epilogue, both schedulers, 8 shapes each (T = 1, 7, 129, 1000
    against two (N, K)), outputs NaN-poisoned, fresh random inputs."""
    torch.manual_seed(sum(block))
    for n, k in PROBLEMS:
        g = gemm_graph(torch.bfloat16, k, n, block, epilogue, out_dtype, max_t=1024)
        c = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
        nb = 2 if epilogue == "silu_mul" else 1
        w = (torch.randn(nb * n, k, device="cuda") / k**0.5).bfloat16()
        for t in TOKENS:
            x = torch.randn(t, k, device="cuda").bfloat16()
            extra = []
            if epilogue == "residual":
                extra = [torch.randn(t, n, device="cuda").to(out_dtype or torch.bfloat16)]
            y = c(x, w, *extra)
            ref = x.float() @ w.float().T
            if epilogue == "silu_mul":
                ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
            if extra:
                ref = ref + extra[0].float()
            assert y.dtype == (out_dtype or torch.bfloat16)
            assert not torch.isnan(y).any(), f"T={t} N={n} K={k}: unwritten output"
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"T={t} N={n} K={k}: rel err {err:.2e}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("blocks", [(128, 128), (64, 32)], ids=["prefill", "decode"])
def test_megakernel_mlp_with_hopper_tiles(scheduler, blocks):
    """A Qwen3-1.7B-sized MLP: TMA tiles read the activations other SMs wrote (TMA stores) in
    the same launch; the down GEMM's weights load before its events."""
    torch.manual_seed(1)
    H, I = 2048, 6144
    g = mlp_graph(mk.sym("T", max=1024), H, I, torch.bfloat16, *blocks, fuse_silu=True)
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


def test_weight_loads_precede_events_only_for_leaves():
    """A GEMM's B loads are issued before its events only where no node writes B."""
    from cutemk.runtime import kernel_spec

    g = mk.Graph("bprod")
    x = g.input("x", (mk.sym("T", 256), 256), torch.bfloat16)
    w = g.weight("w", (256, 256), torch.bfloat16)
    h = g.call(ops.gemm, x, w, block_m=64, block_n=64)  # B is a weight: prefetched
    y = g.call(ops.gemm, x, h, block_m=64, block_n=64)  # B is produced in the launch
    g.output(y, "y")
    spec = kernel_spec(g, dynamic=False)
    assert spec.prefetch == (True, False)
    assert spec.worker.threads == 384 and spec.worker.ring_stages >= 2


def test_worker_shape_checks_its_register_split():
    from cutemk.device.config import WorkerShape

    WorkerShape().check()
    with pytest.raises(AssertionError, match="registers"):
        WorkerShape(producer_regs=64, consumer_regs=240).check()
    with pytest.raises(AssertionError):
        WorkerShape(ring_stages=1, slot_bytes=1024).check()


def test_the_kernels_own_shared_memory_and_the_reserve(monkeypatch):
    """The kernel's own pieces ahead of the ring fit one 1024-byte block at any ring depth, so
    a reserve of 1024 (``CUTEMK_SMEM_RESERVED``, a tuning knob until run on a GPU) is exact:
    the MoE prefill kernel then takes a sixth 32 KB slot (232,448 B in all, the limit)."""
    from cutemk.codegen import megakernel as mkm
    from cutemk.kernels import kernel_spec
    from cutemk.regimes import moe_regime_graph

    assert mkm.own_smem_bytes(4, mkm.MAX_RING_STAGES) <= 1024
    g = moe_regime_graph(2048, 768, 128, 8, True, "prefill", torch.bfloat16, 4096)
    w = kernel_spec(g, False).worker
    assert (w.ring_stages, w.slot_bytes, w.epi_bytes) == (5, 32768, 32768)
    monkeypatch.setattr(mkm, "SMEM_RESERVED", 1024)
    w = kernel_spec(g, False).worker
    assert w.ring_stages == 6
    assert 1024 + w.ring_bytes + w.epi_bytes + w.scratch_bytes == mkm.SMEM_LIMIT


def test_an_op_whose_scratch_passes_the_sm_is_refused_by_name():
    """moe_route's counting scratch grows with E: at 1024 experts (16-bit counters) it passes
    Hopper's 227 KB, which the kernel used to find out only at launch."""
    from cutemk.runtime import kernel_spec

    g = mk.Graph("route1024")
    ids = g.input("ids", (mk.sym("T", 64), 8), torch.int32)
    tile_info, _, _, _ = g.call(ops.moe_route, ids, num_experts=1024, block_m=16)
    g.output(tile_info, "tile_info")
    with pytest.raises(GraphError, match=r"moe_route needs \d+ B of shared memory"):
        kernel_spec(g, dynamic=False)


def test_residual_epilogue_compiles_and_interprets():
    """C = A @ B^T + R: the Hopper tile reads R in its epilogue (generic loads after the task's
    acquire), and the interpreter's reference adds it; R produced in the launch is waited on."""
    g = gemm_graph(torch.bfloat16, 512, 256, (128, 128), "residual", max_t=1024)
    with tempfile.TemporaryDirectory() as dump:
        fn = compile_offline(g, "static", options=f"--keep-ptx --dump-dir={dump}")
        ptx = fn.__ptx__ if "\n" in (fn.__ptx__ or "") else open(fn.__ptx__).read()
    assert ptx.count("wgmma.mma_async") == 64 // 16
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx
    # in-launch residual: y = x @ w2^T + (x @ w1^T), fp32 on the interpreter
    g = mk.Graph("res_chain")
    x = g.input("x", (mk.sym("T", 256), 64), torch.float32)
    w1 = g.weight("w1", (48, 64), torch.float32)
    w2 = g.weight("w2", (48, 64), torch.float32)
    h = g.call(ops.gemm, x, w1, block_m=16, block_n=16)
    y = g.call(ops.gemm, x, w2, h, block_m=32, block_n=16)
    g.output(y, "y")
    c = g.compile("interpret", num_sms=4, scheduler="dynamic", seed=1)
    xs, a, b = torch.randn(37, 64), torch.randn(48, 64), torch.randn(48, 64)
    torch.testing.assert_close(c(xs, a, b), xs @ b.T + xs @ a.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="residual"):
        GemmTile(
            TensorSpec((T, 64), torch.float32),
            TensorSpec((48, 64), torch.float32),
            epilogue="residual",
        )


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_residual_produced_in_the_launch(scheduler):
    """y = x @ w2^T + h with h = x @ w1^T written by other SMs' TMA stores in the same launch:
    the epilogue's generic loads of h follow the task's acquire."""
    torch.manual_seed(3)
    g = mk.Graph("res_chain")
    x = g.input("x", (mk.sym("T", 1024), 512), torch.bfloat16)
    w1 = g.weight("w1", (384, 512), torch.bfloat16)
    w2 = g.weight("w2", (384, 512), torch.bfloat16)
    h = g.call(ops.gemm, x, w1, block_m=128, block_n=128)
    y = g.call(ops.gemm, x, w2, h, block_m=64, block_n=128)
    g.output(y, "y")
    c = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
    a = (torch.randn(384, 512, device="cuda") / 22).bfloat16()
    b = (torch.randn(384, 512, device="cuda") / 22).bfloat16()
    for t in (1, 100, 1024):
        xs = torch.randn(t, 512, device="cuda").bfloat16()
        out = c(xs, a, b)
        hb = (xs.float() @ a.float().T).bfloat16().float()  # h is stored in bf16
        ref = xs.float() @ b.float().T + hb
        assert not torch.isnan(out).any()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"T={t}: rel err {err:.2e}"
